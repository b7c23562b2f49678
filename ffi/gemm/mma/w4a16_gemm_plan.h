// The launch plan of the weight-only NVFP4 GEMM (W4A16) handler
// (w4a16_gemm.cu, kernel in w4a16_kernel.cuh), free of CUDA so
// that the extension exposes it to Python (module.cc: plan_w4a16), which
// sizes the handler's workspace with it, and to CPU tests.
//
// The kernel's CTA computes 16 * m_tiles rows of x by 8 warps * 8 * tiles
// columns over `chunks` chunks of 128 elements of K. K is split into
// `slices` such ranges; with more than one, every CTA writes its float32
// partial sums to the workspace and the last CTA of each tile adds them.
//
// Workspace layout: one uint32 arrival count per (row tile, column tile),
// zeroed by the handler before the launch, then, 256-byte aligned, the
// partial sums float32 [slices, M, N] where slices > 1.
#ifndef JAX_NVFP4_FFI_GEMM_MMA_W4A16_GEMM_PLAN_H_
#define JAX_NVFP4_FFI_GEMM_MMA_W4A16_GEMM_PLAN_H_

#include <cstdint>
#include <string>

namespace jax_nvfp4 {

// The kernel configurations the handler instantiates.
struct W4A16Config {
  int m_tiles;  // 16-row tiles of x per CTA
  int tiles;    // 8-column tiles of w per warp
  int depth;    // 128-element chunks of w in flight per warp
  int chunks;   // chunks of K per CTA (one slice)
};

struct W4A16Plan {
  W4A16Config config{};
  int64_t row_tiles = 0;     // grid.z
  int64_t slices = 0;        // grid.y
  int64_t column_tiles = 0;  // grid.x
  int64_t arrivals_bytes = 0;
  int64_t partial_offset = 0;  // bytes from the workspace's start
  int64_t workspace_bytes = 0;
};

inline constexpr int kW4A16Warps = 8;
inline constexpr int kW4A16MaxGrid = 65535;  // grid.y and grid.z

// Rows of x decide the configuration: the weight is read once per row tile,
// so taller tiles win as M grows; at one tile (M <= 16) long slices keep
// more of the weight in flight per CTA. A slice's x fragments sit in shared
// memory (16 * m_tiles rows by 128 * chunks elements), which bounds chunks.
// Each configuration's x slice is 64 KB of shared memory, which every GPU of
// compute capability >= 8.0 grants a block (sm_86 and sm_89: 99 KB). The
// partial sums, [slices, M, N] float32, take K * N * M / (128 * chunks * 8)
// bytes: at most 0.9x the FP4 weight's bytes up to M = 64. The handler serves
// few rows (the dispatcher sends M > 64 elsewhere); called with more, the
// partial sums grow with M.
inline W4A16Config ChooseW4A16Config(int64_t m) {
  if (m <= 16) return {1, 2, 3, 16};
  if (m <= 32) return {2, 2, 2, 8};
  return {4, 2, 2, 4};
}

// Empty on success; otherwise what the caller must change.
inline std::string PlanW4A16(int64_t m, int64_t n, int64_t k, W4A16Plan* p) {
  if (m < 0 || n < 0 || k < 0) return "negative dimensions";
  if (k % 128 != 0 || n % 2 != 0) {
    return "matmul_w4a16 needs K a multiple of 128 and N even, got K = " +
           std::to_string(k) + ", N = " + std::to_string(n) +
           " (jax_nvfp4 runs the decoding GEMM otherwise)";
  }
  const W4A16Config c = ChooseW4A16Config(m);
  p->config = c;
  const int64_t rows = 16 * c.m_tiles;
  const int64_t columns = kW4A16Warps * 8 * c.tiles;
  const int64_t slice = 128 * static_cast<int64_t>(c.chunks);
  p->row_tiles = (m + rows - 1) / rows;
  p->column_tiles = (n + columns - 1) / columns;
  p->slices = k == 0 ? 1 : (k + slice - 1) / slice;
  if (p->row_tiles > kW4A16MaxGrid || p->slices > kW4A16MaxGrid) {
    return "matmul_w4a16: at most " + std::to_string(kW4A16MaxGrid * rows) +
           " rows of x and K at most " + std::to_string(kW4A16MaxGrid * slice) +
           " per call";
  }
  p->arrivals_bytes =
      static_cast<int64_t>(sizeof(uint32_t)) * p->row_tiles * p->column_tiles;
  p->partial_offset = (p->arrivals_bytes + 255) / 256 * 256;
  const int64_t partial =
      p->slices > 1 ? static_cast<int64_t>(sizeof(float)) * p->slices * m * n
                    : 0;
  p->workspace_bytes = p->partial_offset + partial;
  return "";
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_MMA_W4A16_GEMM_PLAN_H_
