// The grouped GEMM's rows form on the Hopper engine (sm_90a): out[r, n] =
// alpha[g] * sum_k a[r, k] b[g, n, k] for the token-buffer rows r of each
// group g, bf16 operands, float32 sums, alpha and one rounding to the output
// type.
//
// One CTA per SM (persistent), three warpgroups: the producer's first thread
// streams A and B tiles by TMA into a STAGES-deep ring of shared memory
// (full/empty mbarriers); two consumer warpgroups each own 64 of the tile's
// 128 rows and run wgmma m64n256k16 with their 128 accumulators in
// registers, then store the group's rows times its alpha. Tiles come from
// grouped_tiles.h, built by each CTA from the group sizes it reads on the
// device (no host sync). Shapes as grouped_plan.h checks them: K a
// multiple of 8 (TMA's 16-byte row pitch; its tail is zero-filled), N even,
// at most kMaxGroups groups. Group sizes past the buffer's `rows` read zeros
// and store nothing there.
#ifndef JAX_NVFP4_FFI_GEMM_ENGINE_GROUPED_ROWS_CUH_
#define JAX_NVFP4_FFI_GEMM_ENGINE_GROUPED_ROWS_CUH_

#include <cuda.h>

#include <cstdint>

#include "gemm/engine/grouped_plan.h"
#include "gemm/engine/grouped_tiles.h"
#include "gemm/engine/pipeline.cuh"
#include "gemm/engine/sm90.cuh"
#include "gemm/engine/wgmma.cuh"

namespace jax_nvfp4 {
namespace engine {

struct GroupedRowsShape {
  static constexpr int kBlockRows = 128, kBlockCols = 256, kBlockK = 64;
  static constexpr int kStages = 4, kMaxGroups = 64, kThreads = 384;
  using Ring =
      engine::Ring<kStages, kBlockRows * kBlockK * 2, kBlockCols * kBlockK * 2>;
};
static_assert(GroupedRowsShape::Ring::kSharedBytes == kEngineSharedBytes &&
                  GroupedRowsShape::kMaxGroups == kEngineMaxGroups,
              "grouped_plan.h plans with these");

// a: map of the token buffer [rows, K] (rows: its row count); b: map of the
// weights [G * N, K] (both bf16, K-major, boxes of kBlockK x kBlockRows /
// kBlockCols, 128-byte swizzle).
template <typename Out>
__global__ void __launch_bounds__(GroupedRowsShape::kThreads, 1)
    GroupedRowsKernel(const __grid_constant__ CUtensorMap a,
                      const __grid_constant__ CUtensorMap b,
                      const int* group_sizes, const float* alpha, Out* out,
                      int groups, int rows, int n, int k) {
#if JAX_NVFP4_ENGINE_ARCH
  using S = GroupedRowsShape;
  extern __shared__ __align__(1024) uint8_t shared_raw[];
  S::Ring ring(shared_raw);
  __shared__ int sizes[S::kMaxGroups], start[S::kMaxGroups],
      tile_end[S::kMaxGroups], total;
  const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;
  const int col_tiles = CeilDiv(n, S::kBlockCols);
  const int k_steps = CeilDiv(k, S::kBlockK);  // TMA zero-fills K's tail
  if (threadIdx.x == 0) {
    // Groups are plain runs of rows (granule 1), as the primitive's are.
    ClampedSizes(group_sizes, groups, rows, sizes, 1);
    total =
        RowsTiles(sizes, groups, S::kBlockRows, col_tiles, start, tile_end, 1);
    ring.Init();
  }
  __syncthreads();
  // Both roles walk the same tiles and count the same ring slots.
  if (warpgroup == 0) {
    if (thread != 0) return;
    int slot = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      const RowsTile tile = RowsTileAt(t, sizes, start, tile_end, groups,
                                       S::kBlockRows, S::kBlockCols, col_tiles);
      for (int i = 0; i < k_steps; ++i, ++slot) {
        const int s = ring.Fill(slot, S::Ring::kStageBytes);
        TmaLoad2d(ring.TileA(s), &a, &ring.full[s], i * S::kBlockK, tile.row);
        TmaLoad2d(ring.TileB(s), &b, &ring.full[s], i * S::kBlockK,
                  tile.group * n + tile.col);
      }
    }
    return;
  }
  const int half = warpgroup - 1;
  int slot = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const RowsTile tile = RowsTileAt(t, sizes, start, tile_end, groups,
                                     S::kBlockRows, S::kBlockCols, col_tiles);
    float acc[S::kBlockCols / 2];
#pragma unroll
    for (int i = 0; i < S::kBlockCols / 2; ++i) acc[i] = 0.f;
    int previous = -1;
    for (int i = 0; i < k_steps; ++i, ++slot) {
      const int s = ring.Take(slot);
      WgmmaFence();
      // This warpgroup's 64 rows: 64 rows x 128 bytes further.
      const uint8_t* tile_a = ring.TileA(s) + half * 64 * 128;
#pragma unroll
      for (int step = 0; step < S::kBlockK / 16; ++step) {
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
    // Only the group's rows, and only columns inside N (past it, B's rows
    // are the next group's).
    StoreTile(acc, alpha[tile.group], out + int64_t{tile.row} * n, n, tile.rows,
              tile.col, n, half, thread);
  }
#endif  // JAX_NVFP4_ENGINE_ARCH
}

}  // namespace engine
}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_ENGINE_GROUPED_ROWS_CUH_
