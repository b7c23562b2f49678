// The grouped GEMM's tokens form (WGRAD) on the Hopper engine (sm_90a):
// out[g] [M, N] = alpha[g] * sum over group g's tokens t of a[t, m] b[t, n],
// bf16 operands, float32 sums, alpha and one rounding to the output type.
//
// The operands come as lines of 64 tokens, a [lines, M, 64] and b [lines,
// N, 64], each group starting on a line (zeros past its tokens). The
// recipe's column-wise operands are [items, F, 16] (32-byte rows), which
// the copy engine moves too slowly to feed the tensor cores (DESIGN.md
// 5.2); so the caller regroups them, four items to a 128-byte
// row, each group from a new line (backends/bf16_grouped_gemm.py), and the
// kernel streams lines exactly like the rows form's K blocks (128-byte
// swizzle, one line per stage, four k16 steps). A line holds one group's
// tokens only, so another group's values (a NaN) never reach its sums, and
// every stage runs the same wgmma steps (no branch around them: a wgmma in
// a divergent path is serialized). Tiles come from grouped_tiles.h (longest
// groups first); an empty group's tiles write zeros. The CTA's roles are
// those of grouped_rows.cuh, on the same ring (pipeline.cuh). Shapes as
// grouped_plan.h checks them: N even, any M (TMA fills rows past the ends
// with zeros; the epilogue stores inside them), at most kMaxGroups groups;
// group sizes past the lines read nothing.
#ifndef JAX_NVFP4_FFI_GEMM_ENGINE_GROUPED_TOKENS_CUH_
#define JAX_NVFP4_FFI_GEMM_ENGINE_GROUPED_TOKENS_CUH_

#include <cuda.h>

#include <cstdint>

#include "gemm/engine/grouped_plan.h"
#include "gemm/engine/grouped_tiles.h"
#include "gemm/engine/pipeline.cuh"
#include "gemm/engine/sm90.cuh"
#include "gemm/engine/wgmma.cuh"

namespace jax_nvfp4 {
namespace engine {

struct GroupedTokensShape {
  static constexpr int kBlockM = 128, kBlockN = 256, kLineTokens = 64;
  static constexpr int kStages = 4, kMaxGroups = 64, kThreads = 384;
  using Ring = engine::Ring<kStages, kBlockM * kLineTokens * 2,
                            kBlockN * kLineTokens * 2>;
};
static_assert(GroupedTokensShape::Ring::kSharedBytes == kEngineSharedBytes &&
                  GroupedTokensShape::kMaxGroups == kEngineMaxGroups,
              "grouped_plan.h plans with these");

// a: map of [lines, M, 64] (dims {64, M, lines}, box {64, kBlockM, 1});
// b: map of [lines, N, 64] (box {64, kBlockN, 1}); both bf16, 128-byte
// swizzle. lines: the operands' line count; group_sizes in tokens (each
// group from a new line). out: [G, M, N].
template <typename Out>
__global__ void __launch_bounds__(GroupedTokensShape::kThreads, 1)
    GroupedTokensKernel(const __grid_constant__ CUtensorMap a,
                        const __grid_constant__ CUtensorMap b,
                        const int* group_sizes, const float* alpha, Out* out,
                        int groups, int lines, int m, int n) {
#if JAX_NVFP4_ENGINE_ARCH
  using S = GroupedTokensShape;
  extern __shared__ __align__(1024) uint8_t shared_raw[];
  S::Ring ring(shared_raw);
  __shared__ int sizes[S::kMaxGroups], line_begin[S::kMaxGroups],
      order[S::kMaxGroups];
  const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;
  const int m_tiles = CeilDiv(m, S::kBlockM), n_tiles = CeilDiv(n, S::kBlockN);
  const int total = groups * m_tiles * n_tiles;
  if (threadIdx.x == 0) {
    ClampedSizes(group_sizes, groups, lines * S::kLineTokens, sizes,
                 S::kLineTokens);
    TokensTables(sizes, groups, line_begin, order, S::kLineTokens);
    ring.Init();
  }
  __syncthreads();
  // Both roles walk the same tiles and count the same ring slots, one per
  // line of the tile's group.
  if (warpgroup == 0) {
    if (thread != 0) return;
    int slot = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      const TokensTile tile =
          TokensTileAt(t, sizes, line_begin, order, S::kBlockM, S::kBlockN,
                       m_tiles, n_tiles, S::kLineTokens);
      for (int line = tile.item_begin; line < tile.item_end; ++line, ++slot) {
        const int s = ring.Fill(slot, S::Ring::kStageBytes);
        TmaLoad3d(ring.TileA(s), &a, &ring.full[s], 0, tile.m, line);
        TmaLoad3d(ring.TileB(s), &b, &ring.full[s], 0, tile.n, line);
      }
    }
    return;
  }
  const int half = warpgroup - 1;
  int slot = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const TokensTile tile =
        TokensTileAt(t, sizes, line_begin, order, S::kBlockM, S::kBlockN,
                     m_tiles, n_tiles, S::kLineTokens);
    float acc[S::kBlockN / 2];
#pragma unroll
    for (int i = 0; i < S::kBlockN / 2; ++i) acc[i] = 0.f;
    int previous = -1;
    for (int line = tile.item_begin; line < tile.item_end; ++line, ++slot) {
      const int s = ring.Take(slot);
      // This warpgroup's 64 rows: 64 rows x 128 bytes further.
      const uint8_t* tile_a = ring.TileA(s) + half * 64 * 128;
      WgmmaFence();
#pragma unroll
      for (int step = 0; step < S::kLineTokens / 16; ++step) {
        WgmmaM64N256K16(acc, SwizzledOperand(tile_a + step * 32),
                        SwizzledOperand(ring.TileB(s) + step * 32), 1);
      }
      WgmmaCommit();
      // The previous stage's wgmma are done: its slot goes back to the
      // producer while this stage's run.
      WgmmaWait<1>();
      if (thread == 0 && previous >= 0) ring.Release(previous);
      previous = s;
    }
    WgmmaWait<0>();
    if (thread == 0 && previous >= 0) ring.Release(previous);
    // An empty group's sums are zeros, written as zeros whatever its alpha.
    const float scale =
        tile.item_end > tile.item_begin ? alpha[tile.group] : 0.f;
    StoreTile(acc, scale, out + (int64_t{tile.group} * m + tile.m) * n, n,
              m - tile.m, tile.n, n, half, thread);
  }
#endif  // JAX_NVFP4_ENGINE_ARCH
}

}  // namespace engine
}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_ENGINE_GROUPED_TOKENS_CUH_
