#!/usr/bin/env bash
# One device call for the GEMM / linear recipe: build, GPU tests, benchmark.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
JAX_NVFP4_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 120 python3 -m pip install \
  --no-build-isolation --no-deps -q . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
timeout 90 python3 benchmarks/linear_bench.py --out "$OUT/linear_bench.json" 2>&1 | tee "$OUT/linear_bench.txt" | tail -12
timeout 70 pytest -q -x tests/test_gemm.py tests/test_recipe.py -k "not mlp" 2>&1 | tee "$OUT/pytest_gemm.txt" | tail -6
