// The W4A16 GEMM on the Hopper engine (sm_90a): bf16 activations times an
// NVFP4 weight decoded in registers,
//
//   out[m, n] = (amax / 2688) * sum_k x[m, k] * e2m1(w[n, k]) * s[n, k / 16]
//
// x bf16 [M, K]; the weight as quantized along K: codes uint8 [N, K / 2]
// (element 2i in the low nibble of byte i), E4M3 scales [N, K / 16].
//
// The weight is wgmma's A operand, from registers, and x is its B operand,
// from shared memory: D^T[n, m] = W[n, :] . x[m, :], so that a few tokens
// fill an n16 tile while the weight's rows fill wgmma's 64-row side. Per
// CTA (w4a16_plan.h): a producer warp streams x's tile, the codes' tile and,
// on each 256-element block's first stage, the scales' tile by TMA into a
// ring of stages; two consumer warpgroups each own 64 weight rows. A
// consumer thread reads its rows' codes from shared memory (16 bytes, two
// k16 steps, per row), picks its bytes of each step with byte permutes,
// decodes them to bf16 e2m1 * scale (exact: at most 6 significant bits) in
// the register layout wgmma's A takes, and issues one wgmma per k16 step.
// Fragments are double-buffered: a 64-element step's are decoded while the
// previous step's wgmma still read theirs. Products are exact, sums
// float32.
//
// Up to 16 tokens the contraction runs in a permuted order, so that a
// thread's weight bytes are contiguous: of each 64 elements of K, thread t
// of a quad takes elements 16t .. 16t + 15 of its rows (8 bytes, one block
// scale), which wgmma sees as columns 2t + 8h + e of k16 step j for element
// 16t + 4j + 2h + e. The producer warp writes x's tile in that order with
// 4-byte asynchronous copies (TMA copies boxes as they are); per row, one
// load, one scale and two decodes of 8 elements serve four k16 steps, where
// the natural order needs byte picks and a scale per step.
//
// The epilogue stages the 128 x tokens float32 tile in shared memory
// transposed (so that stores run along n). With K split, the slices of a
// tile are one cluster: after a cluster barrier each CTA adds a part of the
// tile from every slice's shared memory in slice order, so the sums do not
// depend on timing. Alpha after the sums, one rounding to the output type.
#ifndef JAX_NVFP4_FFI_GEMM_ENGINE_W4A16_CUH_
#define JAX_NVFP4_FFI_GEMM_ENGINE_W4A16_CUH_

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/decode.cuh"
#include "gemm/engine/pipeline.cuh"
#include "gemm/engine/sm90.cuh"
#include "gemm/engine/tensor_map.h"
#include "gemm/engine/w4a16_plan.h"
#include "gemm/engine/wgmma.cuh"
#include "numerics/nvfp4.h"

