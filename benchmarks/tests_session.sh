#!/usr/bin/env bash
# One device call: build, the GPU tests in four parallel groups, then the
# quantize bench with the SM clock logged every ~100 ms (quantize_smi.csv).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SKIP_QUANTIZE_BENCH=1 SKIP_LINEAR_BENCH=1 SKIP_SANITIZER=1 bash benchmarks/gpu_session.sh \
  "tests/test_quantize.py;tests/test_cuda_gemm.py tests/test_recipe.py tests/test_gemm.py;tests/test_stochastic.py tests/test_numerics.py;tests/test_flax.py tests/test_equinox.py tests/test_errors.py tests/test_policy.py" > "$OUT/session.txt" 2>&1
echo "gpu_session rc=$?" >> "$OUT/session.txt"
for f in "$OUT"/pytest_*.txt; do echo "== $f"; grep -vE "^\.+ +\[" "$f" | tail -30; done > "$OUT/pytest.txt" 2>/dev/null
rm -f "$OUT"/pytest_*.txt "$OUT/build.log"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
bash benchmarks/log_clocks.sh "$OUT/quantize_smi.csv" &
logger=$!
echo "quantize start $(date +%s.%N)" > "$OUT/quantize_window.txt"
timeout 200 python3 benchmarks/quantize_bench.py --kernels --out "$OUT/quantize_bench.json" > "$OUT/quantize_bench.txt" 2>&1
echo "quantize_bench rc=$?" >> "$OUT/session.txt"
echo "quantize end $(date +%s.%N)" >> "$OUT/quantize_window.txt"
kill $logger
cat "$OUT/session.txt" | grep -vE "^\s*$" | tail -30; cat "$OUT/pytest.txt" | tail -40; tail -22 "$OUT/quantize_bench.txt"
awk -F', ' '$2>400 {print $2}' "$OUT/quantize_smi.csv" | sort -n | uniq -c | sort -rn | head -5
