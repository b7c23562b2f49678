#!/usr/bin/env bash
# Device calls: build with CUDA, then one phase (each fits one 10-minute call).
#   bash benchmarks/gpu_session.sh bench      # quantize benchmark + GPU tests
#   bash benchmarks/gpu_session.sh sanitize   # compute-sanitizer + the other tests
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
phase="${1:-bench}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
JAX_NVFP4_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 300 python3 -m pip install \
  --no-build-isolation --no-deps -q . > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
(cd /tmp && python3 -c "import jax_nvfp4 as nv; print('handlers:', sorted(nv.available_platforms()))")
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ "$phase" = bench ]; then
  timeout 240 python3 benchmarks/quantize_bench.py --out "$OUT/quantize_bench.json" 2>&1 | tee "$OUT/bench.txt" | tail -20
  timeout 240 pytest -q tests/test_quantize.py tests/test_stochastic.py 2>&1 | tee "$OUT/pytest_bench_phase.txt" | tail -15
else
  for tool in memcheck racecheck; do
    timeout 150 compute-sanitizer --tool $tool python3 tests/sanitizer_smoke.py > "$OUT/sanitizer_$tool.txt" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|smoke' "$OUT/sanitizer_$tool.txt" | tr '\n' ' ')"
  done
  timeout 240 pytest -q tests/test_numerics.py tests/test_errors.py 2>&1 | tee "$OUT/pytest_sanitize_phase.txt" | tail -15
fi