namespace jax_nvfp4 {
namespace engine {

template <int kTokens, int kBlockK>
struct W4A16Shape {
  static constexpr int kRows = kW4A16WeightRows;
  static constexpr int kCodePitch = kBlockK / 2;  // bytes of a row's codes
  static constexpr int kCodeBytes = kRows * kCodePitch;
  static constexpr int kScaleBytes = kRows * kW4A16ScaleK / 16;  // 16-byte
  static constexpr int kXBox = kTokens * 64 * 2;  // 64 elements of K
  static constexpr int kXBytes = kXBox * (kBlockK / 64);
  // Stages per 256-element block of scales; 64-element steps per stage.
  static constexpr int kStagesPerBlock = kW4A16ScaleK / kBlockK;
  static constexpr int kSteps = kBlockK / 64;
  // The transposed float32 tile of the epilogue: a row of 128 weight rows
  // per token, padded so that a warp's stores hit 32 banks.
  static constexpr int kTilePitch = kRows + 4;
  // x's tile in the permuted contraction order (see the file's comment).
  static constexpr bool kPermutedX = kTokens == 16;
  static_assert(kBlockK == 64 || kBlockK == 256, "stages of 64 or 256");
};

// wgmma m64n{kTokens}k16 with A from registers.
template <int kTokens>
__device__ __forceinline__ void WgmmaRegisterA(float (&d)[kTokens / 2],
                                               const uint32_t (&a)[4],
                                               uint64_t desc_b) {
  if constexpr (kTokens == 16) WgmmaM64N16K16RegisterA(d, a, desc_b, 1);
  if constexpr (kTokens == 32) WgmmaM64N32K16RegisterA(d, a, desc_b, 1);
  if constexpr (kTokens == 64) WgmmaM64N64K16RegisterA(d, a, desc_b, 1);
  if constexpr (kTokens == 128) WgmmaM64N128K16RegisterA(d, a, desc_b, 1);
}

// Byte offset `offset` of a tile of kPitch-byte rows (32, 64 or 128) that
// TMA wrote with the swizzle of that width: the 16-byte pieces of a row
// trade places by the row's index within 1024 bytes.
template <int kPitch>
__device__ __forceinline__ int Swizzled(int offset) {
  return offset ^ (((offset >> 7) & (kPitch / 16 - 1)) << 4);
}

template <int kPitch>
constexpr CUtensorMapSwizzle SwizzleOf() {
  return kPitch == 32   ? CU_TENSOR_MAP_SWIZZLE_32B
         : kPitch == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                        : CU_TENSOR_MAP_SWIZZLE_128B;
}

// x_map: x bf16 [M, K] in boxes of 64 x kTokens, 128-byte swizzle (x
// itself when the tile is permuted);
// codes_map: uint8 [N, K / 2] in boxes of kBlockK / 2 x 128, swizzled by
// that width; scales_map: uint8 [N, K / 16] in boxes of 16 x 128. grid
// (token tiles, weight tiles, splits), the splits one cluster
// (w4a16_plan.h). groups > 0: the grouped form, x's rows in groups of
// group_sizes, group g's times weight g (codes and scales maps over all G
// weights' rows, amax [G]); each CTA finds its group's token tile
// (W4A16GroupTile), and those past the last tile return at once (a
// cluster's CTAs share blockIdx.x, so they return together).
template <int kTokens, int kBlockK, int kStages, int kBlocksPerSm, typename Out>
__global__ void __launch_bounds__(kW4A16Threads, kBlocksPerSm)
    W4A16Kernel(const __grid_constant__ CUtensorMap x_map,
                const __grid_constant__ CUtensorMap codes_map,
                const __grid_constant__ CUtensorMap scales_map,
                const __nv_bfloat16* x, const float* amax, Out* out, int m,
                int n, int k, const int32_t* group_sizes, int groups) {
#if JAX_NVFP4_ENGINE_ARCH
  using S = W4A16Shape<kTokens, kBlockK>;
  using Ring =
      engine::Ring<kStages, S::kXBytes, S::kCodeBytes + S::kScaleBytes>;
  static_assert(kTokens * S::kTilePitch * 4 <= kStages * Ring::kStageBytes,
                "the epilogue's tile fits in the ring");
  // x's rows token0 .. min(token0 + kTokens, end) - 1 times weight `group`.
  int group = 0;
  int64_t first_row = int64_t{blockIdx.x} * kTokens, end = m;
  if (groups > 0 && !W4A16GroupTile(group_sizes, groups, m, blockIdx.x, kTokens,
                                    &group, &first_row, &end)) {
    return;
  }
  const int token0 = static_cast<int>(first_row);
  const int row0 = blockIdx.y * S::kRows;
  const int weight_row0 = group * n + row0;  // in all weights' rows
  extern __shared__ __align__(1024) uint8_t shared_raw[];
  Ring ring(shared_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int block_begin, block_end;
  W4A16SliceBlocks(k, blockIdx.z, gridDim.z, &block_begin, &block_end);
  if (threadIdx.x == 0) ring.Init();
  if constexpr (S::kPermutedX) {
    // Rows past the group's (or M) are never copied: zeros, so that their
    // (unstored) sums read defined values.
    if (token0 + kTokens > end) {
      uint4* tiles = reinterpret_cast<uint4*>(ring.TileA(0));
      for (int i = threadIdx.x; i < kStages * S::kXBytes / 16;
           i += kW4A16Threads) {
        tiles[i] = make_uint4(0, 0, 0, 0);
      }
    }
  }
  __syncthreads();

  float acc[kTokens / 2];
#pragma unroll
  for (int i = 0; i < kTokens / 2; ++i) acc[i] = 0.f;
  if (warp == 8 && S::kPermutedX) {  // the producer, x by its 32 lanes
    const int rows = min(kTokens, static_cast<int>(end - token0));
    int slot = 0;
    for (int b = block_begin; b < block_end; ++b) {
      for (int q = 0; q < S::kStagesPerBlock; ++q, ++slot) {
        const int k0 = b * kW4A16ScaleK + q * kBlockK;
        const int s = ring.WaitFree(slot);
        // The weight's tiles first (HBM's latency is the longer); the
        // barrier's one arrival comes after the lanes' copies joined it.
        if (lane == 0) {
          BarrierExpectTx(&ring.full[s],
                          S::kCodeBytes + (q == 0 ? S::kScaleBytes : 0));
          TmaLoad2d(ring.TileB(s), &codes_map, &ring.full[s], k0 / 2,
                    weight_row0);
          if (q == 0) {
            TmaLoad2d(ring.TileB(s) + S::kCodeBytes, &scales_map, &ring.full[s],
                      b * kW4A16ScaleK / 16, weight_row0);
          }
        }
        const uint32_t tile = SmemAddress(ring.TileA(s));
        // Lane p copies 4-byte piece p of every row's 64-element groups
        // into the column wgmma reads it from (w4a16_plan.h).
        const int column = W4A16PermutedColumn(lane);
        const __nv_bfloat16* source = x + int64_t{token0} * k + k0 + 2 * lane;
        for (int row = 0; row < rows; ++row, source += k) {
          const uint32_t destination = tile + row * 128 +
                                       ((column / 4) ^ (row & 7)) * 16 +
                                       column % 4 * 4;
#pragma unroll
          for (int g = 0; g < kBlockK / 64; ++g) {
            CopyAsync4(destination + g * S::kXBox, source + g * 64);
          }
        }
        CopyAsyncArrive(&ring.full[s]);
        __syncwarp();
        if (lane == 0) BarrierArrive(&ring.full[s]);
      }
    }
  } else if (warp == 8) {  // the producer
    if (lane == 0) {
      int slot = 0;
      for (int b = block_begin; b < block_end; ++b) {
        for (int q = 0; q < S::kStagesPerBlock; ++q, ++slot) {
          const int k0 = b * kW4A16ScaleK + q * kBlockK;
          const int s = ring.Fill(
              slot, S::kXBytes + S::kCodeBytes + (q == 0 ? S::kScaleBytes : 0));
          for (int u = 0; u < S::kSteps; ++u) {
            TmaLoad2d(ring.TileA(s) + u * S::kXBox, &x_map, &ring.full[s],
                      k0 + u * 64, token0);
          }
          TmaLoad2d(ring.TileB(s), &codes_map, &ring.full[s], k0 / 2,
                    weight_row0);
          if (q == 0) {
            TmaLoad2d(ring.TileB(s) + S::kCodeBytes, &scales_map, &ring.full[s],
                      b * kW4A16ScaleK / 16, weight_row0);
          }
        }
      }
    }
  } else {
    // Consumer warpgroup `half`: weight rows half * 64 .. + 63; this
    // thread's rows r and r + 8 (wgmma's A layout), k16 columns 2t, 2t + 1,
    // 2t + 8, 2t + 9.
    const int half = warp / 4, t = lane % 4;
    const int r = half * 64 + (warp % 4) * 16 + lane / 4;
    const uint32_t pick = t | (t + 4) << 4;  // byte t of two words
    // Row r's codes start r * kCodePitch bytes into a stage's tile; the
    // swizzle moves its 16-byte pieces by the same key for rows r and r + 8.
    const int row_offset = r * S::kCodePitch;
    const int swizzle_key = Swizzled<S::kCodePitch>(row_offset) - row_offset;
    uint32_t fragments[2][4][4];
    uint4 scales_r = {}, scales_r8 = {};  // a block's 16 scales, per row
    int slot = 0, stage = 0, previous = -1;
    // Step q (0..3) of a 256-element block: four k16 steps, 64 elements,
    // step u of its stage. Fragments alternate between two sets, so that
    // a step's are decoded while the previous step's wgmma read theirs.
    const auto step = [&](auto q_constant, uint32_t (&f)[4][4]) {
      constexpr int q = decltype(q_constant)::value;
      constexpr int u = q % S::kSteps;
      if constexpr (u == 0) {
        stage = ring.Take(slot);
        if constexpr (S::kPermutedX) FenceProxyAsync();  // x's tile by threads
        if constexpr (q == 0) {
          const uint32_t scales =
              SmemAddress(ring.TileB(stage)) + S::kCodeBytes;
          scales_r = LoadShared16(scales + r * 16);
          scales_r8 = LoadShared16(scales + (r + 8) * 16);
        }
      }
      const uint32_t codes = SmemAddress(ring.TileB(stage));
      // k16 step j's scale is byte j of word q.
      const uint32_t scale_words[2] = {q == 0   ? scales_r.x
                                       : q == 1 ? scales_r.y
                                       : q == 2 ? scales_r.z
                                                : scales_r.w,
                                       q == 0   ? scales_r8.x
                                       : q == 1 ? scales_r8.y
                                       : q == 2 ? scales_r8.z
                                                : scales_r8.w};
      if constexpr (S::kPermutedX) {
        // Elements 16t .. 16t + 15 of the group: 8 bytes of row r and of
        // row r + 8, one block scale each; byte 2j + h is k16 step j's
        // columns 2t + 8h, 2t + 8h + 1.
        const uint32_t address =
            codes + row_offset + ((u * 32 + 8 * t) ^ swizzle_key);
        const uint2 row = LoadShared8(address);
        const uint2 row8 = LoadShared8(address + 8 * S::kCodePitch);
        uint32_t scale_r, scale_r8;
        ScalePairsBf16(__byte_perm(scale_words[0], scale_words[1], pick),
                       scale_r, scale_r8);
        const uint4 low = DecodeCodes8Bf16(row.x, scale_r);
        const uint4 high = DecodeCodes8Bf16(row.y, scale_r);
        const uint4 low8 = DecodeCodes8Bf16(row8.x, scale_r8);
        const uint4 high8 = DecodeCodes8Bf16(row8.y, scale_r8);
        const uint4 r_words[2] = {low, high}, r8_words[2] = {low8, high8};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint4& a = r_words[j / 2];
          const uint4& a8 = r8_words[j / 2];
          f[j][0] = j % 2 ? a.z : a.x;    // row r, columns 2t, 2t + 1
          f[j][1] = j % 2 ? a8.z : a8.x;  // row r + 8
          f[j][2] = j % 2 ? a.w : a.y;    // row r, columns 2t + 8, 2t + 9
          f[j][3] = j % 2 ? a8.w : a8.y;  // row r + 8
        }
      } else {
#pragma unroll
        for (int c = 0; c < 2;
             ++c) {  // 16 bytes of a row: k16 steps 2c, 2c + 1
          const int piece = (2 * u + c) * 16;
          const uint32_t address = codes + row_offset + (piece ^ swizzle_key);
          const uint4 row = LoadShared16(address);
          const uint4 row8 = LoadShared16(address + 8 * S::kCodePitch);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int j = 2 * c + h;
            // Bytes t and t + 4 of the k16 step's 8 (columns 2t, 2t + 1 and
            // 2t + 8, 2t + 9) of row r, then of row r + 8.
            const uint32_t codes_r =
                __byte_perm(h ? row.z : row.x, h ? row.w : row.y, pick);
            const uint32_t codes_r8 =
                __byte_perm(h ? row8.z : row8.x, h ? row8.w : row8.y, pick);
            uint32_t scale_r, scale_r8;
            ScalePairsBf16(
                __byte_perm(scale_words[0], scale_words[1], j | (j + 4) << 4),
                scale_r, scale_r8);
            const uint4 v = DecodeCodes8Bf16(
                __byte_perm(codes_r, codes_r8, 0x5410), scale_r, scale_r8);
            f[j][0] = v.x;  // row r, columns 2t, 2t + 1
            f[j][1] = v.z;  // row r + 8
            f[j][2] = v.y;  // row r, columns 2t + 8, 2t + 9
            f[j][3] = v.w;  // row r + 8
          }
        }
      }
      WgmmaFence();
      // k16 step j of x's tile is 32 bytes further: 2 in the descriptor's
      // address field (16-byte units).
      const uint64_t x_tile = SwizzledOperand(ring.TileA(stage) + u * S::kXBox);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        WgmmaRegisterA<kTokens>(acc, f[j], x_tile + 2 * j);
      }
      WgmmaCommit();
      // The previous step's wgmma are done: its fragments are free for the
      // next step and, at a stage's first step, the previous stage's slot
      // goes back to the producer.
      WgmmaWait<1>();
      if constexpr (u == 0) {
        if (threadIdx.x % 128 == 0 && previous >= 0) ring.Release(previous);
        previous = stage;
        ++slot;
      }
    };
    for (int b = block_begin; b < block_end; ++b) {
      step(std::integral_constant<int, 0>{}, fragments[0]);
      step(std::integral_constant<int, 1>{}, fragments[1]);
      step(std::integral_constant<int, 2>{}, fragments[0]);
      step(std::integral_constant<int, 3>{}, fragments[1]);
    }
    WgmmaWait<0>();
  }
  // Every stage was consumed, so no copy still writes the ring: the tile
  // takes its place.
  __syncthreads();
  float* tile = reinterpret_cast<float*>(ring.TileA(0));
  if (warp < 8) {
    const int half = warp / 4, t = lane % 4;
    const int r = half * 64 + (warp % 4) * 16 + lane / 4;
#pragma unroll
    for (int i = 0; i < kTokens / 2; ++i) {
      const int token = (i / 4) * 8 + 2 * t + i % 2;
      tile[token * S::kTilePitch + r + 8 * ((i / 2) % 2)] = acc[i];
    }
  }
  const int splits = gridDim.z;
  if (splits > 1) {
    ClusterSync();
  } else {
    __syncthreads();
  }
  // This CTA's share of the tile's 4-row groups, summed over the slices.
  constexpr int kGroups = kTokens * S::kRows / 4;
  const int first = kGroups * blockIdx.z / splits;
  const int last = kGroups * (blockIdx.z + 1) / splits;
  // IEEE division (no fast-math).
  const float alpha = amax[group] / kScaleRange;
  for (int e = first + threadIdx.x; e < last; e += kW4A16Threads) {
    const int token = e / (S::kRows / 4), col = (e % (S::kRows / 4)) * 4;
    const float* local = tile + token * S::kTilePitch + col;
    float4 sum = splits > 1 ? ClusterLoad(SmemAddress(local), 0)
                            : *reinterpret_cast<const float4*>(local);
    for (int z = 1; z < splits; ++z) {
      const float4 p = ClusterLoad(SmemAddress(local), z);
      sum.x += p.x, sum.y += p.y, sum.z += p.z, sum.w += p.w;
    }
    sum.x *= alpha, sum.y *= alpha, sum.z *= alpha, sum.w *= alpha;
    const int64_t row = int64_t{token0} + token, column = int64_t{row0} + col;
    if (row >= end || column >= n) continue;
    Out* dst = out + row * n + column;
    if (n % 4 == 0) {  // the row's 4 outputs are inside N, aligned
      StoreQuad(dst, sum);
    } else {
      const float v[4] = {sum.x, sum.y, sum.z, sum.w};
      for (int c = 0; c < 4 && column + c < n; ++c) StoreOne(dst + c, v[c]);
    }
  }
  // No CTA leaves while the others may still read its tile.
  if (splits > 1) ClusterSync();
#endif  // JAX_NVFP4_ENGINE_ARCH
}

