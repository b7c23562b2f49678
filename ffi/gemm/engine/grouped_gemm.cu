// ragged_dot's grouped GEMM on the Hopper engine (sm_90a): FFI target
// "jax_nvfp4_grouped_gemm_sm90", the contract of jax_nvfp4_grouped_gemm_bf16
// (ffi/gemm/mma/bf16_grouped_gemm.cu) on wgmma and TMA kernels:
//
//   rows   (FPROP, DGRAD): a [R, L], b [G, N, L] -> out [R, N]
//          (grouped_rows.cuh); rows outside every group are not written.
//   tokens (WGRAD): a [lines, M, 64], b [lines, N, 64] -> out [G, M, N]
//          (grouped_tokens.cuh): 64 tokens per line, four 16-token items;
//          empty groups give zeros.
//
// sizes [G] (the groups' rows or tokens in the token buffer, multiples of
// 16) are read on the device; the launch needs no host synchronization and
// is safe to record into CUDA graphs. The tensor maps are encoded on the
// host per call and passed by value. Python picks this target only on
// compute capability 9.0 and for shapes grouped_plan.h accepts; the checks
// here keep a malformed call from reading or writing out of bounds.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "bindings.h"
#include "checks.h"
#include "cuda/launch.cuh"
#include "gemm/engine/grouped_plan.h"
#include "gemm/engine/grouped_rows.cuh"
#include "gemm/engine/grouped_tokens.cuh"
#include "gemm/engine/hopper.h"
#include "gemm/engine/tensor_map.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

using engine::GroupedRowsShape;
using engine::GroupedTokensShape;

// One persistent launch of an engine kernel as `plan` sizes it.
template <typename... Params, typename... Args>
ffi::Error Launch(void (*kernel)(Params...), int threads,
                  const engine::GroupedPlan& plan, cudaStream_t stream,
                  const char* what, Args... args) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(plan.shared_bytes)) !=
      cudaSuccess) {
    return LaunchError("grouped_gemm_sm90 (shared memory)");
  }
  kernel<<<static_cast<unsigned>(plan.grid), threads, plan.shared_bytes,
           stream>>>(args...);
  return LaunchError(what);
}

// The tensor maps of both operands (contiguous bf16, 128-byte swizzle).
ffi::Error OperandMaps(const void* a, const void* b, int rank,
                       const uint64_t* dims_a, const uint64_t* dims_b,
                       const uint32_t* box_a, const uint32_t* box_b,
                       CUtensorMap* map_a, CUtensorMap* map_b) {
  if (!engine::Bf16TensorMap(a, rank, dims_a, box_a, CU_TENSOR_MAP_SWIZZLE_128B,
                             map_a) ||
      !engine::Bf16TensorMap(b, rank, dims_b, box_b, CU_TENSOR_MAP_SWIZZLE_128B,
                             map_b)) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "jax_nvfp4: grouped_gemm_sm90 could not encode its "
                      "tensor maps (a CUDA driver of 12.0 or newer?)");
  }
  return ffi::Error::Success();
}

