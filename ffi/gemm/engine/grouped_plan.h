// The launch plans of the Hopper engine's grouped GEMM forms
// (grouped_rows.cuh, grouped_tokens.cuh), free of CUDA so that CPU tests
// check them: which shapes the kernels serve, and the persistent grid. The
// shared-memory sizes and the at most kEngineMaxGroups groups are the
// kernels' (the CTA keeps the groups' tables in shared memory).
#ifndef JAX_NVFP4_FFI_GEMM_ENGINE_GROUPED_PLAN_H_
#define JAX_NVFP4_FFI_GEMM_ENGINE_GROUPED_PLAN_H_

#include <algorithm>
#include <cstdint>
#include <string>

namespace jax_nvfp4 {
namespace engine {

inline constexpr int kEngineMaxGroups = 64;
inline constexpr int kEngineBlockRows = 128, kEngineBlockCols = 256;
inline constexpr int kEngineSharedBytes = 4 * (128 + 256) * 64 * 2 + 64 + 1024;

struct GroupedPlan {
  int64_t grid = 0;          // CTAs: persistent, at most one per SM
  int64_t tiles_bound = 0;   // the most tiles any group sizes can give
  int64_t shared_bytes = 0;  // dynamic shared memory per CTA
};

inline int64_t CeilDiv64(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline std::string CheckGroups(int64_t groups, const char* form) {
  if (groups < 1 || groups > kEngineMaxGroups) {
    return std::string("grouped GEMM engine (") + form + "): 1 to " +
           std::to_string(kEngineMaxGroups) + " groups, got " +
           std::to_string(groups);
  }
  return "";
}

// Rows form: a [rows, k] by b [groups, n, k] -> [rows, n]. Empty on
// success; otherwise what the caller must change. The kernels index rows,
// columns and TMA coordinates with 32-bit integers.
inline std::string PlanGroupedRows(int64_t rows, int64_t k, int64_t groups,
                                   int64_t n, int sms, GroupedPlan* p) {
  std::string error = CheckGroups(groups, "rows");
  if (!error.empty()) return error;
  if (rows < 0 || k <= 0 || n <= 0) return "grouped GEMM engine: empty shape";
  if (k % 8 != 0 || n % 2 != 0) {
    return "grouped GEMM engine (rows): K a multiple of 8 (TMA's 16-byte "
           "row pitch) and N even, got K = " +
           std::to_string(k) + ", N = " + std::to_string(n);
  }
  if (rows >= (int64_t{1} << 31) || groups * n >= (int64_t{1} << 31)) {
    return "grouped GEMM engine (rows): fewer than 2^31 rows and G * N "
           "weight rows";
  }
  // Each group's row blocks: at most rows / 128 + one partial per group.
  p->tiles_bound = (CeilDiv64(rows, kEngineBlockRows) + groups) *
                   CeilDiv64(n, kEngineBlockCols);
  p->grid = std::max<int64_t>(1, std::min<int64_t>(sms, p->tiles_bound));
  p->shared_bytes = kEngineSharedBytes;
  return "";
}

// Tokens form: a [lines, m, 64] by b [lines, n, 64] (64 tokens per line)
// -> [groups, m, n].
inline std::string PlanGroupedTokens(int64_t lines, int64_t m, int64_t n,
                                     int64_t groups, int sms, GroupedPlan* p) {
  std::string error = CheckGroups(groups, "tokens");
  if (!error.empty()) return error;
  if (lines < 0 || m <= 0 || n <= 0) return "grouped GEMM engine: empty shape";
  if (lines * 64 >= (int64_t{1} << 31) || m >= (int64_t{1} << 31) ||
      n >= (int64_t{1} << 31)) {
    return "grouped GEMM engine (tokens): fewer than 2^31 tokens, M and N";
  }
  if (n % 2 != 0) {
    return "grouped GEMM engine (tokens): N even, got N = " + std::to_string(n);
  }
  p->tiles_bound =
      groups * CeilDiv64(m, kEngineBlockRows) * CeilDiv64(n, kEngineBlockCols);
  p->grid = std::max<int64_t>(1, std::min<int64_t>(sms, p->tiles_bound));
  p->shared_bytes = kEngineSharedBytes;
  return "";
}

}  // namespace engine
}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_ENGINE_GROUPED_PLAN_H_