// The three tensor maps of a call. False if the driver rejects one.
inline bool W4A16Maps(const void* x, const void* codes, const void* scales,
                      int64_t m, int64_t n, int64_t k,
                      const W4A16Config& config, CUtensorMap* x_map,
                      CUtensorMap* codes_map, CUtensorMap* scales_map) {
  const uint64_t x_dims[] = {uint64_t(k), uint64_t(m)};
  const uint32_t x_box[] = {64, uint32_t(config.tokens)};
  const uint64_t code_dims[] = {uint64_t(k / 2), uint64_t(n)};
  const uint32_t code_box[] = {uint32_t(config.block_k / 2), kW4A16WeightRows};
  const CUtensorMapSwizzle code_swizzle =
      config.block_k == 64 ? SwizzleOf<32>() : SwizzleOf<128>();
  const uint64_t scale_dims[] = {uint64_t(k / 16), uint64_t(n)};
  const uint32_t scale_box[] = {kW4A16ScaleK / 16, kW4A16WeightRows};
  return Bf16TensorMap(x, 2, x_dims, x_box, CU_TENSOR_MAP_SWIZZLE_128B,
                       x_map) &&
         ByteTensorMap(codes, 2, code_dims, code_box, code_swizzle,
                       codes_map) &&
         ByteTensorMap(scales, 2, scale_dims, scale_box,
                       CU_TENSOR_MAP_SWIZZLE_NONE, scales_map);
}

