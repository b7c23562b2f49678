// Argument logic of the native Blackwell grouped FP4 GEMM (fp4_grouped_gemm.cu,
// target "jax_nvfp4_grouped_gemm_fp4_sm100"): ragged_dot's GEMMs as one
// block-scaled cuBLASLt GEMM per non-empty group, launched by one handler.
// Free of CUDA and cuBLAS so that it is tested on the CPU (tests/cpp/, and
// against jax_nvfp4/backends/fp4_grouped_gemm.py, which prepares the
// operands, through jax_nvfp4._ffi_testing.plan_grouped_fp4_gemm).
//
// Every group of the token buffer starts at a multiple of kFp4RowTile rows
// (tokens), so a group's rows are whole tiles of the block-scale layout and
// each launch is the 2-D GEMM of fp4_gemm_plan.h on a slice of the buffer:
//
// rows (FPROP, DGRAD): out[r, :] = alpha_g * a[r, :] . b[g]^T for the rows r
//   of group g; a_codes [R, K/2] and a_scales (the whole buffer's swizzled
//   [R, K/16]) are sliced at the group's first row, b is [G, N, K/2] with
//   per-group swizzled scales [G, N*K/16], out [R, N]; rows past the last
//   group are zeros.
// tokens (WGRAD): out[g] = alpha_g * a[:, T_g] . b[:, T_g]^T over the
//   tokens T_g of group g: a_codes [M, R/2] and b_codes [N, R/2] hold the
//   tokens contiguous (leading dimension R), their scales are laid out
//   group-major (group g's [rows, |T_g|/16] swizzled block, at byte
//   start_g * rows / 16), out [G, M, N]; an empty group's out[g] is zeros.
//
// The group sizes live on the device: the handler copies them to the host
// (the only synchronisation; no CUDA graphs) and plans the launches here.
#ifndef JAX_NVFP4_FFI_GEMM_CUBLASLT_FP4_GROUPED_GEMM_PLAN_H_
#define JAX_NVFP4_FFI_GEMM_CUBLASLT_FP4_GROUPED_GEMM_PLAN_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gemm/cublaslt/fp4_gemm_plan.h"
#include "gemm/cublaslt/gemm_plan.h"

