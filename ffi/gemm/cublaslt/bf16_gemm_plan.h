// Argument logic of the cuBLASLt GEMM handlers, kept free of CUDA and cuBLAS
// so that the extension can expose it to CPU tests (module.cc:
// plan_bf16_gemm): the workspace head that both handlers (fp4_gemm.cu,
// bf16_gemm.cu) write alpha and beta to, and the shape checks and
// call plan of the bf16 GEMM.
//
// The bf16 GEMM handler (target "jax_nvfp4_matmul_bf16") computes, for every
// batch item, the row-major product
//   out[m, n] = alpha * sum_k a[m, k] b[n, k],
//   alpha = (amax_a / 2688) * (amax_b / 2688),
// on a and b already decoded to bfloat16 (e2m1 * block scale is exact in
// bfloat16), accumulating in float32 and rounding alpha * acc once to the
// output type. As for the FP4 GEMM (fp4_gemm_plan.h), cuBLASLt is
// column-major and is asked for D = out^T [n x m] with A = b (k x n
// column-major, op(A) = A^T) and B = a (k x m column-major, op(B) = B): lda =
// ldb = k, ldd = n.
#ifndef JAX_NVFP4_FFI_GEMM_CUBLASLT_BF16_GEMM_PLAN_H_
#define JAX_NVFP4_FFI_GEMM_CUBLASLT_BF16_GEMM_PLAN_H_

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace jax_nvfp4 {

// The workspace result of a cuBLASLt GEMM handler starts with a head of
// floats: beta = 0.0f, then alpha of each batch item (cuBLASLt's device
// pointer mode reads both from device memory), padded to 256 bytes.
// cuBLASLt's own workspace follows (see AlignedCublasWorkspace in
// cublaslt.h).
inline int64_t GemmWorkspaceHeadBytes(int64_t batch) {
  return (static_cast<int64_t>(sizeof(float)) * (1 + batch) + 255) / 256 * 256;
}

// The checks both GEMM plans share, once a's batch, b's batch, M and N are
// known: amaxes of 1 value or one per item, out [batch, M, N], and a
// workspace with room for its head. Empty when they hold.
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

// One call of the bf16 GEMM handler, as the numbers cuBLASLt is given. Item
// strides are in elements; a stride of 0 means the operand is shared by every
// batch item.
//
// The work is done in `calls` cublasLtMatmul calls, each a strided batch of
// `call_batch` products of call_m x n x k:
// * one alpha (both amaxes have one value) and a shared b: one GEMM with the
//   items stacked along M (a and out are contiguous [batch * M, ...]);
// * one alpha and one b per item: one strided batched GEMM;
// * one alpha per item: one GEMM per item (cuBLASLt's device pointer mode
//   reads a single alpha per call).
struct Bf16GemmPlan {
  int64_t batch = 0;
  int64_t m = 0;  // rows of each a item and of each out item
  int64_t n = 0;  // rows of b, columns of out
  int64_t k = 0;  // contraction length
  int64_t a_stride = 0;
  int64_t b_stride = 0;
  int64_t out_stride = 0;
  int64_t a_amax_stride = 0;
  int64_t b_amax_stride = 0;
  int64_t alphas = 0;  // alphas the handler computes: 1 (shared) or batch
  int64_t calls = 0;
  int64_t call_batch = 0;
  int64_t call_m = 0;
  int64_t workspace_head_bytes = 0;  // beta and alphas
  int64_t workspace_bytes = 0;       // for cuBLASLt, after the head
};

// Checks the operand shapes of one call and fills `plan`. Returns "" when they
// are consistent, else a message saying what is wrong. Shapes:
//   a [batch, m, k] bf16, b [1 | batch, n, k] bf16, a_amax [1 | batch] f32,
//   b_amax [1 | b's batch] f32, out [batch, m, n], workspace [bytes] u8.
inline std::string PlanBf16Gemm(const std::vector<int64_t>& a,
                                const std::vector<int64_t>& b,
                                const std::vector<int64_t>& a_amax,
                                const std::vector<int64_t>& b_amax,
                                const std::vector<int64_t>& out,
                                const std::vector<int64_t>& workspace,
                                Bf16GemmPlan* plan) {
  const std::string fix =
      "; lower jax_nvfp4.matmul, which prepares the operands "
      "(jax_nvfp4.backends.bf16_gemm.matmul_bf16)";
  if (a.size() != 3 || b.size() != 3 || out.size() != 3) {
    return "a, b and out must be rank 3 [batch, rows, ...]" + fix;
  }
  if (a_amax.size() != 1 || b_amax.size() != 1 || workspace.size() != 1) {
    return "the amaxes and the workspace must be rank 1" + fix;
  }
  const int64_t batch = a[0], m = a[1], k = a[2];
  const int64_t b_batch = b[0], n = b[1];
  if (b[2] != k) {
    return "a and b must have the same K (got " + std::to_string(k) + " and " +
           std::to_string(b[2]) + ")" + fix;
  }
  if (b_batch != 1 && b_batch != batch) {
    return "b's batch must be 1 or a's (" + std::to_string(batch) + "), got " +
           std::to_string(b_batch);
  }
  if (std::string e = CheckGemmAmaxOutWorkspace(batch, b_batch, m, n, a_amax,
                                                b_amax, out, workspace);
      !e.empty()) {
    return e;
  }
  const int64_t head = GemmWorkspaceHeadBytes(batch);
  const bool shared_b = b_batch == 1;
  const bool one_alpha = a_amax[0] == 1 && b_amax[0] == 1;
  plan->batch = batch;
  plan->m = m;
  plan->n = n;
  plan->k = k;
  plan->a_stride = m * k;
  plan->b_stride = shared_b ? 0 : n * k;
  plan->out_stride = m * n;
  plan->a_amax_stride = a_amax[0] == 1 ? 0 : 1;
  plan->b_amax_stride = b_amax[0] == 1 ? 0 : 1;
  plan->alphas = one_alpha ? 1 : batch;
  if (one_alpha && shared_b) {
    plan->calls = batch == 0 ? 0 : 1;
    plan->call_batch = 1;
    plan->call_m = batch * m;
  } else if (one_alpha) {
    plan->calls = 1;
    plan->call_batch = batch;
    plan->call_m = m;
  } else {
    plan->calls = batch;
    plan->call_batch = 1;
    plan->call_m = m;
  }
  plan->workspace_head_bytes = head;
  plan->workspace_bytes = workspace[0] - head;
  // cuBLASLt takes the batch count as int32 and its kernels index rows and
  // columns with 32-bit integers.
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (plan->call_m > kMax || n > kMax || k > kMax || plan->call_batch > kMax) {
    return "each GEMM dimension must be below 2^31 (got M=" +
           std::to_string(plan->call_m) + ", N=" + std::to_string(n) +
           ", K=" + std::to_string(k) +
           ", batch=" + std::to_string(plan->call_batch) +
           "); split the product";
  }
  return "";
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_CUBLASLT_BF16_GEMM_PLAN_H_