template <int kTokens, int kBlockK, int kStages, int kBlocksPerSm, typename Out>
cudaError_t LaunchW4A16Config(const W4A16Plan& plan, const CUtensorMap& x_map,
                              const CUtensorMap& codes_map,
                              const CUtensorMap& scales_map,
                              const __nv_bfloat16* x, const float* amax,
                              Out* out, int m, int n, int k,
                              const int32_t* group_sizes, int groups,
                              cudaStream_t stream) {
  using S = W4A16Shape<kTokens, kBlockK>;
  static_assert(W4A16SharedBytes(kTokens, kBlockK, kStages) ==
                    Ring<kStages, S::kXBytes,
                         S::kCodeBytes + S::kScaleBytes>::kSharedBytes,
                "w4a16_plan.h sizes the ring the kernel lays out");
  const auto kernel = W4A16Kernel<kTokens, kBlockK, kStages, kBlocksPerSm, Out>;
  cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(plan.shared_bytes));
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(plan.token_tiles),
                        static_cast<unsigned>(plan.weight_tiles),
                        static_cast<unsigned>(plan.splits));
  config.blockDim = dim3(kW4A16Threads);
  config.dynamicSmemBytes = static_cast<size_t>(plan.shared_bytes);
  config.stream = stream;
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = 1;
  cluster[0].val.clusterDim.y = 1;
  cluster[0].val.clusterDim.z = static_cast<unsigned>(plan.splits);
  config.attrs = cluster;
  config.numAttrs = plan.splits > 1 ? 1 : 0;
  e = cudaLaunchKernelEx(&config, kernel, x_map, codes_map, scales_map, x, amax,
                         out, m, n, k, group_sizes, groups);
  return e != cudaSuccess ? e : cudaGetLastError();
}

