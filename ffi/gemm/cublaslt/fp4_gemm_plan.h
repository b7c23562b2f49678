// Argument logic of the native Blackwell FP4 GEMM (fp4_gemm.cu), kept
// free of CUDA and cuBLAS so that it is tested on the CPU (tests/cpp/, and
// against jax_nvfp4/backends/fp4_gemm.py, which prepares the operands,
// through jax_nvfp4._ffi_testing.plan_fp4_gemm).
//
// The handler computes, for every batch item, the row-major product
//   out[m, n] = alpha * sum_k e2m1(a[m, k]) s_a[m, k/16] e2m1(b[n, k]) s_b[n,
//   k/16],
//   alpha = (amax_a / 2688) * (amax_b / 2688),
// on operands already padded to the tiles below (padding is zero): launches
// of gemm_plan.h with ld = K and VEC16_UE4M3 block scales.
#ifndef JAX_NVFP4_FFI_GEMM_CUBLASLT_FP4_GEMM_PLAN_H_
#define JAX_NVFP4_FFI_GEMM_CUBLASLT_FP4_GEMM_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "gemm/cublaslt/gemm_plan.h"

namespace jax_nvfp4 {

// Row tile (M and N) and K tile the handler requires. 128 rows x 4 scale
// columns (= 64 elements of K) is one tile of the VEC16_UE4M3 scale layout
// (numerics/scale_layout.h), so every scale and code byte cuBLASLt reads is
// defined; it also satisfies the 16-byte alignment of every leading dimension.
inline constexpr int64_t kFp4RowTile = 128;
inline constexpr int64_t kFp4KTile = 64;
// Checks the operand shapes of one call and plans it: one launch per batch
// item (it is unambiguous where each item's block scales live, and alpha may
// differ per item). Returns "" when the shapes are consistent, else a message
// saying what is wrong. Shapes:
//   a_codes [batch, m, k/2] u8, a_scales [batch, m*k/16] u8 (swizzled),
//   a_amax [1 | batch] f32, b_codes [1 | batch, n, k/2] u8,
//   b_scales [1 | batch, n*k/16] u8, b_amax [1 | b's batch] f32,
//   out [batch, m, n], workspace [bytes] u8;
// m and n multiples of kFp4RowTile, k a multiple of kFp4KTile.
inline std::string PlanFp4Gemm(
    const std::vector<int64_t>& a_codes, const std::vector<int64_t>& a_scales,
    const std::vector<int64_t>& a_amax, const std::vector<int64_t>& b_codes,
    const std::vector<int64_t>& b_scales, const std::vector<int64_t>& b_amax,
    const std::vector<int64_t>& out, const std::vector<int64_t>& workspace,
    GemmCallPlan* plan) {
  const std::string fix =
      "; prepare the operands with jax_nvfp4.backends.fp4_gemm.native_operands";
  if (a_codes.size() != 3 || b_codes.size() != 3 || out.size() != 3) {
    return "a_codes, b_codes and out must be rank 3 [batch, rows, ...]" + fix;
  }
  if (a_scales.size() != 2 || b_scales.size() != 2 || a_amax.size() != 1 ||
      b_amax.size() != 1 || workspace.size() != 1) {
    return "a_scales and b_scales must be rank 2 [batch, bytes], the amaxes "
           "and the workspace rank 1" +
           fix;
  }
  const int64_t batch = a_codes[0], m = a_codes[1], k = 2 * a_codes[2];
  const int64_t b_batch = b_codes[0], n = b_codes[1];
  if (m % kFp4RowTile != 0 || n % kFp4RowTile != 0) {
    return "M and N must be multiples of " + std::to_string(kFp4RowTile) +
           " (got M=" + std::to_string(m) + ", N=" + std::to_string(n) + ")" +
           fix;
  }
  if (k % kFp4KTile != 0 || 2 * b_codes[2] != k) {
    return "a and b must have the same K, a multiple of " +
           std::to_string(kFp4KTile) + " (got " + std::to_string(k) + " and " +
           std::to_string(2 * b_codes[2]) + ")" + fix;
  }
  if (b_batch != 1 && b_batch != batch) {
    return "b's batch must be 1 or a's (" + std::to_string(batch) + "), got " +
           std::to_string(b_batch);
  }
  if (a_scales[0] != batch || a_scales[1] != m * (k / 16) ||
      b_scales[0] != b_batch || b_scales[1] != n * (k / 16)) {
    return "a_scales must be [batch, M*K/16] and b_scales [b batch, N*K/16] "
           "(the swizzled block scales of the padded operands)" +
           fix;
  }
  if (std::string e = CheckGemmAmaxOutWorkspace(batch, b_batch, m, n, a_amax,
                                                b_amax, out, workspace);
      !e.empty()) {
    return e;
  }
  PlanBatchedGemmCall(batch, m, n, k, a_amax[0], b_amax[0], workspace[0], plan);
  if (k == 0 || batch * m * n == 0) return "";
  const bool shared_b = b_batch == 1;
  GemmLaunch l;
  l.m = m;
  l.n = n;
  l.k = k;
  l.ld = k;
  for (int64_t i = 0; i < batch; ++i) {
    l.a = i * m * k / 2;
    l.b = shared_b ? 0 : i * n * k / 2;
    l.a_scales = i * m * k / 16;
    l.b_scales = shared_b ? 0 : i * n * k / 16;
    l.out = i * m * n;
    l.alpha = plan->alphas == 1 ? 0 : i;
    plan->launches.push_back(l);
  }
  return "";
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_CUBLASLT_FP4_GEMM_PLAN_H_
