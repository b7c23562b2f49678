// The bf16 GEMM with alpha in the epilogue, for GPUs without FP4 tensor cores
// (compute capability 8.0 to 9.x, e.g. Hopper), through cuBLASLt: FFI
// target "jax_nvfp4_matmul_bf16".
//
// jax_nvfp4/backends/bf16_gemm.py decodes both operands to bfloat16 in XLA
// (e2m1 times the E4M3 block scale has at most 6 significant bits: exact in
// bfloat16) and hands them here with the amaxes. The alpha kernel (cublaslt.h)
// writes alpha = (amax_a / 2688) * (amax_b / 2688) and beta = 0 to the head of
// the workspace; then cublasLtMatmul computes, per the plan of
// bf16_gemm_plan.h,
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
#include <vector>

#include "bindings.h"
#include "checks.h"
#include "gemm/cublaslt/bf16_gemm_plan.h"
#include "gemm/cublaslt/cublaslt.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

constexpr GemmErrors kErrors = {
    "matmul_bf16",
    " To use XLA's GEMM instead, set JAX_NVFP4_CUBLASLT_GEMM=0 before the "
    "computation is compiled."};

std::string Problem(const Bf16GemmPlan& p, ffi::DataType out) {
  return "batch=" + std::to_string(p.batch) + " M=" + std::to_string(p.m) +
         " N=" + std::to_string(p.n) + " K=" + std::to_string(p.k) +
         " out=" + (out == ffi::DataType::BF16 ? "bf16" : "f32") + ", " +
         std::to_string(p.calls) + " call(s) of " +
         std::to_string(p.call_batch) + " x " + std::to_string(p.call_m) + "x" +
         std::to_string(p.n) + "x" + std::to_string(p.k);
}

// The operation of bf16_gemm_plan.h: D (n x call_m, call_batch of them) =
// alpha * b^T a, alpha and beta read from device memory.
bool Describe(const Bf16GemmPlan& p, cudaDataType_t d_type,
              MatmulDescriptors& desc, CublasFailure& ok) {
  return desc.CreateTnOperation(ok) &&
         desc.CreateLayout(&desc.a, "cublasLtMatrixLayoutCreate(A)",
                           CUDA_R_16BF, p.k, p.n, p.k, p.call_batch, p.b_stride,
                           ok) &&
         desc.CreateLayout(&desc.b, "cublasLtMatrixLayoutCreate(B)",
                           CUDA_R_16BF, p.k, p.call_m, p.k, p.call_batch,
                           p.a_stride, ok) &&
         desc.CreateLayout(&desc.d, "cublasLtMatrixLayoutCreate(D)", d_type,
                           p.n, p.call_m, p.n, p.call_batch, p.out_stride, ok);
}

