#!/usr/bin/env bash
# The maintainer's check on a CUDA GPU machine, run from the repository root:
# builds and installs jax_nvfp4 with its CUDA handlers, runs the whole test
# suite on the GPU, runs compute-sanitizer memcheck and racecheck over
# tools/sanitizer_smoke.py (every CUDA kernel once), checks the fast device
# arithmetic against the numerics header on every float32 bit pattern
# (tools/fast_numerics_check.cu), and optionally runs the benchmarks.
#
#   bash tools/gpu_check.sh                      # build, tests, sanitizer, numerics
#   bash tools/gpu_check.sh --tests --out /tmp/check
#   bash tools/gpu_check.sh --bench --out "$OUT" # build and the benchmarks only
#   bash tools/gpu_check.sh --all                # everything (longer than 10 min)
#
# Steps (none named: --tests --sanitizer --numerics):
#   --tests       pytest -q tests against the installed package (pytest -P:
#                 the source tree has no compiled handlers), in --jobs
#                 processes when pytest-xdist is there (compiling the tests'
#                 computations is CPU-bound); arguments after -- replace "tests"
#   --sanitizer   compute-sanitizer --tool memcheck and --tool racecheck, each
#                 smoke part (tools/sanitizer_smoke.py --list) in a process of
#                 its own, the processes side by side
#   --numerics    builds and runs tools/fast_numerics_check.cu (sm_90a)
#   --bench       benchmarks/quantize_bench.py --kernels and
#                 benchmarks/linear_bench.py --clocks (about 9 minutes on an
#                 H200); with 2+ GPUs also benchmarks/multi_gpu_check.py
#   --all         all of the above
# Options:
#   --out DIR     where the logs go (default $OUT, else /tmp/gpu_check): at most
#                 8 files, so that a device machine can return all of them:
#                 summary.txt (one line per step, the GPU and the versions),
#                 build.log (kept only if the build fails), pytest.log,
#                 sanitizer.log, numerics.log, bench.log, quantize_bench.json,
#                 linear_bench.json
#   --jobs N      pytest processes (default 8; 1 runs them in one process)
#   --no-build    test the package already installed
# On a lent device machine (10 minutes a command) split the steps over calls
# to the same warm machine: "--tests", then "--no-build --sanitizer --numerics".
# Scripts run as `python3 path/script.py` (and pytest with -P), so Python
# imports the installed package, not the source tree's jax_nvfp4/.
# Environment: the CUDA toolkit's cublasLt.h is found under /usr/local/cuda
# (else set JAX_NVFP4_CUBLAS_INCLUDE_DIR); every step is time-boxed
# (PYTEST_TIMEOUT, SANITIZER_TIMEOUT, BENCH_TIMEOUT seconds). The GPU's
# clocks and power limits are read, never set. Exit status: 0 if every step
# that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."

steps=() out="${OUT:-/tmp/gpu_check}" jobs=8 build=1 pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tests | --sanitizer | --numerics | --bench) steps+=("${1#--}") ;;
    --all) steps=(tests sanitizer numerics bench) ;;
    --out) out="$2"; shift ;;
    --jobs) jobs="$2"; shift ;;
    --no-build) build=0 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; pytest_args=("$@"); break ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#steps[@]} -gt 0 ] || steps=(tests sanitizer numerics)
wants() { [[ " ${steps[*]} " == *" $1 "* ]]; }

mkdir -p "$out"
out="$(cd "$out" && pwd)"
summary="$out/summary.txt"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
note() { echo "$*" | tee -a "$summary"; }
result() {  # result NAME RC DETAIL: one line per step, the status kept
  local word=ok
  [ "$2" -eq 0 ] || { word="FAILED (rc $2)"; status=1; }
  note "$1: $word${3:+ | $3}"
}

: > "$summary"
note "gpu_check: $(date -u +%Y-%m-%dT%H:%MZ) | $(git rev-parse --short HEAD 2>/dev/null || echo no-git)$(git diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)') | steps: ${steps[*]}"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader 2>&1 \
  | sed 's/^/gpu: /' | tee -a "$summary"
python3 -c "import jax; print('python', __import__('sys').version.split()[0], '| jax', jax.__version__, '|', jax.devices())" 2>&1 | tee -a "$summary"

