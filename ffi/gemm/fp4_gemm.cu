// Native block-scaled FP4 GEMM on Blackwell (compute capability >= 10.0)
// through cuBLASLt: FFI target "jax_nvfp4_matmul_fp4_sm100".
//
// The operands come prepared by jax_nvfp4/backends/blackwell.py
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
// Loading cuBLASLt, the handle and algorithm caches and the errors are shared
// with the bf16 GEMM (cublaslt.h). Every failure is returned as an ffi::Error
// that says what to do.
//
// Not run on Blackwell hardware yet (see jax_nvfp4/backends/blackwell.py).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "bindings.h"
#include "checks.h"
#include "gemm/cublaslt.h"
#include "gemm/fp4_gemm_plan.h"
#include "gemm/fp4_grouped_gemm_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

constexpr size_t kMinCublasLtVersion = 120800;  // VEC16_UE4M3 appeared in 12.8
constexpr GemmErrors kErrors = {
    "matmul_fp4_sm100",
    " To use the bf16 GEMM instead, set JAX_NVFP4_NATIVE_GEMM=0 before "
    "the computation is compiled."};

std::string Problem(const Fp4GemmPlan& p, ffi::DataType out) {
  return "batch=" + std::to_string(p.batch) + " M=" + std::to_string(p.m) +
         " N=" + std::to_string(p.n) + " K=" + std::to_string(p.k) +
         " out=" + (out == ffi::DataType::BF16 ? "bf16" : "f32");
}

// Points cuBLASLt's A scales at b's and its B scales at a's.
bool SetScales(MatmulDescriptors& desc, const void* b_scales,
               const void* a_scales, CublasFailure& ok) {
  return ok("cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)",
            desc.Set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b_scales)) &&
         ok("cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)",
            desc.Set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a_scales));
}

// The operation of fp4_gemm_plan.h: D (n x m) = alpha * b^T a with
// VEC16_UE4M3 block scales, alpha and beta read from device memory; a and b
// hold k elements of each row, `ld` apart.
bool Describe(int64_t m, int64_t n, int64_t k, int64_t ld,
              cudaDataType_t d_type, MatmulDescriptors& desc,
              CublasFailure& ok) {
  const cublasLtMatmulMatrixScale_t scale_mode =
      CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
  return desc.CreateTnOperation(ok) &&
         ok("cublasLtMatmulDescSetAttribute(A_SCALE_MODE)",
            desc.Set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, scale_mode)) &&
         ok("cublasLtMatmulDescSetAttribute(B_SCALE_MODE)",
            desc.Set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, scale_mode)) &&
         desc.CreateLayout(&desc.a, "cublasLtMatrixLayoutCreate(A)",
                           CUDA_R_4F_E2M1, k, n, ld, 1, 0, ok) &&
         desc.CreateLayout(&desc.b, "cublasLtMatrixLayoutCreate(B)",
                           CUDA_R_4F_E2M1, k, m, ld, 1, 0, ok) &&
         desc.CreateLayout(&desc.d, "cublasLtMatrixLayoutCreate(D)", d_type, n,
                           m, n, 1, 0, ok);
}

// The device of `stream` if it has FP4 tensor cores, and cuBLASLt if it
// knows block-scaled FP4; else the error that says why not.
ffi::Error RequireBlackwell(cudaStream_t stream, const GemmErrors& errors,
                            StreamDevice* device, const CublasLt** lt) {
  if (ffi::Error e = GetStreamDevice(stream, errors, device); e.failure()) {
    return e;
  }
  if (device->major < 10) {
    return errors.Fail(
        ffi::ErrorCode::kFailedPrecondition,
        "native FP4 GEMMs need compute capability 10.0 or newer "
        "(Blackwell); device " +
            std::to_string(device->ordinal) + " is " +
            std::to_string(device->major) + "." +
            std::to_string(device->minor) +
            ". Use jax_nvfp4.matmul / jax_nvfp4.ragged_dot, which lower to "
            "this target only where "
            "jax_nvfp4.blackwell.native_fp4_supported() holds.");
  }
  if (ffi::Error e = LoadCublasLt(errors, lt); e.failure()) return e;
  if ((*lt)->version < kMinCublasLtVersion) {
    return errors.FailAtRunTime(
        ffi::ErrorCode::kFailedPrecondition,
        "cuBLASLt " + std::to_string((*lt)->version) + " (" + (*lt)->path +
            ") predates block-scaled FP4 (needs 12.8 or newer, e.g. pip "
            "install nvidia-cublas).");
  }
  return ffi::Error::Success();
}