ffi::Error MatmulBf16(cudaStream_t stream, ffi::Buffer<ffi::BF16> a,
                      ffi::Buffer<ffi::BF16> b, ffi::Buffer<ffi::F32> a_amax,
                      ffi::Buffer<ffi::F32> b_amax,
                      ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::Buffer<ffi::U8>> workspace) {
  auto dims = [](auto span) {
    return std::vector<int64_t>(span.begin(), span.end());
  };
  Bf16GemmPlan p;
  if (std::string e = PlanBf16Gemm(
          dims(a.dimensions()), dims(b.dimensions()), dims(a_amax.dimensions()),
          dims(b_amax.dimensions()), dims(out->dimensions()),
          dims(workspace->dimensions()), &p);
      !e.empty()) {
    return kErrors.Fail(ffi::ErrorCode::kInvalidArgument, e);
  }
  const ffi::DataType out_type = out->element_type();
  if (out_type != ffi::DataType::BF16 && out_type != ffi::DataType::F32) {
    return kErrors.Fail(ffi::ErrorCode::kInvalidArgument,
                        "out must be bfloat16 or float32");
  }
  const int64_t out_bytes = out_type == ffi::DataType::BF16 ? 2 : 4;
  constexpr int64_t kBf16Bytes = 2;
  if (p.batch == 0 || p.m == 0 || p.n == 0) return ffi::Error::Success();
  auto* out_data = static_cast<uint8_t*>(out->untyped_data());
  if (out_data == nullptr) {
    return kErrors.Fail(ffi::ErrorCode::kInvalidArgument, "out is null");
  }
  if (p.k == 0) {  // an empty sum
    if (cudaError_t err = cudaMemsetAsync(
            out_data, 0, p.batch * p.m * p.n * out_bytes, stream);
        err != cudaSuccess) {
      return kErrors.Cuda("cudaMemsetAsync", err);
    }
    return ffi::Error::Success();
  }
  const auto* a_data = static_cast<const uint8_t*>(a.untyped_data());
  const auto* b_data = static_cast<const uint8_t*>(b.untyped_data());
  const float* a_amax_data = a_amax.typed_data();
  const float* b_amax_data = b_amax.typed_data();
  auto* ws_data = static_cast<uint8_t*>(workspace->untyped_data());
  if (a_data == nullptr || b_data == nullptr || a_amax_data == nullptr ||
      b_amax_data == nullptr || ws_data == nullptr) {
    return kErrors.Fail(ffi::ErrorCode::kInvalidArgument,
                        "an operand or the workspace is null");
  }
  // Element alignment, which XLA always gives: the alpha kernel reads the
  // amaxes and writes the head as floats, cuBLASLt reads and writes whole
  // elements.
  if (CommonAlignment({Address(a_amax_data), Address(b_amax_data),
                       Address(ws_data)}) < sizeof(float) ||
      CommonAlignment({Address(out_data)}) < out_bytes ||
      CommonAlignment({Address(a_data), Address(b_data)}) < kBf16Bytes) {
    return kErrors.Fail(ffi::ErrorCode::kInvalidArgument,
                        "every operand and result must be aligned to its "
                        "element size");
  }

  StreamDevice device;
  if (ffi::Error e = GetStreamDevice(stream, kErrors, &device); e.failure()) {
    return e;
  }
  if (device.major < 8) {
    return kErrors.FailAtRunTime(
        ffi::ErrorCode::kFailedPrecondition,
        "bfloat16 tensor-core GEMMs need compute capability 8.0 or newer; "
        "device " +
            std::to_string(device.ordinal) + " is " +
            std::to_string(device.major) + "." + std::to_string(device.minor) +
            ".");
  }
  const CublasLt* lt = nullptr;
  if (ffi::Error e = LoadCublasLt(kErrors, &lt); e.failure()) return e;

  CublasFailure ok;
  const cudaDataType_t d_type =
      out_type == ffi::DataType::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  MatmulDescriptors desc(lt);
  if (!Describe(p, d_type, desc, ok)) {
    return ok.Error(*lt, kErrors, Problem(p, out_type));
  }

  // The alignment cuBLASLt may assume for each matrix: of its base pointer,
  // its leading dimension in bytes and, when items are reached by offsets
  // (strided batch or one call per item), its item stride in bytes.
  const bool offset_items = p.calls > 1 || p.call_batch > 1;
  auto item_bytes = [&](int64_t stride, int64_t bytes) {
    return static_cast<uint64_t>(offset_items ? stride * bytes : 0);
  };
  const uint64_t ld_ab = static_cast<uint64_t>(p.k * kBf16Bytes);
  const CublasWorkspace cublas_workspace = AlignedCublasWorkspace(
      ws_data + p.workspace_head_bytes, p.workspace_bytes);
  const AlgoKey key{device.ordinal,
                    CUDA_R_16BF,
                    d_type,
                    p.call_m,
                    p.n,
                    p.k,
                    p.call_batch,
                    cublas_workspace.bytes,
                    CommonAlignment({Address(b_data), ld_ab,
                                     item_bytes(p.b_stride, kBf16Bytes)}),
                    CommonAlignment({Address(a_data), ld_ab,
                                     item_bytes(p.a_stride, kBf16Bytes)}),
                    CommonAlignment({Address(out_data),
                                     static_cast<uint64_t>(p.n * out_bytes),
                                     item_bytes(p.out_stride, out_bytes)})};
  cublasLtHandle_t handle;
  cublasLtMatmulAlgo_t algo;
  bool found = false, did_setup = false;
  if (!HandleAndAlgo(desc, key, &handle, &algo, &found, ok, &did_setup)) {
    return ok.Error(*lt, kErrors, Problem(p, out_type));
  }
  CountGemmCall(device.capturing, did_setup);
  if (!found) {
    return kErrors.FailAtRunTime(
        ffi::ErrorCode::kUnimplemented,
        "cuBLASLt " + std::to_string(lt->version) + " (" + lt->path +
            ") has no algorithm for this bf16 GEMM (" + Problem(p, out_type) +
            ", alignments A=" + std::to_string(key.align_a) +
            " B=" + std::to_string(key.align_b) +
            " D=" + std::to_string(key.align_d) + " bytes).");
  }

  // beta and the alphas at the head of the workspace; cuBLASLt's part follows.
  auto* head = reinterpret_cast<float*>(ws_data);
  if (cudaError_t err =
          LaunchGemmAlphas(stream, a_amax_data, p.a_amax_stride, b_amax_data,
                           p.b_amax_stride, p.alphas, head);
      err != cudaSuccess) {
    return kErrors.Cuda("the alpha kernel's launch", err);
  }
  const float* beta = head;
  // Call c covers item c when there is one call per item, else every item.
  for (int64_t c = 0; c < p.calls; ++c) {
    const float* alpha = head + 1 + (p.alphas == 1 ? 0 : c);
    void* d = out_data + c * p.out_stride * out_bytes;
    if (!ok("cublasLtMatmul",
            lt->Matmul(handle, desc.op, alpha,
                       b_data + c * p.b_stride * kBf16Bytes, desc.a,
                       a_data + c * p.a_stride * kBf16Bytes, desc.b, beta, d,
                       desc.d, d, desc.d, &algo, cublas_workspace.data,
                       cublas_workspace.bytes, stream))) {
      return ok.Error(*lt, kErrors, Problem(p, out_type));
    }
  }
  return ffi::Error::Success();
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
