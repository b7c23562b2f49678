// The grouped GEMM's tokens form (WGRAD) on the Hopper engine (sm_90a):
// out[g] [M, N] = alpha[g] * sum over group g's tokens t of a[t, m] b[t, n],
// with a [items, M, 16] and b [items, N, 16]: 16 tokens per item along the
// last axis (the column-wise operands the recipe's quantize writes), bf16,
// float32 sums, alpha and one rounding to the output type.
//
// An item is a K-major slab of 16-element (32-byte) rows, the layout wgmma
// reads with 32-byte swizzling, so one m64n256k16 step consumes one item.
// Groups start on item boundaries (the token buffer), so a tile's K loop
// runs over its own group's items only: a stage holds kItemsPerStage of
// them, loaded one TMA box per item; in a group's last stage the boxes past
// its items are read past the tensor's end, so they arrive as zeros and add
// nothing, and every stage runs the same unrolled wgmma steps. Tiles come from
// grouped_tiles.h (longest groups first); an empty group's tiles write zeros.
// The CTA's roles are those of grouped_rows.cuh, on the same ring
// (pipeline.cuh). Shapes as grouped_plan.h checks them: N even, any M (TMA
// fills rows past the ends with zeros; the epilogue stores inside them), at
// most kMaxGroups groups.
//
// A standalone prototype, checked by tools/engine_check.cu; not yet a
// handler of the extension.
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
  static constexpr int kBlockM = 128, kBlockN = 256, kItemsPerStage = 4;
  static constexpr int kStages = 4, kMaxGroups = 64, kThreads = 384;
  static constexpr int kItemA = kBlockM * kItemRows * 2;  // one item's box
  static constexpr int kItemB = kBlockN * kItemRows * 2;
  using Ring =
      engine::Ring<kStages, kItemsPerStage * kItemA, kItemsPerStage * kItemB>;
};
static_assert(GroupedTokensShape::Ring::kSharedBytes == kEngineSharedBytes &&
                  GroupedTokensShape::kMaxGroups == kEngineMaxGroups,
              "grouped_plan.h plans with these");

// a: map of [items, M, 16] (dims {16, M, items}, box {16, kBlockM, 1});
// b: map of [items, N, 16] (box {16, kBlockN, 1}); both bf16, 32-byte
// swizzle. items: the tensors' item count. out: [G, M, N].
template <typename Out>
__global__ void __launch_bounds__(GroupedTokensShape::kThreads, 1)
    GroupedTokensKernel(const __grid_constant__ CUtensorMap a,
                        const __grid_constant__ CUtensorMap b,
                        const int* group_sizes, const float* alpha, Out* out,
                        int groups, int items, int m, int n) {
  using S = GroupedTokensShape;
  extern __shared__ __align__(1024) uint8_t shared_raw[];
  S::Ring ring(shared_raw);
  __shared__ int sizes[S::kMaxGroups], item_begin[S::kMaxGroups],
      order[S::kMaxGroups];
  const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;
  const int m_tiles = CeilDiv(m, S::kBlockM), n_tiles = CeilDiv(n, S::kBlockN);
  const int total = groups * m_tiles * n_tiles;
  if (threadIdx.x == 0) {
    for (int g = 0; g < groups; ++g) sizes[g] = group_sizes[g];
    TokensTables(sizes, groups, item_begin, order);
    ring.Init();
  }
  __syncthreads();
  // Both roles walk the same tiles and count the same ring slots.
  if (warpgroup == 0) {
    if (thread != 0) return;
    int slot = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      const TokensTile tile =
          TokensTileAt(t, sizes, item_begin, order, S::kBlockM, S::kBlockN,
                       m_tiles, n_tiles);
      for (int item = tile.item_begin; item < tile.item_end;
           item += S::kItemsPerStage, ++slot) {
        const int s = ring.Fill(slot, S::Ring::kStageBytes);
        for (int j = 0; j < S::kItemsPerStage; ++j) {
          // Past the group's items: a box past the tensor's end, which
          // arrives as zeros (so every stage runs the same wgmma steps).
          const int source = item + j < tile.item_end ? item + j : items;
          TmaLoad3d(ring.TileA(s) + j * S::kItemA, &a, &ring.full[s], 0, tile.m,
                    source);
          TmaLoad3d(ring.TileB(s) + j * S::kItemB, &b, &ring.full[s], 0, tile.n,
                    source);
        }
      }
    }
    return;
  }
  const int half = warpgroup - 1;
  int slot = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const TokensTile tile = TokensTileAt(
        t, sizes, item_begin, order, S::kBlockM, S::kBlockN, m_tiles, n_tiles);
    float acc[S::kBlockN / 2];
#pragma unroll
    for (int i = 0; i < S::kBlockN / 2; ++i) acc[i] = 0.f;
    for (int item = tile.item_begin; item < tile.item_end;
         item += S::kItemsPerStage, ++slot) {
      const int s = ring.Take(slot);
      WgmmaFence();
#pragma unroll
      for (int j = 0; j < S::kItemsPerStage; ++j) {
        // This warpgroup's 64 rows of the item: 64 rows x 32 bytes further.
        WgmmaM64N256K16(
            acc,
            Swizzled32Operand(ring.TileA(s) + j * S::kItemA + half * 64 * 32),
            Swizzled32Operand(ring.TileB(s) + j * S::kItemB), 1);
      }
      WgmmaCommit();
      WgmmaWaitAll();
      if (thread == 0) ring.Release(s);
    }
    // An empty group's sums are zeros, written as zeros whatever its alpha.
    const float scale =
        tile.item_end > tile.item_begin ? alpha[tile.group] : 0.f;
    StoreTile(acc, scale, out + (int64_t{tile.group} * m + tile.m) * n, n,
              m - tile.m, tile.n, n, half, thread);
  }
}

}  // namespace engine
}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_ENGINE_GROUPED_TOKENS_CUH_