ffi::Error GroupedGemmSm90Cuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> a,
                               ffi::Buffer<ffi::BF16> b,
                               ffi::Buffer<ffi::S32> sizes,
                               ffi::Buffer<ffi::F32> alpha,
                               ffi::Result<ffi::AnyBuffer> out, bool tokens) {
  const auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  const int64_t groups = sizes.element_count();
  if (alpha.element_count() != groups) {
    return InvalidArgument("grouped_gemm_sm90: sizes and alpha must be [G]");
  }
  const int sms = engine::HopperSms();
  if (sms == 0) {
    return InvalidArgument(
        "grouped_gemm_sm90 runs on compute capability 9.0 GPUs only (the "
        "dispatcher picks another grouped GEMM elsewhere)");
  }
  if (!IsAligned(a.typed_data(), 16) || !IsAligned(b.typed_data(), 16) ||
      !IsAligned(out->untyped_data(), 8)) {
    return InvalidArgument("grouped_gemm_sm90 needs 16-byte aligned operands");
  }
  engine::GroupedPlan plan;
  CUtensorMap map_a, map_b;
  if (!tokens) {
    if (ad.size() != 2 || bd.size() != 3 || od.size() != 2 || bd[0] != groups ||
        bd[2] != ad[1] || od[0] != ad[0] || od[1] != bd[1]) {
      return InvalidArgument(
          "grouped_gemm_sm90 (rows) expects a [R, L], b [G, N, L], out [R, N]");
    }
    const int64_t rows = ad[0], k = ad[1], n = bd[1];
    const std::string error =
        engine::PlanGroupedRows(rows, k, groups, n, sms, &plan);
    if (!error.empty()) return InvalidArgument(error);
    if (out->element_count() == 0) return ffi::Error::Success();
    const uint64_t dims_a[] = {uint64_t(k), uint64_t(rows)};
    const uint64_t dims_b[] = {uint64_t(k), uint64_t(groups * n)};
    const uint32_t box_a[] = {GroupedRowsShape::kBlockK,
                              GroupedRowsShape::kBlockRows};
    const uint32_t box_b[] = {GroupedRowsShape::kBlockK,
                              GroupedRowsShape::kBlockCols};
    if (ffi::Error e = OperandMaps(a.typed_data(), b.typed_data(), 2, dims_a,
                                   dims_b, box_a, box_b, &map_a, &map_b);
        e.failure()) {
      return e;
    }
    return ByOutputType(
        out->element_type(), "grouped_gemm_sm90", [&](auto zero) {
          using Out = decltype(zero);
          return Launch(engine::GroupedRowsKernel<Out>,
                        GroupedRowsShape::kThreads, plan, stream,
                        "grouped_gemm_sm90 (rows)", map_a, map_b,
                        sizes.typed_data(), alpha.typed_data(),
                        static_cast<Out*>(out->untyped_data()), int(groups),
                        int(rows), int(n), int(k));
        });
  }
  const int64_t line = GroupedTokensShape::kLineTokens;
  if (ad.size() != 3 || bd.size() != 3 || od.size() != 3 || ad[2] != line ||
      bd[2] != line || ad[0] != bd[0] || od[0] != groups || od[1] != ad[1] ||
      od[2] != bd[1]) {
    return InvalidArgument(
        "grouped_gemm_sm90 (tokens) expects a [lines, M, 64], b [lines, N, "
        "64], out [G, M, N]");
  }
  const int64_t lines = ad[0], m = ad[1], n = bd[1];
  const std::string error =
      engine::PlanGroupedTokens(lines, m, n, groups, sms, &plan);
  if (!error.empty()) return InvalidArgument(error);
  if (out->element_count() == 0) return ffi::Error::Success();
  if (lines == 0) {  // no tokens: every group is empty
    if (cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream) !=
        cudaSuccess) {
      return LaunchError("grouped_gemm_sm90 (zeros)");
    }
    return ffi::Error::Success();
  }
  const uint64_t dims_a[] = {uint64_t(line), uint64_t(m), uint64_t(lines)};
  const uint64_t dims_b[] = {uint64_t(line), uint64_t(n), uint64_t(lines)};
  const uint32_t box_a[] = {uint32_t(line), GroupedTokensShape::kBlockM, 1};
  const uint32_t box_b[] = {uint32_t(line), GroupedTokensShape::kBlockN, 1};
  if (ffi::Error e = OperandMaps(a.typed_data(), b.typed_data(), 3, dims_a,
                                 dims_b, box_a, box_b, &map_a, &map_b);
      e.failure()) {
    return e;
  }
  return ByOutputType(out->element_type(), "grouped_gemm_sm90", [&](auto zero) {
    using Out = decltype(zero);
    return Launch(
        engine::GroupedTokensKernel<Out>, GroupedTokensShape::kThreads, plan,
        stream, "grouped_gemm_sm90 (tokens)", map_a, map_b, sizes.typed_data(),
        alpha.typed_data(), static_cast<Out*>(out->untyped_data()), int(groups),
        int(lines), int(m), int(n));
  });
}

}  // namespace
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4GroupedGemmSm90Cuda, jax_nvfp4::GroupedGemmSm90Cuda,
    jax_nvfp4::GroupedGemmBf16Binding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
