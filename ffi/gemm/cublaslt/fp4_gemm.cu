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
// The cuBLASLt setup is shared with the grouped FP4 GEMM (fp4_cublaslt.h)
// and, for loading, caches and errors, with the bf16 GEMM (cublaslt.h).
// Every failure is returned as an ffi::Error that says what to do.
//
// Not run on Blackwell hardware yet (see jax_nvfp4/backends/fp4_gemm.py).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bindings.h"
#include "checks.h"
#include "gemm/cublaslt/cublaslt.h"
#include "gemm/cublaslt/fp4_cublaslt.h"
#include "gemm/cublaslt/fp4_gemm_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

constexpr GemmErrors kErrors = {
    "matmul_fp4_sm100",
    " To use the bf16 GEMM instead, set JAX_NVFP4_NATIVE_GEMM=0 before "
    "the computation is compiled."};

std::string Problem(const Fp4GemmPlan& p, ffi::DataType out) {
  return Fp4Problem(p.batch, p.m, p.n, p.k, out);
}

ffi::Error MatmulFp4Sm100(cudaStream_t stream, ffi::Buffer<ffi::U8> a_codes,
                          ffi::Buffer<ffi::U8> a_scales,
                          ffi::Buffer<ffi::F32> a_amax,
                          ffi::Buffer<ffi::U8> b_codes,
                          ffi::Buffer<ffi::U8> b_scales,
                          ffi::Buffer<ffi::F32> b_amax,
                          ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::Buffer<ffi::U8>> workspace) {
  auto dims = [](auto span) {
    return std::vector<int64_t>(span.begin(), span.end());
  };
  Fp4GemmPlan p;
  if (std::string e = PlanFp4Gemm(
          dims(a_codes.dimensions()), dims(a_scales.dimensions()),
          dims(a_amax.dimensions()), dims(b_codes.dimensions()),
          dims(b_scales.dimensions()), dims(b_amax.dimensions()),
          dims(out->dimensions()), dims(workspace->dimensions()), &p);
      !e.empty()) {
    return kErrors.Fail(ffi::ErrorCode::kInvalidArgument, e);
  }
  const ffi::DataType out_type = out->element_type();
  if (out_type != ffi::DataType::BF16 && out_type != ffi::DataType::F32) {
    return kErrors.Fail(ffi::ErrorCode::kInvalidArgument,
                        "out must be bfloat16 or float32");
  }
  const int64_t out_bytes = out_type == ffi::DataType::BF16 ? 2 : 4;
  if (p.batch == 0 || p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.k == 0) {  // an empty sum
    if (cudaError_t err = cudaMemsetAsync(
            out->untyped_data(), 0, p.batch * p.m * p.n * out_bytes, stream);
        err != cudaSuccess) {
      return kErrors.Cuda("cudaMemsetAsync", err);
    }
    return ffi::Error::Success();
  }
  StreamDevice device;
  const CublasLt* lt = nullptr;
  if (ffi::Error e = RequireBlackwell(stream, kErrors, &device, &lt);
      e.failure()) {
    return e;
  }
  // Item strides are multiples of 512 bytes, so the base pointers decide
  // the alignment.
  auto* a_data = static_cast<uint8_t*>(a_codes.untyped_data());
  auto* b_data = static_cast<uint8_t*>(b_codes.untyped_data());
  auto* as_data = static_cast<uint8_t*>(a_scales.untyped_data());
  auto* bs_data = static_cast<uint8_t*>(b_scales.untyped_data());
  auto* out_data = static_cast<uint8_t*>(out->untyped_data());
  auto* ws_data = static_cast<uint8_t*>(workspace->untyped_data());
  if (!Aligned16({a_data, b_data, as_data, bs_data, out_data, ws_data})) {
    return kErrors.Fail(ffi::ErrorCode::kInvalidArgument,
                        "every operand must be 16-byte aligned and non-null");
  }
  CublasFailure ok;
  const cudaDataType_t d_type =
      out_type == ffi::DataType::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  MatmulDescriptors desc(lt);
  // The heuristic sees item 0's scale pointers; the loop below repoints them.
  if (!DescribeFp4(p.m, p.n, p.k, p.k, d_type, desc, ok) ||
      !SetFp4Scales(desc, bs_data, as_data, ok)) {
    return ok.Error(*lt, kErrors, Problem(p, out_type));
  }

  const CublasWorkspace cublas_workspace = AlignedCublasWorkspace(
      ws_data + p.workspace_head_bytes, p.workspace_bytes);
  const AlgoKey key{device.ordinal,
                    CUDA_R_4F_E2M1,
                    d_type,
                    p.m,
                    p.n,
                    p.k,
                    1,
                    cublas_workspace.bytes,
                    CommonAlignment({Address(b_data)}),
                    CommonAlignment({Address(a_data)}),
                    CommonAlignment({Address(out_data)})};
  cublasLtHandle_t handle;
  cublasLtMatmulAlgo_t algo;
  bool found = false;
  if (!HandleAndAlgo(desc, key, &handle, &algo, &found, ok)) {
    return ok.Error(*lt, kErrors, Problem(p, out_type));
  }
  if (!found) {
    return kErrors.FailAtRunTime(
        ffi::ErrorCode::kUnimplemented,
        "cuBLASLt " + std::to_string(lt->version) + " (" + lt->path +
            ") has no algorithm for this block-scaled FP4 GEMM (" +
            Problem(p, out_type) +
            "); a newer cuBLAS (pip install -U nvidia-cublas) may have one.");
  }

  // beta and the alphas at the head of the workspace; cuBLASLt's part follows.
  auto* head = reinterpret_cast<float*>(ws_data);
  if (cudaError_t err =
          LaunchGemmAlphas(stream, a_amax.typed_data(), p.a_amax_stride,
                           b_amax.typed_data(), p.b_amax_stride, p.batch, head);
      err != cudaSuccess) {
    return kErrors.Cuda("the alpha kernel's launch", err);
  }
  const float* beta = head;
  const float* alpha_data = head + 1;
  for (int64_t i = 0; i < p.batch; ++i) {
    void* d = out_data + i * p.out_stride * out_bytes;
    if (!SetFp4Scales(desc, bs_data + i * p.b_scales_stride,
                      as_data + i * p.a_scales_stride, ok) ||
        !ok("cublasLtMatmul",
            lt->Matmul(handle, desc.op, alpha_data + i,
                       b_data + i * p.b_codes_stride, desc.a,
                       a_data + i * p.a_codes_stride, desc.b, beta, d, desc.d,
                       d, desc.d, &algo, cublas_workspace.data,
                       cublas_workspace.bytes, stream))) {
      return ok.Error(*lt, kErrors, Problem(p, out_type));
    }
  }
  return ffi::Error::Success();
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
