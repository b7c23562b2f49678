#!/usr/bin/env bash
# One device call: build, the GPU tests named in $1 (groups separated by ';'),
# then benchmarks/wall_gap.py under each XLA configuration below (one process
# each: XLA reads its flags once), and a step trace with XLA's CUDA graphs
# kept (step_profile.py --graphs-in-trace). GAP_CONFIGS narrows the list.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
tests="${1:-tests/test_cuda_gemm.py tests/test_recipe.py tests/test_gemm.py}"
SKIP_QUANTIZE_BENCH=1 SKIP_LINEAR_BENCH=1 SKIP_SANITIZER=1 \
  bash benchmarks/gpu_session.sh "$tests" > "$OUT/session.txt" 2>&1
echo "gpu_session rc=$?" >> "$OUT/session.txt"
for f in "$OUT"/pytest_*.txt; do echo "== $f"; tail -25 "$f"; done >> "$OUT/session.txt" 2>/dev/null
rm -f "$OUT"/pytest_*.txt
declare -A flags=(
  [default]=""
  [no_graphs]="--xla_gpu_enable_command_buffer="
  [trace_cache_64]="--xla_cmd_buffer_trace_cache_size=64"
  [gemm_outside_graphs]="JAX_NVFP4_GEMM_GRAPHS=0"
)
for label in ${GAP_CONFIGS:-default no_graphs gemm_outside_graphs trace_cache_64}; do
  f="${flags[$label]}"
  if [[ "$f" == JAX_NVFP4_* ]]; then
    env "$f" timeout 120 python3 benchmarks/wall_gap.py --label "$label" --out "$OUT/gap_$label.json"
  else
    XLA_FLAGS="$f" timeout 120 python3 benchmarks/wall_gap.py --label "$label" --out "$OUT/gap_$label.json"
  fi
  echo "wall_gap $label rc=$?"
done > "$OUT/gap.txt" 2>&1
[ -n "${SKIP_STEP:-}" ] || timeout 150 python3 benchmarks/step_profile.py --graphs-in-trace \
  --repeat 4 --calls 3 --out "$OUT/step_graphs.json" > "$OUT/step_graphs.txt" 2>&1
echo "step rc=$?" >> "$OUT/step_graphs.txt"
cat "$OUT/session.txt" | grep -vE "^\s*$" | tail -60; grep -vE "^(skipped|WARNING)" "$OUT/gap.txt"
grep -vE "x1 .*fusion" "$OUT/step_graphs.txt" | head -60
