// QuantizeTileKernel: quantize_cols, and the fused quantize_rows_cols where
// QuantizePrivateTileKernel does not apply (see quantize.cuh).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device.cuh"
#include "cuda/launch.cuh"
#include "cuda/quantize.cuh"
#include "numerics/fast.cuh"
#include "numerics/nvfp4.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

// QuantizeTileKernel occupancy target: 3 CTAs per SM (<= 80 registers) for
// 16-bit inputs on sm_90; 2 for float32, and on sm_100, where 80 registers
// would spill.
template <int kBytes>
constexpr int kTileCtasPerSm =
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
    2;
#else
    kBytes == 2 ? 3 : 2;
#endif

// ---------------------------------------------------------------------------
// QuantizeTileKernel: x [batch, m, k] -> row-wise output [batch, m, k]
// (quantized along k) and/or column-wise output [batch, k, m] (along m).
//
// Persistent CTAs of 256 threads walk kTileM x kTileK tiles of one batch item
// (k tiles fastest); the loads of the next tile are in flight while a tile is
// quantized. Per tile:
//   1. load: the tile's 16-byte chunks, consecutive threads on consecutive
//      chunks (a warp reads whole rows), into shared memory (raw bits, each
//      row's chunks XOR-swizzled by Swizzle(row): conflict-free accesses);
//   2. row phase: warp w takes tile rows 16w .. 16w + 15, lane l row
//      16w + l / 2 and k-blocks 2s + l % 2 (s = 0, 1);
//      column phase: lane l takes columns l and l + 32 of rows
//      16w .. 16w + 15 (two 16-element column blocks);
//      16x16 blocks reduce their amax with shuffles: over lanes of equal
//      l % 2 for the rows, over 16 neighbouring lanes for the columns;
//      the code and scale bytes go to shared memory;
//   3. store: consecutive threads write consecutive 8-byte code groups and
//      scale bytes, so every warp store covers whole 32-byte sectors of the
//      output rows (direct stores from the column phase would write 8 bytes
//      into each of 32 output rows).
// ---------------------------------------------------------------------------
template <InType T>
__device__ __forceinline__ int Swizzle(int r) {
  if constexpr (In<T>::kBytes == 2) {
    return (r & 1) | ((r & 2) << 1);  // chunks 2kb + c of 4 rows: 8 banks
  } else {
    return r & 3;  // chunks 4kb + c of 4 rows
  }
}

struct TilePos {
  int64_t b, m0, k0;
};

__device__ __forceinline__ TilePos TileAt(const TileArgs& args, int64_t tile) {
  const int64_t rest = Div(tile, args.k_tiles);
  const int64_t b = Div(rest, args.m_tiles);
  return {b, (rest - b * args.m_tiles) * kTileM,
          (tile - rest * args.k_tiles) * kTileK};
}

template <InType T>
constexpr int kRowChunks = kTileK * In<T>::kBytes / 16;  // chunks per row
template <InType T>
constexpr int kChunksPerThread = kTileM * kRowChunks<T> / kThreads;

