// Argument logic of the bf16 GEMM handler (bf16_gemm.cu): its shape checks
// and call plan, kept free of CUDA and cuBLAS so that they are tested on the
// CPU (tests/cpp/gemm_plan_test.cc).
//
// The bf16 GEMM handler (target "jax_nvfp4_matmul_bf16") computes, for every
// batch item, the row-major product
//   out[m, n] = alpha * sum_k a[m, k] b[n, k],
//   alpha = (amax_a / 2688) * (amax_b / 2688),
// on a and b already decoded to bfloat16 (e2m1 * block scale is exact in
// bfloat16), accumulating in float32 and rounding alpha * acc once to the
// output type: launches of gemm_plan.h with ld = K.
#ifndef JAX_NVFP4_FFI_GEMM_CUBLASLT_BF16_GEMM_PLAN_H_
#define JAX_NVFP4_FFI_GEMM_CUBLASLT_BF16_GEMM_PLAN_H_

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gemm/cublaslt/gemm_plan.h"

namespace jax_nvfp4 {

// Checks the operand shapes of one call and plans it. Returns "" when they
// are consistent, else a message saying what is wrong. Shapes:
//   a [batch, m, k] bf16, b [1 | batch, n, k] bf16, a_amax [1 | batch] f32,
//   b_amax [1 | b's batch] f32, out [batch, m, n], workspace [bytes] u8.
//
// The launches, each a strided batch of products of the same shape:
// * one alpha (both amaxes have one value) and a shared b: one launch with
//   the items stacked along M (a and out are contiguous [batch * M, ...]);
// * one alpha and one b per item: one strided batched launch;
// * one alpha per item: one launch per item (cuBLASLt's device pointer mode
//   reads a single alpha per launch).
inline std::string PlanBf16Gemm(const std::vector<int64_t>& a,
                                const std::vector<int64_t>& b,
                                const std::vector<int64_t>& a_amax,
                                const std::vector<int64_t>& b_amax,
                                const std::vector<int64_t>& out,
                                const std::vector<int64_t>& workspace,
                                GemmCallPlan* plan) {
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
  const bool shared_b = b_batch == 1;
  const bool one_alpha = a_amax[0] == 1 && b_amax[0] == 1;
  GemmLaunch l;
  l.n = n;
  l.k = k;
  l.ld = k;
  l.a_stride = m * k;
  l.b_stride = shared_b ? 0 : n * k;
  l.out_stride = m * n;
  int64_t launches = batch;
  if (one_alpha && shared_b) {
    launches = 1;
    l.m = batch * m;
  } else if (one_alpha) {
    launches = 1;
    l.m = m;
    l.batch = batch;
  } else {
    l.m = m;
  }
  // cuBLASLt takes the batch count as int32 and its kernels index rows and
  // columns with 32-bit integers.
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (l.m > kMax || n > kMax || k > kMax || l.batch > kMax) {
    return "each GEMM dimension must be below 2^31 (got M=" +
           std::to_string(l.m) + ", N=" + std::to_string(n) +
           ", K=" + std::to_string(k) + ", batch=" + std::to_string(l.batch) +
           "); split the product";
  }
  PlanBatchedGemmCall(batch, m, n, k, a_amax[0], b_amax[0], workspace[0], plan);
  if (k == 0 || batch * m * n == 0) return "";
  constexpr int64_t kBf16Bytes = 2;
  // Launch i covers item i when there is one launch per item, else every
  // item.
  for (int64_t i = 0; i < launches; ++i) {
    l.a = i * l.a_stride * kBf16Bytes;
    l.b = i * l.b_stride * kBf16Bytes;
    l.out = i * l.out_stride;
    l.alpha = one_alpha ? 0 : i;
    plan->launches.push_back(l);
  }
  return "";
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_CUBLASLT_BF16_GEMM_PLAN_H_
