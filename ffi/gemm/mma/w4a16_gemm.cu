// The weight-only NVFP4 GEMM for serving (W4A16) on GPUs without FP4 tensor
// cores (compute capability >= 8.0): FFI target "jax_nvfp4_matmul_w4a16".
//
//   out[m, n] = (amax / 2688) * sum_k x[m, k] * e2m1(w[n, k]) * s[n, k / 16]
//
// x bfloat16 [M, K]; w's codes uint8 [N, K / 2] (element 2i in the low
// nibble of byte i) and E4M3 scales [N, K / 16], the layout of a weight
// quantized along K; amax float32 [1]; a workspace of the size
// w4a16_gemm_plan.h gives. The weight is decoded in registers (no
// bfloat16 copy of it is written to memory): w4a16_kernel.cuh.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "bindings.h"
#include "checks.h"
#include "cuda/launch.cuh"
#include "gemm/mma/w4a16_gemm_plan.h"
#include "gemm/mma/w4a16_kernel.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

ffi::Error Failed(const char* what, cudaError_t err) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_nvfp4: matmul_w4a16: ") + what +
                        " failed: " + cudaGetErrorString(err));
}

ffi::Error MatmulW4A16Cuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> x,
                           ffi::Buffer<ffi::U8> codes, ffi::AnyBuffer scales,
                           ffi::Buffer<ffi::F32> amax,
                           ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::Buffer<ffi::U8>> workspace) {
  const auto xd = x.dimensions(), cd = codes.dimensions();
  const auto od = out->dimensions();
  if (xd.size() != 2 || cd.size() != 2 || od.size() != 2 ||
      cd[1] * 2 != xd[1] || od[0] != xd[0] || od[1] != cd[0] ||
      scales.element_count() != cd[0] * xd[1] / 16 ||
      scales.element_type() != ffi::DataType::F8E4M3FN ||
      amax.element_count() != 1) {
    return InvalidArgument(
        "matmul_w4a16 expects x bf16 [M, K], codes u8 [N, K/2], e4m3 scales "
        "[N, K/16], amax f32 [1] and out [M, N]");
  }
  W4A16Plan plan;
  const std::string error = PlanW4A16(xd[0], cd[0], xd[1], &plan);
  if (!error.empty()) return InvalidArgument(error);
  if (workspace->element_count() < plan.workspace_bytes) {
    return InvalidArgument("matmul_w4a16: the workspace must have " +
                           std::to_string(plan.workspace_bytes) +
                           " bytes (plan_w4a16)");
  }
  w4a16::Args a;
  a.x = static_cast<const __nv_bfloat16*>(x.untyped_data());
  a.codes = codes.typed_data();
  a.scales = static_cast<const uint8_t*>(scales.untyped_data());
  a.amax = amax.typed_data();
  a.out = out->untyped_data();
  unsigned char* base = workspace->typed_data();
  a.arrivals = reinterpret_cast<unsigned int*>(base);
  a.partial = reinterpret_cast<float*>(base + plan.partial_offset);
  a.m = xd[0];
  a.n = cd[0];
  a.k = xd[1];
  if (!IsAligned(a.x, 16) || !IsAligned(a.codes, 16) ||
      !IsAligned(a.scales, 2) || !IsAligned(a.out, 8) || !IsAligned(base, 16)) {
    return InvalidArgument("matmul_w4a16 needs 16-byte aligned operands");
  }
  if (a.m == 0 || a.n == 0) return ffi::Error::Success();
  cudaError_t launched =
      cudaMemsetAsync(a.arrivals, 0, plan.arrivals_bytes, stream);
  if (launched != cudaSuccess)
    return Failed("the workspace's memset", launched);
  switch (out->element_type()) {
    case ffi::DataType::BF16:
      launched = w4a16::LaunchPlanned<__nv_bfloat16>(stream, a, plan);
      break;
    case ffi::DataType::F32:
      launched = w4a16::LaunchPlanned<float>(stream, a, plan);
      break;
    default:
      return InvalidArgument(
          "matmul_w4a16: the output must be bfloat16 or float32");
  }
  if (launched != cudaSuccess) return Failed("the kernel launch", launched);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4MatmulW4A16Cuda, jax_nvfp4::MatmulW4A16Cuda,
    jax_nvfp4::MatmulW4A16Binding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
