// The weight-only NVFP4 GEMM of serving (W4A16) on the Hopper engine
// (sm_90a): FFI target "jax_nvfp4_matmul_w4a16_sm90", the product of
// jax_nvfp4_matmul_w4a16 (ffi/gemm/mma/w4a16_gemm.cu) on wgmma and TMA,
//
//   out[m, n] = (amax / 2688) * sum_k x[m, k] * e2m1(w[n, k]) * s[n, k / 16]
//
// x bf16 [M, K]; codes uint8 [N, K / 2]; E4M3 scales [N, K / 16]; amax
// float32 [1]; out bf16, f16 or f32 [M, N]. The weight is decoded in
// registers (w4a16.cuh); no workspace, no bf16 copy of the weight. Python
// picks this target only on compute capability 9.0 and for K a multiple of
// 256 (w4a16_plan.h); the checks here keep a malformed call from reading
// or writing out of bounds.
//
// FFI target "jax_nvfp4_ragged_w4a16_sm90": the grouped form of the same
// kernel (ragged_dot of bf16 rows by NVFP4 expert weights, serving).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "bindings.h"
#include "checks.h"
#include "cuda/launch.cuh"
#include "gemm/engine/hopper.h"
#include "gemm/engine/w4a16.cuh"
#include "gemm/engine/w4a16_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

// The part both targets share, once their shapes are checked: the plan,
// the operands' alignment, the tensor maps (the weights' G * N rows as one)
// and the launch in the output's type. groups > 0: the grouped form, its
// output zeroed first (the rows no group covers; the sizes live on the
// device).
ffi::Error RunW4A16(const char* name, cudaStream_t stream,
                    ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> codes,
                    ffi::AnyBuffer scales, ffi::Buffer<ffi::F32> amax,
                    const int32_t* group_sizes, ffi::Result<ffi::AnyBuffer> out,
                    int64_t m, int64_t groups, int64_t n, int64_t k) {
  const int sms = engine::HopperSms();
  if (sms == 0) {
    return InvalidArgument(
        std::string(name) +
        " runs on compute capability 9.0 GPUs only (the dispatcher picks "
        "another W4A16 GEMM elsewhere)");
  }
  engine::W4A16Plan plan;
  const std::string error =
      groups > 0 ? engine::PlanW4A16Grouped(m, groups, n, k, sms, &plan)
                 : engine::PlanW4A16(m, n, k, sms, &plan);
  if (!error.empty()) return InvalidArgument(error);
  if (!IsAligned(x.typed_data(), 16) || !IsAligned(codes.typed_data(), 16) ||
      !IsAligned(scales.untyped_data(), 16) ||
      !IsAligned(out->untyped_data(), 16)) {
    return InvalidArgument(std::string(name) +
                           " needs 16-byte aligned operands");
  }
  CUtensorMap x_map, codes_map, scales_map;
  if (!engine::W4A16Maps(x.typed_data(), codes.typed_data(),
                         scales.untyped_data(), m,
                         std::max<int64_t>(groups, 1) * n, k, plan.config,
                         &x_map, &codes_map, &scales_map)) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jax_nvfp4: ") + name +
                          " could not encode its tensor maps (a CUDA driver "
                          "of 12.0 or newer?)");
  }
  return ByOutputType(out->element_type(), name, [&](auto zero) {
    using Out = decltype(zero);
    cudaError_t launched = cudaSuccess;
    if (groups > 0) {
      launched =
          cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    }
    if (launched == cudaSuccess) {
      launched = engine::LaunchW4A16(
          plan, x_map, codes_map, scales_map,
          reinterpret_cast<const __nv_bfloat16*>(x.typed_data()),
          amax.typed_data(), static_cast<Out*>(out->untyped_data()), int(m),
          int(n), int(k), stream, group_sizes, int(groups));
    }
    if (launched != cudaSuccess) {
      return ffi::Error(
          ffi::ErrorCode::kInternal,
          std::string("jax_nvfp4: ") + name +
              "'s launch failed: " + cudaGetErrorString(launched));
    }
    return ffi::Error::Success();
  });
}