// The kernel in the configuration the plan chose (ChooseW4A16Config);
// groups > 0 and group_sizes [groups] on the device: the grouped form.
template <typename Out>
cudaError_t LaunchW4A16(const W4A16Plan& plan, const CUtensorMap& x_map,
                        const CUtensorMap& codes_map,
                        const CUtensorMap& scales_map, const __nv_bfloat16* x,
                        const float* amax, Out* out, int m, int n, int k,
                        cudaStream_t stream,
                        const int32_t* group_sizes = nullptr, int groups = 0) {
  const W4A16Config c = plan.config;
#define JAX_NVFP4_W4A16_CONFIG(T, K, S, B)                                     \
  if (c.tokens == T && c.block_k == K && c.stages == S &&                      \
      c.blocks_per_sm == B) {                                                  \
    return LaunchW4A16Config<T, K, S, B, Out>(plan, x_map, codes_map,          \
                                              scales_map, x, amax, out, m, n,  \
                                              k, group_sizes, groups, stream); \
  }
  JAX_NVFP4_W4A16_CONFIG(16, 256, 4, 2)
  JAX_NVFP4_W4A16_CONFIG(32, 256, 3, 2)
  JAX_NVFP4_W4A16_CONFIG(64, 256, 2, 2)
  JAX_NVFP4_W4A16_CONFIG(128, 64, 9, 1)
#undef JAX_NVFP4_W4A16_CONFIG
  return cudaErrorInvalidConfiguration;
}

}  // namespace engine
}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_ENGINE_W4A16_CUH_