if [ "$build" = 1 ]; then
  cuda_include=/usr/local/cuda/targets/x86_64-linux/include
  [ -f "$cuda_include/cublasLt.h" ] &&
    export JAX_NVFP4_CUBLAS_INCLUDE_DIR="${JAX_NVFP4_CUBLAS_INCLUDE_DIR:-$cuda_include}"
  t0=$(date +%s)
  JAX_NVFP4_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" timeout 600 \
    python3 -m pip install --no-build-isolation --no-deps -q . > "$out/build.log" 2>&1
  rc=$?
  result build "$rc" "$(($(date +%s) - t0)) s"
  if [ "$rc" -ne 0 ]; then tail -40 "$out/build.log"; exit 1; fi
  rm -f "$out/build.log"
fi
# -P and another directory: the installed package, not ./jax_nvfp4.
(cd / && python3 -P -c "
import jax_nvfp4 as nv
from jax_nvfp4.ops import dispatch
print('installed:', nv.__file__, '| handlers on', sorted(nv.available_platforms()), '| dense GEMM path:', dispatch.dense_path(), '| grouped:', dispatch.grouped_path())
") 2>&1 | tee -a "$summary"

if wants tests; then
  xdist=()
  if [ "$jobs" -gt 1 ] && python3 -c "import xdist" 2>/dev/null; then
    xdist=(-n "$jobs" --dist loadfile)
  fi
  t0=$(date +%s)
  timeout "${PYTEST_TIMEOUT:-540}" python3 -P -m pytest -q -rfE -p no:cacheprovider \
    "${xdist[@]}" "${pytest_args[@]:-tests}" > "$out/pytest.log" 2>&1
  rc=$?
  counts="$(grep -E '[0-9]+ (passed|failed|errors?|skipped).* in [0-9.]+s' "$out/pytest.log" | tail -1 | tr -d '=')"
  result tests "$rc" "${counts:-no summary line} | $(($(date +%s) - t0)) s wall${xdist:+, $jobs processes}"
  grep -E '^(FAILED|ERROR) ' "$out/pytest.log" | head -20 | tee -a "$summary"
fi

if wants sanitizer; then
  sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  # Each smoke part under each tool in a process of its own, all at once
  # (they share the GPU). XLA compiles on one thread: with parallel
  # compilation the sanitizer's own process can die of SIGSEGV
  # (tools/sanitizer_repro.py shows it without jax_nvfp4).
  parts="$(python3 tools/sanitizer_smoke.py --list)"
  work="$(mktemp -d)"
  for tool in memcheck racecheck; do
    for part in $parts; do
      (
        XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_force_compilation_parallelism=1" \
          timeout "${SANITIZER_TIMEOUT:-420}" "$sanitizer" --tool "$tool" --error-exitcode 3 \
          python3 tools/sanitizer_smoke.py --parts "$part" > "$work/$tool.$part.log" 2>&1
        echo $? > "$work/$tool.$part.rc"
      ) &
    done
  done
  wait
  : > "$out/sanitizer.log"
  for tool in memcheck racecheck; do
    for part in $parts; do
      { echo "=== compute-sanitizer --tool $tool: $part"; cat "$work/$tool.$part.log"; } >> "$out/sanitizer.log"
      result "sanitizer $tool $part" "$(cat "$work/$tool.$part.rc")" \
        "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$work/$tool.$part.log" | tail -1)"
    done
  done
  rm -rf "$work"
fi

if wants numerics; then
  {
    "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" -std=c++17 -O3 --fmad=false -ftz=true \
      -gencode=arch=compute_90a,code=sm_90a -I ffi tools/fast_numerics_check.cu \
      -o /tmp/fast_numerics_check && timeout 300 /tmp/fast_numerics_check
  } > "$out/numerics.log" 2>&1
  result numerics "$?" "$(tail -1 "$out/numerics.log")"
fi

if wants bench; then
  : > "$out/bench.log"
  run_bench() {  # run_bench NAME SCRIPT ARGS...
    local name="$1"; shift
    echo "=== $*" >> "$out/bench.log"
    timeout "${BENCH_TIMEOUT:-540}" python3 "$@" >> "$out/bench.log" 2>&1
    result "$name" "$?"
  }
  run_bench quantize_bench benchmarks/quantize_bench.py --kernels \
    --out "$out/quantize_bench.json"
  run_bench linear_bench benchmarks/linear_bench.py --clocks --out "$out/linear_bench.json"
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  [ "$gpus" -gt 1 ] && run_bench multi_gpu_check benchmarks/multi_gpu_check.py
  grep -A40 -E '^ +op +ms|^ +shape +op' "$out/bench.log" | grep -vE '^    ' | tail -60
fi

note "gpu_check: $([ "$status" -eq 0 ] && echo 'all passed' || echo 'FAILURES') (logs in $out)"
exit "$status"
