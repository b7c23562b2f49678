#!/usr/bin/env bash
# Convergence run on one H200: a 57M-parameter Llama-style byte-level decoder
# (examples/llama_equinox.py) trained for 2000 steps of 64 x 256 = 16,384
# tokens on GCIDE (examples/text_data.py), in bf16, nvfp4, nvfp4 without the
# Random Hadamard Transform and nvfp4 without stochastic rounding; then the
# summary table and plot (benchmarks/plot_convergence.py).
#
#   python examples/text_data.py prepare --out .data/   # once, with network
#   bash benchmarks/convergence.sh                      # all four precisions
#   bash benchmarks/convergence.sh bf16 nvfp4           # a subset (e.g. split
#   bash benchmarks/convergence.sh nvfp4_no_rht nvfp4_no_sr   # into two calls)
#
# Environment: OUT (results; default benchmarks/results/convergence), DATA
# (default .data/corpus.bin), STEPS (default 2000), PYTHON (default python),
# EXTRA (more flags for every run, e.g. "--attention cudnn").
#
# Budget (estimate): 350 MFLOP/token (llama_flops_per_token: 6 x 57.0M matmul
# parameters + causal attention) x 16,384 tokens = 5.7 TFLOP/step. At ~250
# TFLOP/s in bf16: ~23 ms/step, ~31 ms with the memory-bound XLA attention,
# ~60 s for 2000 steps. The nvfp4 runs put the MLPs of 7 of 8 blocks (55% of
# the FLOPs) in NVFP4; at 0.5-0.7x bf16 speed there (Hopper decodes FP4 to
# bf16; quantization passes) that is ~40-50 ms/step, ~80-100 s per run.
# Plus ~30-45 s per run of start-up and compilation: ~7.5-8.5 min for all four.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-benchmarks/results/convergence}
DATA=${DATA:-.data/corpus.bin}
STEPS=${STEPS:-2000}
PYTHON=${PYTHON:-python}
if [ "$#" -gt 0 ]; then PRECISIONS=("$@"); else
  PRECISIONS=(bf16 nvfp4 nvfp4_no_rht nvfp4_no_sr)
fi
if [ ! -f "$DATA" ]; then
  echo "missing $DATA: run 'python examples/text_data.py prepare --out $(dirname "$DATA")'" >&2
  exit 1
fi
mkdir -p "$OUT"

FLAGS=(
  --steps "$STEPS" --batch 64 --seq-len 256
  --d-model 768 --layers 8 --heads 12 --ffn 2048 --keep-last 1
  --lr 1e-3 --warmup 100 --weight-decay 0.1 --seed 0
  --data "$DATA" --out "$OUT"
  --log-every 10 --eval-every 50 --eval-batches 4 --no-plot
)

status=0
for precision in "${PRECISIONS[@]}"; do
  start=$(date +%s)
  # shellcheck disable=SC2086  # EXTRA is a list of flags
  if ! "$PYTHON" examples/llama_equinox.py --precision "$precision" \
      --label "$precision" "${FLAGS[@]}" ${EXTRA:-} 2>&1 | tee "$OUT/$precision.log"; then
    echo "$precision: FAILED (see $OUT/$precision.log)" >&2
    status=1
  fi
  echo "$precision: $(( $(date +%s) - start )) s wall" | tee -a "$OUT/$precision.log"
done

"$PYTHON" benchmarks/plot_convergence.py "$OUT" || status=1
exit "$status"