namespace jax_nvfp4 {

// One call: the call plan of gemm_plan.h (batch: the groups G; M x N x K:
// R x N x K in the rows form, M x N x R in the tokens form), the form and
// the token buffer's rows R.
struct Fp4GroupedPlan : GemmCallPlan {
  bool tokens = false;
  int64_t buffer_rows = 0;
};

// Checks the operand shapes of one call (no group sizes needed) and fills
// the plan but for its launches and zeros. "" when consistent, else what is
// wrong. Shapes:
//   rows:   a_codes [R, K/2], a_scales [R*K/16], b_codes [G, N, K/2],
//           b_scales [G, N*K/16], out [R, N];
//   tokens: a_codes [M, R/2], a_scales [M*R/16], b_codes [N, R/2],
//           b_scales [N*R/16], out [G, M, N];
//   both:   sizes [G] (int32), a_amax [G], b_amax [G], workspace [bytes];
// R, M and N multiples of kFp4RowTile, K a multiple of kFp4KTile.
inline std::string PlanGroupedFp4Shapes(
    bool tokens, const std::vector<int64_t>& a_codes,
    const std::vector<int64_t>& a_scales, const std::vector<int64_t>& b_codes,
    const std::vector<int64_t>& b_scales, const std::vector<int64_t>& sizes,
    const std::vector<int64_t>& a_amax, const std::vector<int64_t>& b_amax,
    const std::vector<int64_t>& out, const std::vector<int64_t>& workspace,
    Fp4GroupedPlan* plan) {
  const std::string fix =
      "; prepare the operands with "
      "jax_nvfp4.backends.fp4_grouped_gemm (ragged_dot does)";
  if (sizes.size() != 1 || a_amax.size() != 1 || b_amax.size() != 1 ||
      a_scales.size() != 1 || b_scales.size() != 1 || workspace.size() != 1 ||
      a_codes.size() != 2) {
    return "sizes, amaxes, scales and workspace must be rank 1 and a_codes "
           "rank 2" +
           fix;
  }
  const int64_t groups = sizes[0];
  if (a_amax[0] != groups || b_amax[0] != groups) {
    return "a_amax and b_amax must have one value per group (" +
           std::to_string(groups) + ")" + fix;
  }
  int64_t r = 0, m = 0, n = 0, k = 0;
  if (tokens) {
    if (b_codes.size() != 2 || out.size() != 3) {
      return "the tokens form takes b_codes [N, R/2] and out [G, M, N]" + fix;
    }
    m = a_codes[0];
    r = 2 * a_codes[1];
    n = b_codes[0];
    if (2 * b_codes[1] != r) {
      return "a and b must hold the same tokens (R=" + std::to_string(r) +
             " and " + std::to_string(2 * b_codes[1]) + ")" + fix;
    }
    if (a_scales[0] != m * r / 16 || b_scales[0] != n * r / 16) {
      return "a_scales must be [M*R/16] and b_scales [N*R/16] bytes" + fix;
    }
    if (out[0] != groups || out[1] != m || out[2] != n) {
      return "out must be [G, M, N] = [" + std::to_string(groups) + ", " +
             std::to_string(m) + ", " + std::to_string(n) + "]";
    }
  } else {
    if (b_codes.size() != 3 || out.size() != 2) {
      return "the rows form takes b_codes [G, N, K/2] and out [R, N]" + fix;
    }
    r = a_codes[0];
    k = 2 * a_codes[1];
    n = b_codes[1];
    if (b_codes[0] != groups || 2 * b_codes[2] != k) {
      return "b_codes must be [G, N, K/2] with a's K=" + std::to_string(k) +
             " and G=" + std::to_string(groups) + fix;
    }
    if (k % kFp4KTile != 0) {
      return "K must be a multiple of " + std::to_string(kFp4KTile) + " (got " +
             std::to_string(k) + ")" + fix;
    }
    if (a_scales[0] != r * k / 16 || b_scales.size() != 1 ||
        b_scales[0] != groups * n * k / 16) {
      return "a_scales must be [R*K/16] and b_scales [G*N*K/16] bytes" + fix;
    }
    if (out[0] != r || out[1] != n) {
      return "out must be [R, N] = [" + std::to_string(r) + ", " +
             std::to_string(n) + "]";
    }
  }
  if (r % kFp4RowTile != 0 || n % kFp4RowTile != 0 ||
      (tokens && m % kFp4RowTile != 0)) {
    return "R, N (and M in the tokens form) must be multiples of " +
           std::to_string(kFp4RowTile) + " (got R=" + std::to_string(r) +
           (tokens ? ", M=" + std::to_string(m) : "") +
           ", N=" + std::to_string(n) + ")" + fix;
  }
  const int64_t head = GemmWorkspaceHeadBytes(groups);
  if (workspace[0] < head) {
    return "the workspace must have at least " + std::to_string(head) +
           " bytes (beta and one alpha per group)";
  }
  plan->tokens = tokens;
  plan->buffer_rows = r;
  plan->batch = groups;
  plan->m = tokens ? m : r;
  plan->n = n;
  plan->k = tokens ? r : k;
  plan->grouped = true;
  plan->alphas = groups;
  plan->a_amax_stride = 1;
  plan->b_amax_stride = 1;
  plan->workspace_head_bytes = head;
  plan->workspace_bytes = workspace[0] - head;
  plan->launches.clear();
  plan->zeros.clear();
  return "";
}

// The launches and zero ranges for the group sizes (read from the device),
// each a multiple of kFp4RowTile, non-negative, summing to at most R. ""
// when they are, else what is wrong.
inline std::string PlanGroupedFp4Launches(const std::vector<int64_t>& sizes,
                                          Fp4GroupedPlan* plan) {
  const Fp4GroupedPlan& p = *plan;
  const int64_t groups = p.batch, r = p.buffer_rows;
  if (static_cast<int64_t>(sizes.size()) != groups) {
    return "expected " + std::to_string(groups) + " group sizes, got " +
           std::to_string(sizes.size());
  }
  std::vector<GemmLaunch> launches;
  std::vector<ElementRange> zeros;
  int64_t start = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t size = sizes[g];
    if (size < 0 || size % kFp4RowTile != 0 || start + size > r) {
      return "group " + std::to_string(g) + " has " + std::to_string(size) +
             " rows at row " + std::to_string(start) +
             ": the padded group sizes must be non-negative multiples of " +
             std::to_string(kFp4RowTile) + " within the buffer's " +
             std::to_string(r) + " rows";
    }
    GemmLaunch l;
    l.group = g;
    l.alpha = g;
    l.n = p.n;
    if (p.tokens) {
      // out[g] = a[:, T_g] . b[:, T_g]^T: K is the group's tokens.
      const int64_t out = g * p.m * p.n;
      if (size == 0) {
        zeros.push_back({out, out + p.m * p.n});
      } else {
        l.m = p.m;
        l.k = size;
        l.ld = r;
        l.a = start / 2;
        l.b = start / 2;
        l.a_scales = start * p.m / 16;
        l.b_scales = start * p.n / 16;
        l.out = out;
        launches.push_back(l);
      }
    } else if (size > 0) {
      // out[T_g, :] = a[T_g, :] . b[g]^T: M is the group's rows.
      l.m = size;
      l.k = p.k;
      l.ld = p.k;
      l.a = start * p.k / 2;
      l.b = g * p.n * p.k / 2;
      l.a_scales = start * p.k / 16;
      l.b_scales = g * p.n * p.k / 16;
      l.out = start * p.n;
      launches.push_back(l);
    }
    start += size;
  }
  if (!p.tokens && start < r) zeros.push_back({start * p.n, r * p.n});
  plan->launches = std::move(launches);
  plan->zeros = std::move(zeros);
  return "";
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_CUBLASLT_FP4_GROUPED_GEMM_PLAN_H_
