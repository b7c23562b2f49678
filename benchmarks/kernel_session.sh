#!/usr/bin/env bash
# One device call for a quantize-kernel change (~6 minutes on an H200):
# gpu_session.sh (build, GPU tests in parallel groups, quantize bench,
# compute-sanitizer memcheck + racecheck; no linear bench), the exhaustive
# fast-numerics check, and the Nsight Compute stall profile of the fused
# kernel (profile_session.sh; STEP_SHAPES adds its step traces).
# SKIP_FAST_NUMERICS=1 / SKIP_NCU=1 leave those out. The logs are folded into at
# most 5 files under $OUT (a device call brings back 8):
#   session.txt        GPU, build time, test summaries, sanitizer and
#                      fast-numerics results
#   pytest.txt         the pytest logs
#   bench.txt, quantize_bench.json, ncu_stalls.txt
#   bash benchmarks/kernel_session.sh ["tests groups separated by ';'"]
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
tests="${1:-tests/test_quantize.py;tests/test_cuda_gemm.py tests/test_gemm.py tests/test_recipe.py;tests/test_stochastic.py tests/test_numerics.py tests/test_sharding.py}"
SKIP_LINEAR_BENCH=1 bash benchmarks/gpu_session.sh "$tests" > "$OUT/session.txt" 2>&1
echo "gpu_session rc=$?" >> "$OUT/session.txt"
[ -n "${SKIP_FAST_NUMERICS:-}" ] || {
  /usr/local/cuda/bin/nvcc -std=c++17 -O3 --fmad=false -ftz=true -arch=sm_90a -I ffi \
    benchmarks/fast_numerics_check.cu -o /tmp/fast_numerics_check &&
    timeout 120 /tmp/fast_numerics_check
  echo "fast_numerics_check rc=$?"
} >> "$OUT/session.txt" 2>&1
STEP_SHAPES="${STEP_SHAPES:- }" bash benchmarks/profile_session.sh >> "$OUT/session.txt" 2>&1
for f in "$OUT"/sanitizer_*.txt; do
  [ -f "$f" ] && { echo "== $f"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|smoke|Error" "$f" | head -20; }
done >> "$OUT/session.txt"
for f in "$OUT"/pytest_*.txt; do echo "== $f"; cat "$f"; done > "$OUT/pytest.txt" 2>/dev/null
cat "$OUT/gpu.txt" >> "$OUT/session.txt"
rm -f "$OUT"/pytest_*.txt "$OUT"/sanitizer_*.txt "$OUT"/step_profile.txt "$OUT/gpu.txt"
grep -q "gpu_session rc=0" "$OUT/session.txt" && rm -f "$OUT/build.log"
cat "$OUT/session.txt"