ffi::Error MatmulW4A16Sm90Cuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> x,
                               ffi::Buffer<ffi::U8> codes,
                               ffi::AnyBuffer scales,
                               ffi::Buffer<ffi::F32> amax,
                               ffi::Result<ffi::AnyBuffer> out) {
  const auto xd = x.dimensions(), cd = codes.dimensions();
  const auto od = out->dimensions();
  if (xd.size() != 2 || cd.size() != 2 || od.size() != 2 ||
      cd[1] * 2 != xd[1] || od[0] != xd[0] || od[1] != cd[0] ||
      scales.element_count() != cd[0] * xd[1] / 16 ||
      scales.element_type() != ffi::DataType::F8E4M3FN ||
      amax.element_count() != 1) {
    return InvalidArgument(
        "matmul_w4a16_sm90 expects x bf16 [M, K], codes u8 [N, K/2], e4m3 "
        "scales [N, K/16], amax f32 [1] and out [M, N]");
  }
  const int64_t m = xd[0], n = cd[0], k = xd[1];
  if (m == 0 || n == 0) return ffi::Error::Success();
  return RunW4A16("matmul_w4a16_sm90", stream, x, codes, scales, amax, nullptr,
                  out, m, 0, n, k);
}

// The grouped form: x bf16 [T, K] with its rows in groups (group_sizes,
// int32 [G]), group g's rows times weight g: codes u8 [G, N, K/2], e4m3
// scales [G, N, K/16], amax f32 [G]. Rows past the sizes' sum are zeros.
ffi::Error RaggedW4A16Sm90Cuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> x,
                               ffi::Buffer<ffi::U8> codes,
                               ffi::AnyBuffer scales,
                               ffi::Buffer<ffi::F32> amax,
                               ffi::Buffer<ffi::S32> group_sizes,
                               ffi::Result<ffi::AnyBuffer> out) {
  const auto xd = x.dimensions(), cd = codes.dimensions();
  const auto od = out->dimensions();
  if (xd.size() != 2 || cd.size() != 3 || od.size() != 2 ||
      cd[2] * 2 != xd[1] || od[0] != xd[0] || od[1] != cd[1] ||
      scales.element_count() != cd[0] * cd[1] * xd[1] / 16 ||
      scales.element_type() != ffi::DataType::F8E4M3FN ||
      amax.element_count() != cd[0] || group_sizes.element_count() != cd[0]) {
    return InvalidArgument(
        "ragged_w4a16_sm90 expects x bf16 [T, K], codes u8 [G, N, K/2], e4m3 "
        "scales [G, N, K/16], amax f32 [G], group_sizes s32 [G] and out "
        "[T, N]");
  }
  const int64_t rows = xd[0], groups = cd[0], n = cd[1], k = xd[1];
  if (rows == 0 || n == 0) return ffi::Error::Success();
  if (groups == 0) {  // no group takes a row: zeros
    const cudaError_t e =
        cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    if (e == cudaSuccess) return ffi::Error::Success();
    return ffi::Error(
        ffi::ErrorCode::kInternal,
        std::string("jax_nvfp4: ragged_w4a16_sm90: ") + cudaGetErrorString(e));
  }
  return RunW4A16("ragged_w4a16_sm90", stream, x, codes, scales, amax,
                  group_sizes.typed_data(), out, rows, groups, n, k);
}

}  // namespace
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4MatmulW4A16Sm90Cuda, jax_nvfp4::MatmulW4A16Sm90Cuda,
    jax_nvfp4::MatmulW4A16Sm90Binding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4RaggedW4A16Sm90Cuda, jax_nvfp4::RaggedW4A16Sm90Cuda,
    jax_nvfp4::RaggedW4A16Sm90Binding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
