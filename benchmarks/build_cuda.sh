#!/usr/bin/env bash
# Installs jax_nvfp4 with its CUDA handlers on the GPU machine (offline: no
# build isolation, no dependencies), the build log in $1; prints the build time.
cuda_include=/usr/local/cuda/targets/x86_64-linux/include
[ -f "$cuda_include/cublasLt.h" ] && export JAX_NVFP4_CUBLAS_INCLUDE_DIR="${JAX_NVFP4_CUBLAS_INCLUDE_DIR:-$cuda_include}"
t0=$(date +%s)
JAX_NVFP4_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 300 python3 -m pip install \
  --no-build-isolation --no-deps -q . > "$1" 2>&1 || { tail -50 "$1"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