// Raw bits of elements [first, first + count) of x (count <= elements per
// 16-byte chunk), zero-filled; one 16-byte load when `vec` and count is full.
template <InType T>
__device__ __forceinline__ uint4 LoadChunk(const void* x, int64_t first,
                                           int count, bool vec) {
  constexpr int kPerChunk = 16 / In<T>::kBytes;
  if (vec && count == kPerChunk) {
    return __ldg(reinterpret_cast<const uint4*>(static_cast<const char*>(x) +
                                                first * In<T>::kBytes));
  }
  uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int j = 0; j < kPerChunk; ++j) {
    if (j < count) {
      const uint32_t e = LoadRawElement<T>(x, first + j);
      if constexpr (In<T>::kBytes == 4) {
        w[j] = e;
      } else {
        w[j >> 1] |= e << (16 * (j & 1));
      }
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Starts the loads of this thread's chunks of a tile: chunk
// i * kThreads + threadIdx.x of the tile, row-major.
template <InType T>
__device__ __forceinline__ void LoadTileChunks(
    const TileArgs& args, const TilePos& p,
    uint4 (&chunks)[kChunksPerThread<T>]) {
  constexpr int kPerChunk = 16 / In<T>::kBytes;
#pragma unroll
  for (int i = 0; i < kChunksPerThread<T>; ++i) {
    const int q = i * kThreads + threadIdx.x;
    const int64_t m = p.m0 + q / kRowChunks<T>;
    const int64_t kfirst = p.k0 + kPerChunk * (q % kRowChunks<T>);
    const int64_t left = args.k - kfirst;  // elements of this row left
    const int count =
        m >= args.m || left <= 0
            ? 0
            : (left >= kPerChunk ? kPerChunk : static_cast<int>(left));
    chunks[i] = LoadChunk<T>(args.x, (p.b * args.m + m) * args.k + kfirst,
                             count, args.x_vec);
  }
}

template <InType T>
struct TileSmem {
  uint4 x[kTileM * kRowChunks<T>];  // raw tile, row-major, swizzled chunks
  uint2 row_codes[kTileM][kTileK / kBlock];  // [tile row][k-block ^ swz]
  uint8_t row_scales[kTileM][kTileK / kBlock];
  uint2 col_codes[kTileK][kTileM / kBlock + 1];  // [tile column][m-block]
  uint8_t col_scales[kTileK][kTileM / kBlock];
};

// Row-code staging swizzle: rows r and r + 4 of a half warp use other banks.
__device__ __forceinline__ int RowCodeSlot(int r, int kb) {
  return kb ^ (2 * ((r >> 2) & 1));
}

template <InType T, bool kRows, bool kCols>
__global__ void __launch_bounds__(kThreads, kTileCtasPerSm<In<T>::kBytes>)
    QuantizeTileKernel(const TileArgs args) {
  constexpr int kBytes = In<T>::kBytes;
  constexpr int kBlocksK = kTileK / kBlock;  // k-blocks per tile row (4)
  constexpr int kBlocksM = kTileM / kBlock;  // m-blocks per tile column (8)
  __shared__ TileSmem<T> smem;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  int64_t tile = blockIdx.x;
  if (tile >= args.tiles) return;
  TilePos pos = TileAt(args, tile);
  uint4 chunks[kChunksPerThread<T>];
  LoadTileChunks<T>(args, pos, chunks);
  for (;;) {
    // ---- 1. Stage the tile; start loading the next one. ----
#pragma unroll
    for (int i = 0; i < kChunksPerThread<T>; ++i) {
      const int q = i * kThreads + threadIdx.x;
      const int row = q / kRowChunks<T>;
      smem.x[row * kRowChunks<T> + ((q % kRowChunks<T>)^Swizzle<T>(row))] =
          chunks[i];
    }
    const int64_t next = tile + gridDim.x;
    TilePos next_pos = pos;
    if (next < args.tiles) {
      next_pos = TileAt(args, next);
      LoadTileChunks<T>(args, next_pos, chunks);
    }
    __syncthreads();

    const int64_t kk = Div(pos.b, args.key.batch_per_key);
    const uint32_t key0 = args.key.key[2 * kk];
    const uint32_t key1 = args.key.key[2 * kk + 1];

    // ---- 2a. Row phase: quantize along k. ----
    if (kRows) {
      const OutputArgs& out = args.row;
      const GlobalScale g = GlobalScaleOf(out, pos.b);
      const int r = 16 * warp + lane / 2;
      const int64_t m = pos.m0 + r;
#pragma unroll 1  // one block at a time: fewer registers, more warps
      for (int s = 0; s < 2; ++s) {
        const int kb = 2 * s + lane % 2;
        uint32_t w[kWords<T>];
#pragma unroll
        for (int c = 0; c < kChunks<T>; ++c) {
          const uint4 q = smem.x[r * kRowChunks<T> +
                                 ((kChunks<T> * kb + c) ^ Swizzle<T>(r))];
          w[4 * c] = q.x;
          w[4 * c + 1] = q.y;
          w[4 * c + 2] = q.z;
          w[4 * c + 3] = q.w;
        }
        float v[kBlock];
        WordsToFloats<T>(w, v);
        MaybeRht(out.rht, v);
        float block_amax = BlockAmax(v);  // +inf: a NaN or +-inf in it
        if (out.block16) {  // rows 16w .. 16w + 15: lanes of equal l % 2
#pragma unroll
          for (int offset = 2; offset < 32; offset *= 2) {
            block_amax = fmaxf(
                block_amax, __shfl_xor_sync(0xFFFFFFFFu, block_amax, offset));
          }
        }
        const EncodedBlock e =
            EncodeBlock(v, block_amax, g, out, out.stochastic, key0, key1,
                        pos.b, m, pos.k0 + kBlock * kb);
        smem.row_codes[r][RowCodeSlot(r, kb)] =
            make_uint2(static_cast<uint32_t>(e.packed),
                       static_cast<uint32_t>(e.packed >> 32));
        smem.row_scales[r][kb] = e.scale;
      }
    }

    // ---- 2b. Column phase: quantize along m. ----
    if (kCols) {
      const OutputArgs& out = args.col;
      const GlobalScale g = GlobalScaleOf(out, pos.b);
      // Tile column c, rows 16w .. 16w + 15, from its values v.
      const auto encode_column = [&](int c, float (&v)[kBlock]) {
        MaybeRht(out.rht, v);
        float block_amax = BlockAmax(v);  // +inf: a NaN or +-inf in it
        if (out.block16) {  // columns 16g .. 16g + 15: 16 neighbouring lanes
#pragma unroll
          for (int offset = 1; offset < 16; offset *= 2) {
            block_amax = fmaxf(
                block_amax, __shfl_xor_sync(0xFFFFFFFFu, block_amax, offset));
          }
        }
        const EncodedBlock e =
            EncodeBlock(v, block_amax, g, out, out.stochastic, key0, key1,
                        pos.b, pos.k0 + c, pos.m0 + 16 * warp);
        smem.col_codes[c][warp] =
            make_uint2(static_cast<uint32_t>(e.packed),
                       static_cast<uint32_t>(e.packed >> 32));
        smem.col_scales[c][warp] = e.scale;
      };
      constexpr int kPerChunk = 16 / kBytes;
      if (kBytes == 2 && !out.block16) {
        // 16-bit inputs, 1x16 blocks: lane l takes tile columns 2l and
        // 2l + 1. One 4-byte load per row holds both, and a warp's loads
        // cover whole rows (no bank conflicts): 16 loads for 32 elements.
        const uint32_t* words = reinterpret_cast<const uint32_t*>(smem.x);
        uint32_t w[kBlock];
#pragma unroll
        for (int j = 0; j < kBlock; ++j) {
          const int row = 16 * warp + j;
          const int chunk = (2 * lane / kPerChunk) ^ Swizzle<T>(row);
          w[j] = words[(row * kRowChunks<T> + chunk) * 4 + lane % 4];
        }
#pragma unroll 1  // one block at a time: fewer registers, more warps
        for (int s = 0; s < 2; ++s) {
          // Column 2l + s is half s of each word (little-endian).
          const uint32_t to_high = s == 0 ? 0x1044u : 0x3244u;  // bf16 -> f32
          float v[kBlock];
#pragma unroll
          for (int j = 0; j < kBlock; ++j) {
            if constexpr (T == InType::kBf16) {
              v[j] = BitsToFloat(__byte_perm(w[j], 0u, to_high));
            } else {
              v[j] = In<T>::FromRaw(w[j] >> (16 * s));
            }
          }
          encode_column(2 * lane + s, v);
        }
      } else {
#pragma unroll 1  // one block at a time: fewer registers, more warps
        for (int s = 0; s < 2; ++s) {
          // Tile column c = lane + 32s (16x16 blocks: 16 neighbouring lanes).
          const int c = lane + 32 * s;
          float v[kBlock];
#pragma unroll
          for (int j = 0; j < kBlock; ++j) {
            const int row = 16 * warp + j;
            const int chunk = (c / kPerChunk) ^ Swizzle<T>(row);
            const char* p = reinterpret_cast<const char*>(smem.x) +
                            (row * kRowChunks<T> + chunk) * 16 +
                            (c % kPerChunk) * kBytes;
            if constexpr (kBytes == 2) {
              v[j] = In<T>::FromRaw(*reinterpret_cast<const uint16_t*>(p));
            } else {
              v[j] = In<T>::FromRaw(*reinterpret_cast<const uint32_t*>(p));
            }
          }
          encode_column(c, v);
        }
      }
    }
    __syncthreads();

    // ---- 3. Store the staged bytes, whole sectors per warp. ----
    // Piece p: (tile row p / 4, k-block p % 4) and (tile column p / 8,
    // m-block p % 8); 512 of each, two per thread.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int p = i * kThreads + threadIdx.x;
      if (kRows) {
        const int r = p / kBlocksK;
        const int kb = p % kBlocksK;
        const int64_t m = pos.m0 + r;
        const int64_t kfirst = pos.k0 + kBlock * kb;
        if (m < args.m && kfirst < args.k) {  // k % 16 == 0 here
          const uint64_t flat =
              static_cast<uint64_t>((pos.b * args.m + m) * args.k + kfirst);
          const uint2 c = smem.row_codes[r][RowCodeSlot(r, kb)];
          StoreCodes(
              args.row.codes + flat / 2,
              static_cast<uint64_t>(c.x) | (static_cast<uint64_t>(c.y) << 32),
              args.row.codes_aligned);
          args.row.scales[flat / kBlock] = smem.row_scales[r][kb];
        }
      }
      if (kCols) {
        const int kc = p / kBlocksM;
        const int mb = p % kBlocksM;
        const int64_t kcol = pos.k0 + kc;
        const int64_t mfirst = pos.m0 + kBlock * mb;
        if (kcol < args.k && mfirst < args.m) {  // m % 16 == 0
          const uint64_t flat =
              static_cast<uint64_t>((pos.b * args.k + kcol) * args.m + mfirst);
          const uint2 c = smem.col_codes[kc][mb];
          StoreCodes(
              args.col.codes + flat / 2,
              static_cast<uint64_t>(c.x) | (static_cast<uint64_t>(c.y) << 32),
              args.col.codes_aligned);
          args.col.scales[flat / kBlock] = smem.col_scales[kc][mb];
        }
      }
    }
    if (next >= args.tiles) break;
    tile = next;
    pos = next_pos;
  }
}

}  // namespace

template <InType T, bool kRows, bool kCols>
void LaunchTileKernel(cudaStream_t stream, const TileArgs& args) {
  const auto kernel = QuantizeTileKernel<T, kRows, kCols>;
  kernel<<<PersistentGrid(kernel, args.tiles), kThreads, 0, stream>>>(args);
}

template <bool kRows, bool kCols>
void LaunchQuantizeTile(cudaStream_t stream, ffi::DataType type,
                        const TileArgs& args) {
  switch (type) {
    case ffi::DataType::BF16:
      LaunchTileKernel<InType::kBf16, kRows, kCols>(stream, args);
      break;
    case ffi::DataType::F16:
      LaunchTileKernel<InType::kF16, kRows, kCols>(stream, args);
      break;
    default:
      LaunchTileKernel<InType::kF32, kRows, kCols>(stream, args);
      break;
  }
}

template void LaunchQuantizeTile<false, true>(cudaStream_t, ffi::DataType,
                                              const TileArgs&);
template void LaunchQuantizeTile<true, true>(cudaStream_t, ffi::DataType,
                                             const TileArgs&);

}  // namespace jax_nvfp4
