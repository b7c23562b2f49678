// Argument logic of the native Blackwell FP4 GEMM (fp4_gemm.cu), kept
// free of CUDA and cuBLAS so that the extension can expose it to CPU tests
// (module.cc: plan_fp4_gemm) next to jax_nvfp4/backends/fp4_gemm.py, which
// prepares the operands.
//
// The handler computes, for every batch item, the row-major product
//   out[m, n] = alpha * sum_k e2m1(a[m, k]) s_a[m, k/16] e2m1(b[n, k]) s_b[n,
//   k/16]
// on operands already padded to the tiles below (padding is zero). cuBLASLt
// is column-major, so it is asked for D = out^T [n x m] = op(A) op(B) with
// A = b ([n, k] row-major is k x n column-major, op(A) = A^T) and B = a
// (k x m column-major, op(B) = B): the "TN" layout that block-scaled FP4
// requires. Every leading dimension is k (A, B) or n (D). alpha is computed
// on the device from the amaxes, as on every backend:
// (amax_a / 2688) * (amax_b / 2688).
#ifndef JAX_NVFP4_FFI_GEMM_CUBLASLT_FP4_GEMM_PLAN_H_
#define JAX_NVFP4_FFI_GEMM_CUBLASLT_FP4_GEMM_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "gemm/cublaslt/bf16_gemm_plan.h"

namespace jax_nvfp4 {

// Row tile (M and N) and K tile the handler requires. 128 rows x 4 scale
// columns (= 64 elements of K) is one tile of the VEC16_UE4M3 scale layout
// (numerics/scale_layout.h), so every scale and code byte cuBLASLt reads is
// defined; it also satisfies the 16-byte alignment of every leading dimension.
inline constexpr int64_t kFp4RowTile = 128;
inline constexpr int64_t kFp4KTile = 64;
// One call of the handler, as the plain numbers cuBLASLt is given. Strides are
// per batch item, in bytes for codes and scales and in elements for out and
// the amaxes; a stride of 0 means the operand is shared by every item.
struct Fp4GemmPlan {
  int64_t batch = 0;
  int64_t m = 0;  // padded rows of a and of out
  int64_t n = 0;  // padded rows of b, columns of out
  int64_t k = 0;  // padded contraction length (elements)
  int64_t a_codes_stride = 0;
  int64_t b_codes_stride = 0;
  int64_t a_scales_stride = 0;
  int64_t b_scales_stride = 0;
  int64_t out_stride = 0;
  int64_t a_amax_stride = 0;
  int64_t b_amax_stride = 0;
  // The workspace result: the head of bf16_gemm_plan.h (beta, then the alpha
  // of each item), then cuBLASLt's part.
  int64_t workspace_head_bytes = 0;
  int64_t workspace_bytes = 0;  // for cuBLASLt, after the head
};

// Checks the operand shapes of one call and fills `plan`. Returns "" when
// they are consistent, else a message saying what is wrong. Shapes:
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
    Fp4GemmPlan* plan) {
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
  const int64_t head = GemmWorkspaceHeadBytes(batch);
  plan->batch = batch;
  plan->m = m;
  plan->n = n;
  plan->k = k;
  plan->a_codes_stride = m * k / 2;
  plan->b_codes_stride = b_batch == 1 ? 0 : n * k / 2;
  plan->a_scales_stride = m * k / 16;
  plan->b_scales_stride = b_batch == 1 ? 0 : n * k / 16;
  plan->out_stride = m * n;
  plan->a_amax_stride = a_amax[0] == 1 ? 0 : 1;
  plan->b_amax_stride = b_amax[0] == 1 ? 0 : 1;
  plan->workspace_head_bytes = head;
  plan->workspace_bytes = workspace[0] - head;
  return "";
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_CUBLASLT_FP4_GEMM_PLAN_H_
