// The bf16 GEMM with alpha in the epilogue, for GPUs without FP4 tensor cores
// (compute capability 8.0 to 9.x, e.g. Hopper), through cuBLASLt: FFI
// target "jax_nvfp4_matmul_bf16".
//
// jax_nvfp4/backends/bf16_gemm.py decodes both operands to bfloat16 in XLA
// (e2m1 times the E4M3 block scale has at most 6 significant bits: exact in
// bfloat16) and hands them here with the amaxes. Through the body the
// cuBLASLt handlers share (gemm_call.h), the alpha kernel (cublaslt.h) writes
// alpha = (amax_a / 2688) * (amax_b / 2688) and beta = 0 to the head of the
// workspace; then cublasLtMatmul computes, per the plan of bf16_gemm_plan.h,
//   A = b, CUDA_R_16BF, k x n, lda = k, CUBLAS_OP_T
//   B = a, CUDA_R_16BF, k x m, ldb = k, CUBLAS_OP_N
//   D = C = out^T, CUDA_R_16BF or CUDA_R_32F, n x m, ldd = n
//   compute CUBLAS_COMPUTE_32F, scale type CUDA_R_32F,
//   POINTER_MODE = CUBLASLT_POINTER_MODE_DEVICE (alpha, beta = 0 from the
//   workspace head; cuBLAS does not read C when beta is 0).
// The float32 accumulator is multiplied by alpha and rounded once, to the
// output type, in the epilogue: no float32 [M, N] intermediate and no separate
// scaling pass, unlike XLA's dot with a float32 result followed by a multiply.
//
// Any M, N, K are accepted; the heuristic is told the real alignment of every
// pointer, leading dimension and item stride, so odd shapes get kernels that
// can handle them. Every failure is returned as an ffi::Error; setting
// JAX_NVFP4_CUBLASLT_GEMM=0 before compiling bypasses the handler.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "bindings.h"
#include "gemm/cublaslt/bf16_gemm_plan.h"
#include "gemm/cublaslt/gemm_call.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

constexpr GemmHandler kMatmulBf16 = {
    {"matmul_bf16",
     " To use XLA's GEMM instead, set JAX_NVFP4_CUBLASLT_GEMM=0 before the "
     "computation is compiled."},
    CUDA_R_16BF};

ffi::Error MatmulBf16(cudaStream_t stream, ffi::Buffer<ffi::BF16> a,
                      ffi::Buffer<ffi::BF16> b, ffi::Buffer<ffi::F32> a_amax,
                      ffi::Buffer<ffi::F32> b_amax,
                      ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::Buffer<ffi::U8>> workspace) {
  GemmCallPlan plan;
  const std::string error =
      PlanBf16Gemm(Dims(a), Dims(b), Dims(a_amax), Dims(b_amax), Dims(*out),
                   Dims(*workspace), &plan);
  return RunGemmCall(kMatmulBf16, stream, error, plan,
                     GemmOperands(a, b, a_amax, b_amax), *out, *workspace);
}

}  // namespace
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

// Two registrations of the one handler. The default, "..._graph", is
// kCmdBufferCompatible: XLA may record it into its command buffers (CUDA
// graphs), so that a training step's kernels are replayed as graphs instead
// of launched one by one from the host. What it enqueues is capturable (the
// alpha kernel; cublasLtMatmul on the workspace XLA allocates) and its
// one-time setup runs under CaptureSafeSetup (gemm/cublaslt/cublaslt.h). The
// plain registration keeps XLA's command buffers around the GEMM
// (JAX_NVFP4_GEMM_GRAPHS=0, jax_nvfp4/backends/bf16_gemm.py).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4MatmulBf16Cuda, jax_nvfp4::MatmulBf16,
    jax_nvfp4::MatmulBf16Binding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4MatmulBf16GraphCuda, jax_nvfp4::MatmulBf16,
    jax_nvfp4::MatmulBf16Binding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
