// Native block-scaled FP4 GEMM on Blackwell (compute capability >= 10.0)
// through cuBLASLt: FFI target "jax_nvfp4_matmul_fp4_sm100".
//
// The operands come prepared by jax_nvfp4/backends/fp4_gemm.py
// (native_operands): codes padded with zeros to the tiles of fp4_gemm_plan.h,
// block scales in cuBLASLt's swizzled VEC16_UE4M3 layout
// (numerics/scale_layout.h), and the amaxes (one per batch item, or one for
// all). The alpha kernel (cublaslt.h) writes alpha = (amax_a / 2688) * (amax_b
// / 2688) of each item and beta = 0 to the head of the workspace; then, per
// batch item, one cublasLtMatmul with
//   A = b codes, CUDA_R_4F_E2M1, k x n, lda = k, CUBLAS_OP_T
//   B = a codes, CUDA_R_4F_E2M1, k x m, ldb = k, CUBLAS_OP_N
//   D = C = out^T, CUDA_R_16BF or CUDA_R_32F, n x m, ldd = n
//   compute CUBLAS_COMPUTE_32F, scale type CUDA_R_32F,
//   A/B_SCALE_MODE = CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3,
//   A/B_SCALE_POINTER = the item's swizzled b / a scales,
//   POINTER_MODE = CUBLASLT_POINTER_MODE_DEVICE: alpha and beta are read
//   from the workspace head.
// A batch loop rather than strided batching: it is unambiguous where each
// item's block scales live, and alpha may differ per item.
//
// The handler's body is the one the cuBLASLt handlers share (gemm_call.h).
// Every failure is returned as an ffi::Error that says what to do.
//
// Not run on Blackwell hardware yet (see jax_nvfp4/backends/fp4_gemm.py).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "bindings.h"
#include "gemm/cublaslt/fp4_gemm_plan.h"
#include "gemm/cublaslt/gemm_call.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

constexpr GemmHandler kMatmulFp4 = {
    {"matmul_fp4_sm100",
     " To use the bf16 GEMM instead, set JAX_NVFP4_NATIVE_GEMM=0 before the "
     "computation is compiled."},
    CUDA_R_4F_E2M1};

ffi::Error MatmulFp4Sm100(cudaStream_t stream, ffi::Buffer<ffi::U8> a_codes,
                          ffi::Buffer<ffi::U8> a_scales,
                          ffi::Buffer<ffi::F32> a_amax,
                          ffi::Buffer<ffi::U8> b_codes,
                          ffi::Buffer<ffi::U8> b_scales,
                          ffi::Buffer<ffi::F32> b_amax,
                          ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::Buffer<ffi::U8>> workspace) {
  GemmCallPlan plan;
  const std::string error = PlanFp4Gemm(
      Dims(a_codes), Dims(a_scales), Dims(a_amax), Dims(b_codes),
      Dims(b_scales), Dims(b_amax), Dims(*out), Dims(*workspace), &plan);
  return RunGemmCall(
      kMatmulFp4, stream, error, plan,
      GemmOperands(a_codes, a_scales, b_codes, b_scales, a_amax, b_amax), *out,
      *workspace);
}

}  // namespace
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

// Not kCmdBufferCompatible (unlike the bf16 GEMM, whose setup shares
// CaptureSafeSetup with this one): kept out of CUDA graphs until the handler
// has run on Blackwell hardware.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4MatmulFp4Sm100Cuda, jax_nvfp4::MatmulFp4Sm100,
    jax_nvfp4::MatmulFp4Binding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
