#!/usr/bin/env bash
# One device call (~5 minutes on an H200): build with CUDA, the GPU tests,
# the quantize and linear benchmarks, compute-sanitizer memcheck + racecheck
# (each step time-boxed). Results land in $OUT.
#   bash benchmarks/gpu_session.sh [tests-to-run]   (groups separated by ';'
#   run as parallel pytest processes)
# SKIP_QUANTIZE_BENCH=1 / SKIP_LINEAR_BENCH=1 / SKIP_SANITIZER=1 leave those steps out; KEEP_HLO=1
# writes the linear steps' compiled HLO to $OUT/hlo; LINEAR_SHAPES,
# SANITIZERS ("memcheck racecheck") and PYTEST_TIMEOUT narrow a short call.
# The linear bench times 3 interleaved rounds (~400 s for both shapes): with the
# tests it needs a device call of its own (the limit is 600 s per call).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
tests="${1:-tests/test_quantize.py tests/test_stochastic.py tests/test_numerics.py tests/test_gemm.py tests/test_recipe.py}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
pip list 2>/dev/null | grep -iE "^(jax|flax|equinox|optax|nvidia|ml.dtypes|numpy)" >> "$OUT/gpu.txt"
bash benchmarks/build_cuda.sh "$OUT/build.log" || exit 1
(cd /tmp && python3 -c "import jax_nvfp4 as nv, jax_nvfp4.cuda_gemm as g; print('handlers:', sorted(nv.available_platforms()), 'GEMM path:', g.gemm_path())")
grep -E "cuBLASLt|Blackwell" "$OUT/build.log" | head -4
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# The tests import the installed package (see gpu_tests_parallel.sh).
python3 -P -c "import jax_nvfp4 as nv; print('tests import', nv.__file__, sorted(nv.available_platforms()))"
IFS=';' read -ra test_groups <<< "$tests"
bash benchmarks/gpu_tests_parallel.sh "${test_groups[@]}"
[ -n "${SKIP_QUANTIZE_BENCH:-}" ] || timeout 200 python3 benchmarks/quantize_bench.py --kernels --out "$OUT/quantize_bench.json" 2>&1 | tee "$OUT/bench.txt" | tail -16
if [ -z "${SKIP_LINEAR_BENCH:-}" ]; then
hlo=(); [ -n "${KEEP_HLO:-}" ] && { mkdir -p "$OUT/hlo"; hlo=(--hlo-dir "$OUT/hlo"); }
timeout "${BENCH_TIMEOUT:-500}" python3 benchmarks/linear_bench.py --out "$OUT/linear_bench.json" "${hlo[@]}" \
  --linear "${LINEAR_SHAPES:-8192x4096x14336,16384x8192x28672}" 2>&1 | tee "$OUT/linear_bench.txt" | tail -30
fi
[ -n "${SKIP_SANITIZER:-}" ] && exit 0
for tool in ${SANITIZERS:-memcheck racecheck}; do
  timeout "${SANITIZER_TIMEOUT:-100}" compute-sanitizer --tool $tool python3 tests/sanitizer_smoke.py > "$OUT/sanitizer_$tool.txt" 2>&1
  echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|smoke' "$OUT/sanitizer_$tool.txt" | tr '\n' ' ')"
done
