// Device helpers of the tensor-core GEMM kernels written here
// (bf16_grouped_gemm.cu, w4a16_gemm.cu): asynchronous copies to shared memory,
// ldmatrix, the bf16 mma.sync with float32 accumulation (sm_80 and later), and
// the epilogue's paired stores.
#ifndef JAX_NVFP4_FFI_GEMM_MMA_MMA_CUH_
#define JAX_NVFP4_FFI_GEMM_MMA_MMA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_nvfp4 {

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes from global memory, or zeros where !valid (src-size 0).
__device__ __forceinline__ void CopyChunk(uint32_t dst, const void* src,
                                          bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(src), "r"(bytes));
}

__device__ __forceinline__ void CommitCopies() {
  asm volatile("cp.async.commit_group;\n" ::);
}

template <int kPending>
__device__ __forceinline__ void WaitCopies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void LoadMatrices(uint32_t address, uint32_t* r) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(address));
}

// Not volatile: the instruction has no side effects, so the compiler may
// schedule it freely among the loads and decodes around it.
__device__ __forceinline__ void Mma(float* c, const uint32_t* a,
                                    const uint32_t* b) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <typename Out>
__device__ __forceinline__ void StorePair(Out* p, float x, float y);

template <>
__device__ __forceinline__ void StorePair(float* p, float x, float y) {
  *reinterpret_cast<float2*>(p) = make_float2(x, y);
}

template <>
__device__ __forceinline__ void StorePair(__nv_bfloat16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}

template <>
__device__ __forceinline__ void StorePair(__half* p, float x, float y) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_MMA_MMA_CUH_
