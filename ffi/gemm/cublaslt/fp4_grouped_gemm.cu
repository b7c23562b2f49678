// ragged_dot's GEMMs on Blackwell (compute capability >= 10.0) through
// cuBLASLt: FFI target "jax_nvfp4_grouped_gemm_fp4_sm100".
//
// The operands come prepared by jax_nvfp4/backends/fp4_grouped_gemm.py: the
// token buffer's FP4 codes with every group at a multiple of 128 rows, block
// scales swizzled (rows form) or group-major (tokens form), the padded group
// sizes and one amax per group for each operand. The handler copies the
// sizes to the host (the one synchronisation: not CUDA-graph safe), plans
// the launches with fp4_grouped_gemm_plan.h, zeroes what no launch writes,
// writes beta = 0 and alpha_g = (amax_a[g] / 2688) * (amax_b[g] / 2688) to
// the workspace head (cublaslt.h's alpha kernel), and issues one
// block-scaled cublasLtMatmul per non-empty group on its slices, set up as
// the 2-D FP4 GEMM's (fp4_cublaslt.h) with the launch's leading dimension.
//
// Not run on Blackwell hardware yet (see
// jax_nvfp4/backends/fp4_grouped_gemm.py).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bindings.h"
#include "checks.h"
#include "gemm/cublaslt/cublaslt.h"
#include "gemm/cublaslt/fp4_cublaslt.h"
#include "gemm/cublaslt/fp4_grouped_gemm_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

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
    CublasFailure ok;
    MatmulDescriptors desc(lt);
    const uint8_t* a = a_data + l.a_codes;
    const uint8_t* b = b_data + l.b_codes;
    void* d = out_data + l.out * out_bytes;
    if (!DescribeFp4(l.m, l.n, l.k, l.ld, d_type, desc, ok) ||
        !SetFp4Scales(desc, bs_data + l.b_scales, as_data + l.a_scales, ok)) {
      return ok.Error(*lt, kGroupedErrors,
                      Fp4Problem(1, l.m, l.n, l.k, out_type));
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
      return ok.Error(*lt, kGroupedErrors,
                      Fp4Problem(1, l.m, l.n, l.k, out_type));
    }
    if (!found) {
      return kGroupedErrors.FailAtRunTime(
          ffi::ErrorCode::kUnimplemented,
          "cuBLASLt " + std::to_string(lt->version) + " (" + lt->path +
              ") has no algorithm for this block-scaled FP4 GEMM (group " +
              std::to_string(l.group) + ": " +
              Fp4Problem(1, l.m, l.n, l.k, out_type) +
              "); a newer cuBLAS (pip install -U nvidia-cublas) may have "
              "one.");
    }
    if (!ok("cublasLtMatmul", lt->Matmul(handle, desc.op, head + 1 + l.group, b,
                                         desc.a, a, desc.b, head, d, desc.d, d,
                                         desc.d, &algo, cublas_workspace.data,
                                         cublas_workspace.bytes, stream))) {
      return ok.Error(*lt, kGroupedErrors,
                      Fp4Problem(1, l.m, l.n, l.k, out_type));
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

// Not kCmdBufferCompatible: the launches depend on the group sizes, which
// the handler reads back to the host.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4GroupedGemmFp4Sm100Cuda, jax_nvfp4::GroupedGemmFp4Sm100,
    jax_nvfp4::GroupedGemmFp4Binding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
