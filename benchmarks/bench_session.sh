#!/usr/bin/env bash
# One device call: build, then linear_bench.py (all ops, both linear shapes,
# the GEMM; each op settles before it is timed) with the GPU's SM clock,
# power and temperature logged every 100 ms (smi.csv; Unix time in column 1)
# and nvidia-smi's performance and power report before and after (smi_q.txt).
# Extra arguments go to linear_bench.py. SANITIZERS="memcheck racecheck"
# adds compute-sanitizer runs of tests/sanitizer_smoke.py after the bench.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
bash benchmarks/build_cuda.sh "$OUT/build.log" || exit 1; rm -f "$OUT/build.log"
nvidia-smi -q -d PERFORMANCE,POWER,CLOCK > "$OUT/smi_q.txt" 2>&1
bash benchmarks/log_clocks.sh "$OUT/smi.csv" &
logger=$!
timeout "${BENCH_TIMEOUT:-480}" python3 benchmarks/linear_bench.py --out "$OUT/linear.json" "$@" 2>&1 \
  | tee "$OUT/linear.txt"
echo "linear_bench rc=${PIPESTATUS[0]}"
kill "$logger"
python3 benchmarks/clock_summary.py "$OUT/linear.json" "$OUT/smi.csv" | tee "$OUT/clocks.txt"
for tool in ${SANITIZERS:-}; do
  timeout 150 compute-sanitizer --tool "$tool" python3 tests/sanitizer_smoke.py > "$OUT/sanitizer_$tool.txt" 2>&1
  echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|smoke' "$OUT/sanitizer_$tool.txt" | tr '\n' ' ')"
done
echo "=== after" >> "$OUT/smi_q.txt"; nvidia-smi -q -d PERFORMANCE,POWER,CLOCK >> "$OUT/smi_q.txt" 2>&1
grep -iE "Power Limit|Max Clocks|SW Power|HW Slowdown|Thermal" "$OUT/smi_q.txt" | sort | uniq -c | head -30
