#!/usr/bin/env bash
# Compares build variants of the CUDA handlers in one device call: for each
# "name=flag" argument (flag: one extra nvcc flag, e.g. -DSOME_SWITCH that
# the sources test; empty for the default build) it installs the package,
# then records
#   - Nsight Compute duration, warp instructions, issue-slot use and active
#     warps of the fused quantize kernel at both benchmark shapes
#     (quantize_profile.py: X's and dY's options, amaxes given);
#   - the quantize benchmark table (bench_<name>.txt).
# The last variant stays installed and gets the fused-quantize GPU tests.
#   bash benchmarks/variant_session.sh default= other=-DSOME_SWITCH
# (The switches measured on 2026-11-29 -- JAX_NVFP4_PRIV_TABLE,
# JAX_NVFP4_PRIV_ONE_WARP -- were removed with their variants: NOTES.md.)
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
cuda_include=/usr/local/cuda/targets/x86_64-linux/include
[ -f "$cuda_include/cublasLt.h" ] && export JAX_NVFP4_CUBLAS_INCLUDE_DIR="$cuda_include"
metrics=gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.per_cycle_active
for variant in "$@"; do
  name="${variant%%=*}"; flags="${variant#*=}"
  t0=$(date +%s)
  CMAKE_ARGS="-DCMAKE_CUDA_FLAGS=$flags" JAX_NVFP4_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 \
    timeout 300 python3 -m pip install --no-build-isolation --no-deps -q --force-reinstall . \
    > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  echo "== $name ($flags): build $(( $(date +%s) - t0 )) s"
  for shape in 16384x8192 8192x4096; do
    timeout 120 ncu --clock-control none -k regex:QuantizePrivate --metrics "$metrics" \
      python3 benchmarks/quantize_profile.py --shape "$shape" 2>&1 |
      grep -E "QuantizePrivateTileKernel<|gpu__time|inst_executed|issue_active|warps_active" |
      sed "s/^/$name $shape /"
  done
  timeout 200 python3 benchmarks/quantize_bench.py --out "$OUT/bench_$name.json" > "$OUT/bench_$name.txt" 2>&1
  grep -E "copy|kernel" "$OUT/bench_$name.txt" | sed "s/^/$name /"
done
rm -f "$OUT/build.log"
timeout 200 python3 -P -m pytest -q -rfE -p no:cacheprovider tests/test_quantize.py -k "fused" 2>&1 | tail -5
