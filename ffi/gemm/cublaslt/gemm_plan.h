// What the plans of the cuBLASLt GEMM handlers (bf16_gemm_plan.h,
// fp4_gemm_plan.h, fp4_grouped_gemm_plan.h) hand the body the handlers share
// (gemm_call.h): the call as a list of cublasLtMatmul launches, the ranges
// of out that no launch writes, the alphas and the workspace. Free of CUDA
// and cuBLAS, so that the plans are tested on the CPU (tests/cpp/).
//
// Every launch is the row-major product
//   out[m, n] = alpha * sum_k a[m, k] b[n, k],
// accumulated in float32 and rounded once to out's type. cuBLASLt is
// column-major, so it is asked for D = out^T (n x m) = op(A) op(B) with
// A = b (k x n column-major, op(A) = A^T) and B = a (k x m, op(B) = B): the
// "TN" layout, which block-scaled FP4 requires; lda = ldb = ld, ldd = n.
#ifndef JAX_NVFP4_FFI_GEMM_CUBLASLT_GEMM_PLAN_H_
#define JAX_NVFP4_FFI_GEMM_CUBLASLT_GEMM_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

namespace jax_nvfp4 {

// One cublasLtMatmul: `batch` products of m x n x k (a strided batch, items
// `*_stride` elements apart) on the operands at these offsets.
struct GemmLaunch {
  int64_t m = 0, n = 0, k = 0;
  int64_t ld = 0;  // elements from one row of a (and of b) to the next
  int64_t batch = 1;
  int64_t a_stride = 0, b_stride = 0, out_stride = 0;  // elements
  int64_t a = 0, b = 0;                                // bytes into a and b
  int64_t a_scales = 0, b_scales = 0;  // bytes into their block scales (FP4)
  int64_t out = 0;                     // elements into out
  int64_t alpha = 0;                   // which alpha of the workspace head
  int64_t group = -1;                  // the group it serves (grouped GEMM)
};

// A range of out's elements [begin, end) that no launch writes: zeros.
struct ElementRange {
  int64_t begin = 0, end = 0;
};

// One call of a cuBLASLt GEMM handler.
struct GemmCallPlan {
  // The whole product, for error messages: `batch` items (groups, where
  // `grouped`) of M x N x K.
  int64_t batch = 0, m = 0, n = 0, k = 0;
  bool grouped = false;
  // alpha_i = (a_amax[i * a_amax_stride] / 2688) *
  //           (b_amax[i * b_amax_stride] / 2688), i < alphas.
  int64_t alphas = 0;
  int64_t a_amax_stride = 0, b_amax_stride = 0;
  // The workspace result: the head (beta, then the alphas; see
  // GemmWorkspaceHeadBytes), then cuBLASLt's part.
  int64_t workspace_head_bytes = 0;
  int64_t workspace_bytes = 0;  // for cuBLASLt, after the head
  std::vector<GemmLaunch> launches;
  std::vector<ElementRange> zeros;
};

// The workspace result of a cuBLASLt GEMM handler starts with a head of
// floats: beta = 0.0f, then the alphas (cuBLASLt's device pointer mode
// reads both from device memory), padded to 256 bytes. cuBLASLt's own
// workspace follows (see AlignedCublasWorkspace in cublaslt.h).
inline int64_t GemmWorkspaceHeadBytes(int64_t alphas) {
  return (static_cast<int64_t>(sizeof(float)) * (1 + alphas) + 255) / 256 * 256;
}

// Fills the parts of `plan` that the bf16 and FP4 GEMMs share once their
// checks hold: the problem, the alphas (one, or one per item where either
// amax has one per item), the workspace and, for an empty sum (K = 0), out
// as one range of zeros.
inline void PlanBatchedGemmCall(int64_t batch, int64_t m, int64_t n, int64_t k,
                                int64_t a_amax, int64_t b_amax,
                                int64_t workspace, GemmCallPlan* plan) {
  plan->batch = batch;
  plan->m = m;
  plan->n = n;
  plan->k = k;
  plan->grouped = false;
  plan->a_amax_stride = a_amax == 1 ? 0 : 1;
  plan->b_amax_stride = b_amax == 1 ? 0 : 1;
  plan->alphas = a_amax == 1 && b_amax == 1 ? 1 : batch;
  plan->workspace_head_bytes = GemmWorkspaceHeadBytes(batch);
  plan->workspace_bytes = workspace - plan->workspace_head_bytes;
  plan->launches.clear();
  plan->zeros.clear();
  if (k == 0 && batch * m * n > 0) plan->zeros.push_back({0, batch * m * n});
}

// The checks of the bf16 and FP4 GEMM plans, once a's batch, b's batch, M
// and N are known: amaxes of 1 value or one per item, out [batch, M, N], and
// a workspace with room for its head. Empty when they hold.
inline std::string CheckGemmAmaxOutWorkspace(
    int64_t batch, int64_t b_batch, int64_t m, int64_t n,
    const std::vector<int64_t>& a_amax, const std::vector<int64_t>& b_amax,
    const std::vector<int64_t>& out, const std::vector<int64_t>& workspace) {
  if ((a_amax[0] != 1 && a_amax[0] != batch) ||
      (b_amax[0] != 1 && b_amax[0] != b_batch)) {
    return "each amax must have 1 value or one per item of its operand's "
           "batch (a: " +
           std::to_string(batch) + ", b: " + std::to_string(b_batch) +
           "), got " + std::to_string(a_amax[0]) + " and " +
           std::to_string(b_amax[0]);
  }
  if (out[0] != batch || out[1] != m || out[2] != n) {
    return "out must be [batch, M, N] = [" + std::to_string(batch) + ", " +
           std::to_string(m) + ", " + std::to_string(n) + "]";
  }
  const int64_t head = GemmWorkspaceHeadBytes(batch);
  if (workspace[0] < head) {
    return "the workspace must have at least " + std::to_string(head) +
           " bytes (beta and one alpha per batch item)";
  }
  return "";
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_CUBLASLT_GEMM_PLAN_H_
