#!/usr/bin/env bash
# Nsight Compute profiles, after gpu_session.sh has installed the package:
#   1. where the fused quantize kernel's idle issue slots go (stall reasons,
#      pipe utilization) at 16384 x 8192;
#   2. the kernels of one linear forward+backward step, bf16 and jax_nvfp4
#      (benchmarks/step_profile.py, a jax.profiler trace), per shape in
#      STEP_SHAPES (STEP_HOST=1: the host's lines too; STEP_REPEAT=R: R
#      steps per call after 20 untraced calls, as linear_bench times them);
#   3. with GEMM_TRACE=S, the same trace of the GEMM alone at S^3.
# SKIP_NCU=1 leaves step 1 out. Writes 3 files per call plus one per shape
# ($OUT brings back 8 at most).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
pipes=sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active
[ -n "${SKIP_NCU:-}" ] || timeout 200 ncu --clock-control none -k regex:QuantizePrivate \
  --section WarpStateStats --section SchedulerStats --section Occupancy \
  --section InstructionStats --section ComputeWorkloadAnalysis --section SpeedOfLight \
  --metrics "gpu__time_duration.sum,smsp__inst_executed.sum,$pipes,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio" \
  python3 benchmarks/quantize_profile.py --shape "${QUANT_SHAPE:-16384x8192}" > "$OUT/ncu_stalls.txt" 2>&1
[ -n "${SKIP_NCU:-}" ] || echo "ncu stalls rc=$?"; [ -n "${SKIP_NCU:-}" ] || grep -E "Duration|Issue Slots Busy|pipe_alu|pipe_fma |long_scoreboard|short_scoreboard|math_pipe|wait" "$OUT/ncu_stalls.txt" | head -30
for shape in ${STEP_SHAPES:-8192x4096x14336}; do
  timeout 200 python3 benchmarks/step_profile.py --linear "$shape" ${STEP_HOST:+--host} --repeat "${STEP_REPEAT:-1}" --out "$OUT/step_$shape.json" >> "$OUT/step_profile.txt" 2>&1
  echo "step $shape rc=$?"
done
if [ -n "${GEMM_TRACE:-}" ]; then
  timeout 120 python3 benchmarks/step_profile.py --gemm "$GEMM_TRACE" --out "$OUT/gemm_$GEMM_TRACE.json" >> "$OUT/step_profile.txt" 2>&1
  echo "gemm trace $GEMM_TRACE rc=$?"
fi
cat "$OUT/step_profile.txt" | grep -v "^    .* x1 .*fusion" | head -150