// Every operand must be 16-byte aligned (block scales and the tensor-core
// kernels' A and B).
bool Aligned16(std::initializer_list<const void*> pointers) {
  for (const void* ptr : pointers) {
    if (ptr == nullptr || CommonAlignment({Address(ptr)}) < 16) return false;
  }
  return true;
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
  if (!Describe(p.m, p.n, p.k, p.k, d_type, desc, ok) ||
      !SetScales(desc, bs_data, as_data, ok)) {
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
    if (!SetScales(desc, bs_data + i * p.b_scales_stride,
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

constexpr GemmErrors kGroupedErrors = {
    "grouped_gemm_fp4_sm100",
    " To use the grouped bf16 GEMM instead, set JAX_NVFP4_NATIVE_GEMM=0 "
    "before the computation is compiled."};

// ragged_dot's GEMMs on Blackwell (fp4_grouped_gemm_plan.h): the group sizes
// copied to the host, then one cublasLtMatmul per non-empty group on its
// slice of the operands, alpha_g from the workspace head.
ffi::Error GroupedGemmFp4Sm100(
    cudaStream_t stream, ffi::Buffer<ffi::U8> a_codes,
    ffi::Buffer<ffi::U8> a_scales, ffi::Buffer<ffi::U8> b_codes,
    ffi::Buffer<ffi::U8> b_scales, ffi::Buffer<ffi::S32> sizes,
    ffi::Buffer<ffi::F32> a_amax, ffi::Buffer<ffi::F32> b_amax,
    ffi::Result<ffi::AnyBuffer> out,
    ffi::Result<ffi::Buffer<ffi::U8>> workspace, bool tokens) {
  auto dims = [](auto span) {
    return std::vector<int64_t>(span.begin(), span.end());
  };
  Fp4GroupedPlan p;
  if (std::string e = PlanGroupedFp4Shapes(
          tokens, dims(a_codes.dimensions()), dims(a_scales.dimensions()),
          dims(b_codes.dimensions()), dims(b_scales.dimensions()),
          dims(sizes.dimensions()), dims(a_amax.dimensions()),
          dims(b_amax.dimensions()), dims(out->dimensions()),
          dims(workspace->dimensions()), &p);
      !e.empty()) {
    return kGroupedErrors.Fail(ffi::ErrorCode::kInvalidArgument, e);
  }
  const ffi::DataType out_type = out->element_type();
  if (out_type != ffi::DataType::BF16 && out_type != ffi::DataType::F32) {
    return kGroupedErrors.Fail(ffi::ErrorCode::kInvalidArgument,
                               "out must be bfloat16 or float32");
  }
  const int64_t out_bytes = out_type == ffi::DataType::BF16 ? 2 : 4;
  if (p.out_elements == 0) return ffi::Error::Success();
  StreamDevice device;
  const CublasLt* lt = nullptr;
  if (ffi::Error e = RequireBlackwell(stream, kGroupedErrors, &device, &lt);
      e.failure()) {
    return e;
  }
  auto* a_data = static_cast<uint8_t*>(a_codes.untyped_data());
  auto* b_data = static_cast<uint8_t*>(b_codes.untyped_data());
  auto* as_data = static_cast<uint8_t*>(a_scales.untyped_data());
  auto* bs_data = static_cast<uint8_t*>(b_scales.untyped_data());
  auto* out_data = static_cast<uint8_t*>(out->untyped_data());
  auto* ws_data = static_cast<uint8_t*>(workspace->untyped_data());
  if (!Aligned16({a_data, b_data, as_data, bs_data, out_data, ws_data})) {
    return kGroupedErrors.Fail(
        ffi::ErrorCode::kInvalidArgument,
        "every operand must be 16-byte aligned and non-null");
  }

  // The launches depend on the sizes: read them (the one host sync).
  std::vector<int32_t> host_sizes(p.groups);
  if (p.groups > 0) {
    if (cudaError_t err = cudaMemcpyAsync(host_sizes.data(), sizes.typed_data(),
                                          p.groups * sizeof(int32_t),
                                          cudaMemcpyDeviceToHost, stream);
        err != cudaSuccess) {
      return kGroupedErrors.Cuda("cudaMemcpyAsync of the group sizes", err);
    }
    if (cudaError_t err = cudaStreamSynchronize(stream); err != cudaSuccess) {
      return kGroupedErrors.Cuda("cudaStreamSynchronize", err);
    }
  }
  if (std::string e = PlanGroupedFp4Launches(
          std::vector<int64_t>(host_sizes.begin(), host_sizes.end()), &p);
      !e.empty()) {
    return kGroupedErrors.Fail(ffi::ErrorCode::kInvalidArgument, e);
  }
  for (const ElementRange& z : p.zeros) {
    if (cudaError_t err =
            cudaMemsetAsync(out_data + z.begin * out_bytes, 0,
                            (z.end - z.begin) * out_bytes, stream);
        err != cudaSuccess) {
      return kGroupedErrors.Cuda("cudaMemsetAsync", err);
    }
  }
  if (p.launches.empty()) return ffi::Error::Success();

  auto* head = reinterpret_cast<float*>(ws_data);
  if (cudaError_t err =
          LaunchGemmAlphas(stream, a_amax.typed_data(), 1, b_amax.typed_data(),
                           1, p.groups, head);
      err != cudaSuccess) {
    return kGroupedErrors.Cuda("the alpha kernel's launch", err);
  }
  const CublasWorkspace cublas_workspace = AlignedCublasWorkspace(
      ws_data + p.workspace_head_bytes, p.workspace_bytes);
  const cudaDataType_t d_type =
      out_type == ffi::DataType::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  for (const Fp4GroupLaunch& l : p.launches) {
    const Fp4GemmPlan problem{1, l.m, l.n, l.k};
    CublasFailure ok;
    MatmulDescriptors desc(lt);
    const uint8_t* a = a_data + l.a_codes;
    const uint8_t* b = b_data + l.b_codes;
    void* d = out_data + l.out * out_bytes;
    if (!Describe(l.m, l.n, l.k, l.ld, d_type, desc, ok) ||
        !SetScales(desc, bs_data + l.b_scales, as_data + l.a_scales, ok)) {
      return ok.Error(*lt, kGroupedErrors, Problem(problem, out_type));
    }
    const AlgoKey key{device.ordinal,
                      CUDA_R_4F_E2M1,
                      d_type,
                      l.m,
                      l.n,
                      l.k,
                      1,
                      cublas_workspace.bytes,
                      CommonAlignment({Address(b)}),
                      CommonAlignment({Address(a)}),
                      CommonAlignment({Address(d)}),
                      l.ld};
    cublasLtHandle_t handle;
    cublasLtMatmulAlgo_t algo;
    bool found = false;
    if (!HandleAndAlgo(desc, key, &handle, &algo, &found, ok)) {
      return ok.Error(*lt, kGroupedErrors, Problem(problem, out_type));
    }
    if (!found) {
      return kGroupedErrors.FailAtRunTime(
          ffi::ErrorCode::kUnimplemented,
          "cuBLASLt " + std::to_string(lt->version) + " (" + lt->path +
              ") has no algorithm for this block-scaled FP4 GEMM (group " +
              std::to_string(l.group) + ": " + Problem(problem, out_type) +
              "); a newer cuBLAS (pip install -U nvidia-cublas) may have "
              "one.");
    }
    if (!ok("cublasLtMatmul", lt->Matmul(handle, desc.op, head + 1 + l.group, b,
                                         desc.a, a, desc.b, head, d, desc.d, d,
                                         desc.d, &algo, cublas_workspace.data,
                                         cublas_workspace.bytes, stream))) {
      return ok.Error(*lt, kGroupedErrors, Problem(problem, out_type));
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

// Not kCmdBufferCompatible: the launches depend on the group sizes, which
// the handler reads back to the host.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4GroupedGemmFp4Sm100Cuda, jax_nvfp4::GroupedGemmFp4Sm100,
    jax_nvfp4::GroupedGemmFp4Binding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
