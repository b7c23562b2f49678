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
// block-scaled cublasLtMatmul per non-empty group on its slices, with the
// launch's leading dimension: the body the cuBLASLt handlers share
// (gemm_call.h).
//
// Not run on Blackwell hardware yet (see
// jax_nvfp4/backends/fp4_grouped_gemm.py).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bindings.h"
#include "gemm/cublaslt/fp4_grouped_gemm_plan.h"
#include "gemm/cublaslt/gemm_call.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

constexpr GemmHandler kGroupedGemmFp4 = {
    {"grouped_gemm_fp4_sm100",
     " To use the grouped bf16 GEMM instead, set JAX_NVFP4_NATIVE_GEMM=0 "
     "before the computation is compiled."},
    CUDA_R_4F_E2M1};

// Copies the group sizes to the host: the one synchronisation.
ffi::Error ReadSizes(cudaStream_t stream, const ffi::Buffer<ffi::S32>& sizes,
                     int64_t groups, std::vector<int64_t>* host) {
  std::vector<int32_t> read(groups);
  if (groups > 0) {
    const GemmErrors& errors = kGroupedGemmFp4.errors;
    if (cudaError_t err = cudaMemcpyAsync(read.data(), sizes.typed_data(),
                                          groups * sizeof(int32_t),
                                          cudaMemcpyDeviceToHost, stream);
        err != cudaSuccess) {
      return errors.Cuda("cudaMemcpyAsync of the group sizes", err);
    }
    if (cudaError_t err = cudaStreamSynchronize(stream); err != cudaSuccess) {
      return errors.Cuda("cudaStreamSynchronize", err);
    }
  }
  host->assign(read.begin(), read.end());
  return ffi::Error::Success();
}

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
  Fp4GroupedPlan plan;
  std::string error =
      PlanGroupedFp4Shapes(tokens, Dims(a_codes), Dims(a_scales), Dims(b_codes),
                           Dims(b_scales), Dims(sizes), Dims(a_amax),
                           Dims(b_amax), Dims(*out), Dims(*workspace), &plan);
  // The launches depend on the group sizes, which live on the device.
  if (error.empty() && out->element_count() > 0) {
    std::vector<int64_t> host_sizes;
    if (ffi::Error e = ReadSizes(stream, sizes, plan.batch, &host_sizes);
        e.failure()) {
      return e;
    }
    error = PlanGroupedFp4Launches(host_sizes, &plan);
  }
  return RunGemmCall(
      kGroupedGemmFp4, stream, error, plan,
      GemmOperands(a_codes, a_scales, b_codes, b_scales, a_amax, b_amax), *out,
      *workspace);
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
