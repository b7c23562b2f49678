// CUDA XLA FFI handlers: the same bytes as the CPU handlers (cpu_handlers.cc),
// computed with the arithmetic of nvfp4_numerics.h on the device. Build with
// --fmad=false and without fast-math so that every float operation rounds as
// written (IEEE division, no FMA contraction, no flush to zero).
//
// Kernels (256 threads per CTA unless noted):
//   * QuantizePrivateTileKernel (64 threads): the recipe's fused bf16
//     quantize (1x16 or 16x16 blocks both ways, m and k multiples of 16);
//     each pair of lanes quantizes one 16x16 tile both ways from their own
//     slices of shared memory.
//   * QuantizeTileKernel: persistent CTAs over 128 (m) x 64 (k) tiles of
//     x[b]; a tile is read once with coalesced 16-byte loads into shared
//     memory, quantized along k (rows) and along m (columns) from there, and
//     its code and scale bytes are written back in whole sectors. Serves
//     quantize_cols and the other fused quantize_rows_cols cases.
//   * QuantizeRowsKernel: persistent threads, one 16-element block along k
//     at a time (the next block's loads in flight).
//   * AmaxKernel: one thread per 16-element chunk along the transformed axis,
//     a block reduction, then one atomicMax per block and output;
//     AmaxColumnsBf16Kernel: the recipe's case, 16 x 8 chunks.
//   * DecodeBf16Kernel: the Hopper GEMM's operands, e2m1 * block scale in
//     bfloat16; 8 elements per lane, 16-byte stores.
//   * DequantizeKernel: one thread per 16-element block.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "cuda_fast_numerics.cuh"
#include "handler_common.h"
#include "nvfp4_numerics.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

constexpr int kThreads = 256;  // threads of every CTA
constexpr int kTileM = 128;    // tile rows (m) of QuantizeTileKernel
constexpr int kTileK = 64;     // tile columns (k) of QuantizeTileKernel
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
constexpr int64_t kMaxGrid = 0x7FFFFFFF;  // gridDim.x limit

// ---------------------------------------------------------------------------
// Input element types. A 16-element block of x is held as its raw bits in
// kWords 32-bit words (little-endian: element j of a 16-bit type is half
// j % 2 of word j / 2), and widened to float32 exactly as on the CPU.
// ---------------------------------------------------------------------------
enum class InType { kF32, kBf16, kF16 };

template <InType T>
struct In;

template <>
struct In<InType::kF32> {
  static constexpr int kBytes = 4;
  static __device__ __forceinline__ float FromRaw(uint32_t raw) {
    return BitsToFloat(raw);
  }
  static __device__ __forceinline__ float Element(const uint32_t* w, int j) {
    return BitsToFloat(w[j]);
  }
};

template <>
struct In<InType::kBf16> {
  static constexpr int kBytes = 2;
  static __device__ __forceinline__ float FromRaw(uint32_t raw) {
    return Bfloat16BitsToFloat(static_cast<uint16_t>(raw));
  }
  static __device__ __forceinline__ float Element(const uint32_t* w, int j) {
    return FromRaw(w[j >> 1] >> (16 * (j & 1)));
  }
};

template <>
struct In<InType::kF16> {
  static constexpr int kBytes = 2;
  static __device__ __forceinline__ float FromRaw(uint32_t raw) {
    return Float16BitsToFloat(static_cast<uint16_t>(raw));
  }
  static __device__ __forceinline__ float Element(const uint32_t* w, int j) {
    return FromRaw(w[j >> 1] >> (16 * (j & 1)));
  }
};

// 32-bit words (and 16-byte chunks) of one 16-element block.
template <InType T>
constexpr int kWords = 4 * In<T>::kBytes;
template <InType T>
constexpr int kChunks = In<T>::kBytes;

// Raw bits of element i of x.
template <InType T>
__device__ __forceinline__ uint32_t LoadRawElement(const void* x, int64_t i) {
  if constexpr (In<T>::kBytes == 4) {
    return static_cast<const uint32_t*>(x)[i];
  } else {
    return static_cast<const uint16_t*>(x)[i];
  }
}

// Loads the raw words of elements [first, first + count) of x (count <= 16)
// into w, zero-filling the rest. `vec`: 16-byte loads, valid when count == 16
// and the block starts on a 16-byte boundary.
template <InType T>
__device__ __forceinline__ void LoadBlockWords(const void* x, int64_t first,
                                               int count, bool vec,
                                               uint32_t (&w)[kWords<T>]) {
  if (vec && count == kBlock) {
    const uint4* p = reinterpret_cast<const uint4*>(
        static_cast<const char*>(x) + first * In<T>::kBytes);
#pragma unroll
    for (int c = 0; c < kChunks<T>; ++c) {
      const uint4 q = __ldg(p + c);
      w[4 * c] = q.x;
      w[4 * c + 1] = q.y;
      w[4 * c + 2] = q.z;
      w[4 * c + 3] = q.w;
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kWords<T>; ++i) w[i] = 0;
#pragma unroll
  for (int j = 0; j < kBlock; ++j) {
    if (j < count) {
      const uint32_t e = LoadRawElement<T>(x, first + j);
      if constexpr (In<T>::kBytes == 4) {
        w[j] = e;
      } else {
        w[j >> 1] |= e << (16 * (j & 1));
      }
    }
  }
}

template <InType T>
__device__ __forceinline__ void WordsToFloats(const uint32_t (&w)[kWords<T>],
                                              float (&v)[kBlock]) {
#pragma unroll
  for (int j = 0; j < kBlock; ++j) v[j] = In<T>::Element(w, j);
}

// ---------------------------------------------------------------------------
// One quantized output: where it goes and how it is produced.
// ---------------------------------------------------------------------------
struct OutputArgs {
  uint8_t* codes;          // [batch, rows, len / 2]
  uint8_t* scales;         // [batch, rows, len / 16], E4M3 bytes
  const float* amax;       // [n_amax]
  int64_t batch_per_amax;  // batch / n_amax
  uint32_t stream;         // stochastic-rounding stream id
  bool tile16;             // 16x16 tiles (else 1x16 blocks)
  bool stochastic;
  bool rht;
  bool codes_aligned;  // codes is 8-byte aligned: one 8-byte store per block
  // `codes` holds bfloat16 e2m1(code) * scale [batch, rows, len] instead of
  // the codes (QuantizePrivateTileKernel only; 16-byte aligned).
  bool decoded;
  // Stochastic-rounding index of element (b, r, l): its flat index in the
  // whole (possibly sharded) tensor; see GlobalRandomIndex.
  const int32_t* origin;  // device int32[3]
  GlobalPlace place;
  bool transposed;  // the column-wise output (rows = k)
};

struct KeyArgs {
  const uint32_t* key;    // [n_key, 2]
  int64_t batch_per_key;  // batch / n_key
};

// In place: the Random Hadamard Transform of v when `rht`.
__device__ __forceinline__ void MaybeRht(bool rht, float (&v)[kBlock]) {
  if (rht) {
    float y[kBlock];
    RandomHadamard16Fast(v, y);
#pragma unroll
    for (int i = 0; i < kBlock; ++i) v[i] = y[i];
  }
}

// One quantized 16-element block: its 8 code bytes (little-endian), its
// E4M3 scale byte and that scale's value.
struct EncodedBlock {
  uint64_t packed;
  uint8_t scale;
  float scale_value;
};

// Quantizes one 16-element block (already transformed) whose scale comes
// from `block_amax`, with stochastic rounding when `stochastic` (out's
// option, or a constant the caller knows it equals). v[0] is element
// (b, r, l) of the output [batch, rows, len]; its index in the whole tensor
// picks the stochastic-rounding bits. `sign_bits`: see EncodeBlock16Fast.
__device__ __forceinline__ EncodedBlock EncodeBlock(
    const float (&v)[kBlock], float block_amax, bool has_nan, GlobalScale g,
    const OutputArgs& out, bool stochastic, uint32_t key0, uint32_t key1,
    int64_t b, int64_t r, int64_t l, const uint64_t* sign_bits = nullptr) {
  const BlockScaleE4M3 scale = BlockScaleFast(block_amax, g);
  const float multiplier = BlockEncodeMultiplier(scale.value, g);
  uint64_t packed;
  if (stochastic) {
    const uint64_t block =
        GlobalRandomIndex(out.origin, out.place, out.transposed, b, r, l) /
        kBlock;
    uint64_t random_lo, random_hi;
    RandomBytes16(key0, key1, out.stream, block, &random_lo, &random_hi);
    packed = EncodeBlock16Fast(v, multiplier, has_nan, /*stochastic=*/true,
                               random_lo, random_hi, /*below_seven=*/false,
                               sign_bits);
  } else {
    packed = EncodeBlock16Fast(v, multiplier, has_nan, /*stochastic=*/false, 0,
                               0, block_amax * multiplier < 7.0f, sign_bits);
  }
  return {packed, scale.byte, scale.value};
}

// Stores 8 code bytes at `codes` (a multiple of 8 bytes into the output).
__device__ __forceinline__ void StoreCodes(uint8_t* codes, uint64_t packed,
                                           bool aligned) {
  if (aligned) {
    *reinterpret_cast<uint64_t*>(codes) = packed;  // little-endian bytes
  } else {
#pragma unroll
    for (int byte = 0; byte < 8; ++byte) {
      codes[byte] = static_cast<uint8_t>(packed >> (8 * byte));
    }
  }
}

__device__ __forceinline__ void EncodeAndStore(
    const float (&v)[kBlock], float block_amax, bool has_nan, GlobalScale g,
    const OutputArgs& out, uint32_t key0, uint32_t key1, uint64_t flat,
    int64_t b, int64_t r, int64_t l) {
  const EncodedBlock e = EncodeBlock(v, block_amax, has_nan, g, out,
                                     out.stochastic, key0, key1, b, r, l);
  StoreCodes(out.codes + flat / 2, e.packed, out.codes_aligned);
  out.scales[flat / kBlock] = e.scale;
}

// a / b for a >= 0, b > 0, with a 32-bit division when both fit.
__device__ __forceinline__ int64_t Div(int64_t a, int64_t b) {
  if (((a | b) >> 32) == 0) {
    return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
  }
  return a / b;
}

__device__ __forceinline__ GlobalScale GlobalScaleOf(const OutputArgs& out,
                                                     int64_t b) {
  return GlobalScaleFromAmax(out.amax[Div(b, out.batch_per_amax)]);
}

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
//      16x16 tiles reduce their amax with shuffles: over lanes of equal
//      l % 2 for the rows, over 16 neighbouring lanes for the columns;
//      the code and scale bytes go to shared memory;
//   3. store: consecutive threads write consecutive 8-byte code groups and
//      scale bytes, so every warp store covers whole 32-byte sectors of the
//      output rows (direct stores from the column phase would write 8 bytes
//      into each of 32 output rows).
// ---------------------------------------------------------------------------
struct TileArgs {
  const void* x;
  int64_t batch, m, k;
  int64_t m_tiles, k_tiles, tiles;  // tiles = batch * m_tiles * k_tiles
  bool x_vec;  // x is 16-byte aligned and so is every row (k * bytes % 16)
  KeyArgs key;
  OutputArgs row;  // [batch, m, k] quantized along k
  OutputArgs col;  // [batch, k, m] quantized along m
};

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
        const BlockMax block_max = BlockAmax(v);
        float block_amax = block_max.amax;
        if (out.tile16) {  // rows 16w .. 16w + 15: lanes of equal l % 2
#pragma unroll
          for (int offset = 2; offset < 32; offset *= 2) {
            block_amax = fmaxf(
                block_amax, __shfl_xor_sync(0xFFFFFFFFu, block_amax, offset));
          }
        }
        const EncodedBlock e = EncodeBlock(v, block_amax, block_max.has_nan, g,
                                           out, out.stochastic, key0, key1,
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
        const BlockMax block_max = BlockAmax(v);
        float block_amax = block_max.amax;
        if (out.tile16) {  // columns 16g .. 16g + 15: 16 neighbouring lanes
#pragma unroll
          for (int offset = 1; offset < 16; offset *= 2) {
            block_amax = fmaxf(
                block_amax, __shfl_xor_sync(0xFFFFFFFFu, block_amax, offset));
          }
        }
        const EncodedBlock e = EncodeBlock(
            v, block_amax, block_max.has_nan, g, out, out.stochastic, key0,
            key1, pos.b, pos.k0 + c, pos.m0 + 16 * warp);
        smem.col_codes[c][warp] =
            make_uint2(static_cast<uint32_t>(e.packed),
                       static_cast<uint32_t>(e.packed >> 32));
        smem.col_scales[c][warp] = e.scale;
      };
      constexpr int kPerChunk = 16 / kBytes;
      if (kBytes == 2 && !out.tile16) {
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
          // Tile column c = lane + 32s (16x16 tiles: 16 neighbouring lanes).
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

// ---------------------------------------------------------------------------
// Decoding to bfloat16: e2m1(code) * E4M3 block scale, exact (2 + 4
// significant bits; 2^-10 .. 2688), without the amax -- the operands of the
// Hopper GEMM (jax_nvfp4/cuda_gemm.py), as its pure-JAX twin decode_bf16.
// ---------------------------------------------------------------------------
// Low and high bytes of the bfloat16 bits of 0, 0.5, 1, 1.5 | 2, 3, 4, 6:
// 0x0000 0x3F00 0x3F80 0x3FC0 | 0x4000 0x4040 0x4080 0x40C0.
constexpr uint32_t kE2M1LowBytes03 = 0xC0800000u;
constexpr uint32_t kE2M1LowBytes47 = 0xC0804000u;
constexpr uint32_t kE2M1HighBytes03 = 0x3F3F3F00u;
constexpr uint32_t kE2M1HighBytes47 = 0x40404040u;

// prmt.b32 in its default mode, where a selector nibble with bit 3 set
// gives the sign (bit 7) of the byte it selects, replicated over the byte.
__device__ __forceinline__ uint32_t PermuteBytes(uint32_t a, uint32_t b,
                                                 uint32_t selector) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}

// A scale's bfloat16 bits in both halves of a word: the top half of its
// float32 (exact: E4M3 values have 4 significant bits).
__device__ __forceinline__ uint32_t ScaleBf16Pair(float scale) {
  return __byte_perm(FloatBits(scale), 0u, 0x3232u);
}

// The 8 elements of a code word (element j in nibble j) as bfloat16
// e2m1 * scale, elements 2i and 2i + 1 in the low and high half of word i.
// The magnitudes' bytes come from the two byte tables (a nibble 0..7 selects
// one of 8 bytes); the signs by sign-replicating byte selection: byte k of
// `codes` holds element 2k + 1's sign in its bit 7 and, shifted left by 4,
// element 2k's. One bf16x2 multiply per two elements applies the scale.
__device__ __forceinline__ uint4 DecodeCodes8Bf16(uint32_t codes,
                                                  uint32_t scale_pair) {
  const uint32_t index = codes & 0x77777777u;  // magnitude nibbles
  const uint32_t lo03 = __byte_perm(kE2M1LowBytes03, kE2M1LowBytes47, index);
  const uint32_t hi03 = __byte_perm(kE2M1HighBytes03, kE2M1HighBytes47, index);
  const uint32_t lo47 =
      __byte_perm(kE2M1LowBytes03, kE2M1LowBytes47, index >> 16);
  const uint32_t hi47 =
      __byte_perm(kE2M1HighBytes03, kE2M1HighBytes47, index >> 16);
  // Byte j: 0xFF where element j (of 0..3, resp. 4..7) is negative.
  const uint32_t shifted = codes << 4;
  const uint32_t negative03 = PermuteBytes(shifted, codes, 0xD9C8u);
  const uint32_t negative47 = PermuteBytes(shifted, codes, 0xFBEAu);
  const uint32_t signed03 = hi03 | (negative03 & 0x80808080u);
  const uint32_t signed47 = hi47 | (negative47 & 0x80808080u);
  uint32_t w[4] = {__byte_perm(lo03, signed03, 0x5140u),
                   __byte_perm(lo03, signed03, 0x7362u),
                   __byte_perm(lo47, signed47, 0x5140u),
                   __byte_perm(lo47, signed47, 0x7362u)};
  __nv_bfloat162 scale2;
  memcpy(&scale2, &scale_pair, sizeof scale2);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 v;
    memcpy(&v, &w[i], sizeof v);
    v = __hmul2(v, scale2);
    memcpy(&w[i], &v, sizeof v);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// ---------------------------------------------------------------------------
// QuantizePrivateTileKernel: the fused row-wise + column-wise quantize of a
// bfloat16 x with 1x16 blocks both ways (the recipe's X and dY) or 16x16
// blocks both ways (its 2D weights; not with column RHT), no RHT on the
// rows, m and k multiples of 16; QuantizeTileKernel serves the other cases.
// Two neighbouring lanes (a pair) own one 16 (m) x 16 (k) tile
// of x: lane h = 0 or 1 of the pair loads tile rows 8h .. 8h + 7 with 16
// 16-byte loads (all in flight at once) into its own slice of shared memory,
// quantizes those 8 rows along k, and, after a __syncwarp, the 8 tile
// columns 8h .. 8h + 7 along m -- each column block 8 words from its own
// slice and 8 from its partner's. No second read of x, no CTA barrier (one
// shuffle per 16x16 block for its amax). Register-held tiles failed: code
// indexed by a loop counter cannot address registers, and the fully unrolled
// form (~200 KB of code per instantiation) was 3x slower on an H200 (752 vs 246
// us at 16384 x 8192: the instruction cache). Half a tile per thread (the
// previous form gave each thread a whole tile) halves the slice and the load
// registers, so twice the warps fit on an SM to hide the latency of the
// arithmetic's dependency chains (the whole-tile form issued in 62% of cycles
// with 3 warps per scheduler, stalled mostly on fixed-latency dependencies).
// The rounding and RHT options are template arguments: one straight path
// per instantiation.
//
// Slice layout: 65 words per lane; word j of slice row r (elements 2j,
// 2j + 1 of the row, element 2j in the low half) at 8r + 2(j % 4) + j / 4.
// Row accesses (every lane the same word of its own slice) are
// conflict-free because 65 is odd; column accesses read word j = 4h + p of
// the pair's slice (h = 0 or 1, p the same for the warp) and the
// interleave puts words p and 4 + p on banks of opposite parity, so those
// are conflict-free too.
// Lanes: bit 0 the half h, bits 1-2 the 16-element k block (4 along k),
// bits 3-4 the 16-row m block (4 along m): a warp covers 64 (m) x 64 (k);
// its loads read 128 contiguous bytes of each row, its row-code stores
// write 32 contiguous bytes per row, and its column-code stores 32
// contiguous bytes (4 m blocks x 8 bytes) of each output row. A CTA is 2
// warps along m: 128 (m) x 64 (k), with 16.6 KB of shared memory, and
// takes one tile (the hardware balances the CTAs across the SMs). Measured
// on an H200 and dropped: a per-CTA shared-memory table of encode
// multipliers (one per scale byte) in place of the IEEE division per block:
// with persistent CTAs (a table built once per CTA) 12% fewer instructions
// but 14% slower (231 vs 202 us at 16384 x 8192: a tail of CTAs with one
// tile left, and a table load in every block's dependency chain), with one
// tile per CTA 2% slower.
// ---------------------------------------------------------------------------
constexpr int kPrivThreads = 64;
constexpr int kPrivTileM = 128;        // CTA tile rows (m)
constexpr int kPrivTileK = 64;         // CTA tile columns (k)
constexpr int kHalfRows = kBlock / 2;  // tile rows per lane
constexpr int kSliceWords = kHalfRows * kBlock / 2 + 1;
// 12 CTAs (24 warps) per SM: at most 80 registers per thread (the
// stochastic-rounding instantiations would take 96, 20 warps), 12 x 17.7 KB
// of shared memory (16.6 KB + the 1 KB the SM reserves per CTA). One-warp
// CTAs (64 x 64 tiles, 24 per SM) measured the same on an H200.
constexpr int kPrivCtasPerSm = 12;

// Where word j (0..7) of slice row r lives in a slice (see above).
__device__ __forceinline__ int SliceWord(int r, int j) {
  return 8 * r + 2 * (j & 3) + (j >> 2);
}

// Stores one encoded block: 8 code bytes at `codes` (8-byte aligned), or,
// `decoded`, its 16 bfloat16 values there (16-byte aligned); and the scale
// byte at `scale`.
__device__ __forceinline__ void StoreBlock(const EncodedBlock& e, bool decoded,
                                           uint8_t* codes, uint8_t* scale) {
  if (decoded) {
    const uint32_t scale_pair = ScaleBf16Pair(e.scale_value);
    uint4* values = reinterpret_cast<uint4*>(codes);
    values[0] = DecodeCodes8Bf16(static_cast<uint32_t>(e.packed), scale_pair);
    values[1] =
        DecodeCodes8Bf16(static_cast<uint32_t>(e.packed >> 32), scale_pair);
  } else {
    *reinterpret_cast<uint64_t*>(codes) = e.packed;  // little-endian bytes
  }
  *scale = e.scale;
}

template <bool kRowStochastic, bool kColRht, bool kColStochastic, bool kTile16>
__global__ void __launch_bounds__(kPrivThreads, kPrivCtasPerSm)
    QuantizePrivateTileKernel(const TileArgs args) {
  // 16x16 blocks share one amax both ways only without RHT on the columns.
  static_assert(!(kTile16 && kColRht), "16x16 tiles with column RHT");
  using T = In<InType::kBf16>;
  __shared__ uint32_t slices[kPrivThreads * kSliceWords];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int h = lane & 1;
  uint32_t* const slice = slices + threadIdx.x * kSliceWords;
  // The pair's slices: tile rows 0 .. 7 and 8 .. 15.
  const uint32_t* const upper = slices + (threadIdx.x & ~1) * kSliceWords;
  const uint32_t* const lower = upper + kSliceWords;
  // The rounding, RHT and block options come from the template arguments
  // (the kernel arguments hold the same values).
  const OutputArgs& row_out = args.row;
  const OutputArgs& col_out = args.col;
  // Output strides in bytes: code (or decoded value) and scale rows of each
  // output; the offset in bytes of element f's code (or value).
  const auto code_bytes = [](const OutputArgs& out, uint64_t f) {
    return out.decoded ? 2 * f : f / 2;
  };
  const uint64_t row_codes_stride = code_bytes(row_out, args.k);
  const uint64_t row_scales_stride = static_cast<uint64_t>(args.k) / kBlock;
  const uint64_t col_codes_stride = code_bytes(col_out, args.m);
  const uint64_t col_scales_stride = static_cast<uint64_t>(args.m) / kBlock;
  for (int64_t tile = blockIdx.x; tile < args.tiles; tile += gridDim.x) {
    const int64_t rest = Div(tile, args.k_tiles);
    const int64_t b = Div(rest, args.m_tiles);
    // The pair's tile: rows m0 .. m0 + 15, columns k0 .. k0 + 15.
    const int64_t m0 =
        (rest - b * args.m_tiles) * kPrivTileM + 64 * warp + 16 * (lane >> 3);
    const int64_t k0 =
        (tile - rest * args.k_tiles) * kPrivTileK + 16 * ((lane >> 1) & 3);
    // Both lanes of a pair agree (m, k multiples of 16); every lane still
    // reaches the __syncwarp()s.
    const bool active = m0 < args.m && k0 < args.k;
    if (active) {  // Rows m0 + 8h .. m0 + 8h + 7, elements k0 .. k0 + 15.
      const uint4* x = reinterpret_cast<const uint4*>(
          static_cast<const char*>(args.x) +
          ((b * args.m + m0 + kHalfRows * h) * args.k + k0) * T::kBytes);
      const int64_t row_chunks = args.k * T::kBytes / 16;
      uint4 q[kHalfRows][2];
#pragma unroll
      for (int r = 0; r < kHalfRows; ++r) {
        q[r][0] = __ldg(x + r * row_chunks);
        q[r][1] = __ldg(x + r * row_chunks + 1);
      }
#pragma unroll
      for (int r = 0; r < kHalfRows; ++r) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          slice[SliceWord(r, 4 * c)] = q[r][c].x;
          slice[SliceWord(r, 4 * c + 1)] = q[r][c].y;
          slice[SliceWord(r, 4 * c + 2)] = q[r][c].z;
          slice[SliceWord(r, 4 * c + 3)] = q[r][c].w;
        }
      }
    }
    __syncwarp();
    // 16x16 blocks: the pair's tile is one block both ways, its amax the
    // maximum over both halves (NaN ignored, as for a 1x16 block).
    float tile_amax = 0.0f;
    if (kTile16) {
      if (active) {
#pragma unroll 1
        for (int r = 0; r < kHalfRows; ++r) {
          float v[kBlock];
#pragma unroll
          for (int j = 0; j < kBlock; ++j) {
            v[j] = T::FromRaw(slice[SliceWord(r, j / 2)] >> (16 * (j % 2)));
          }
          tile_amax = fmaxf(tile_amax, BlockAmax(v).amax);
        }
      }
      tile_amax = fmaxf(tile_amax, __shfl_xor_sync(0xFFFFFFFFu, tile_amax, 1));
    }
    if (active) {
      uint32_t key0 = 0, key1 = 0;
      if (kRowStochastic || kColStochastic) {
        const int64_t kk = Div(b, args.key.batch_per_key);
        key0 = args.key.key[2 * kk];
        key1 = args.key.key[2 * kk + 1];
      }
      {  // Row r along k: output element (b, m0 + 8h + r, k0).
        const GlobalScale g = GlobalScaleOf(row_out, b);
        const int64_t mh = m0 + kHalfRows * h;
        const int64_t flat0 = (b * args.m + mh) * args.k + k0;
        uint8_t* codes = row_out.codes + code_bytes(row_out, flat0);
        uint8_t* scales = row_out.scales + flat0 / kBlock;
#pragma unroll 1  // short code: see the column loop
        for (int r = 0; r < kHalfRows; ++r) {
          uint32_t words[kBlock / 2];
          float v[kBlock];
#pragma unroll
          for (int j = 0; j < kBlock / 2; ++j) {
            words[j] = slice[SliceWord(r, j)];
            v[2 * j] = BitsToFloat(words[j] << 16);
            v[2 * j + 1] = BitsToFloat(words[j] & 0xFFFF0000u);
          }
          const uint64_t signs = SignBits16Bf16(words);
          const BlockMax block_max = BlockAmaxBf16(words, v);
          StoreBlock(EncodeBlock(v, kTile16 ? tile_amax : block_max.amax,
                                 block_max.has_nan, g, row_out, kRowStochastic,
                                 key0, key1, b, mh + r, k0, &signs),
                     row_out.decoded, codes, scales);
          codes += row_codes_stride;
          scales += row_scales_stride;
        }
      }
      {  // Columns 8h + 2p, 8h + 2p + 1 along m: output (b, k0 + c, m0).
        const GlobalScale g = GlobalScaleOf(col_out, b);
        const int64_t flat0 = (b * args.k + k0) * args.m + m0;
        uint8_t* const codes = col_out.codes + code_bytes(col_out, flat0);
        uint8_t* const scales = col_out.scales + flat0 / kBlock;
#pragma unroll 1
        for (int p = 0; p < 4; ++p) {
          const int j = 4 * h + p;  // the word of each row
          // Output rows 2j and 2j + 1 (advanced after the first).
          uint8_t* col_codes = codes + 2 * j * col_codes_stride;
          uint8_t* col_scales = scales + 2 * j * col_scales_stride;
          uint32_t w[kBlock];
#pragma unroll
          for (int r = 0; r < kHalfRows; ++r) {
            w[r] = upper[SliceWord(r, j)];
            w[kHalfRows + r] = lower[SliceWord(r, j)];
          }
// One block per loop step, rows and columns alike: the other warps hide
// the latency, and the code stays short. With two row blocks per step and
// both columns of a word unrolled, dY's instantiation (4552 instructions)
// stalled 2 cycles per issued instruction on instruction fetch (335 us at
// 16384 x 8192 on an H200; 312 us with 3144 instructions).
#pragma unroll 1
          for (int s = 0; s < 2; ++s) {
            // Element s of each word, widened: one byte permute.
            const uint32_t select = s == 0 ? 0x1044u : 0x3244u;
            float v[kBlock];
#pragma unroll
            for (int r = 0; r < kBlock; ++r) {
              v[r] = BitsToFloat(__byte_perm(w[r], 0u, select));
            }
            uint64_t signs;
            BlockMax block_max;
            if constexpr (kColRht) {
              float y[kBlock];
              uint32_t packed[kBlock / 2];
              RandomHadamard16FastPacked(v, y, packed);
#pragma unroll
              for (int r = 0; r < kBlock; ++r) v[r] = y[r];
              signs = SignBits16Bf16(packed);
              // From the bfloat16 words, as for the rows: with the float
              // values first needed by the encode, ptxas widens them once
              // (after the division) rather than twice.
              block_max = BlockAmaxBf16(packed, v);
            } else {
              signs = SignBits16(v);
              block_max = BlockAmax(v);
            }
            StoreBlock(
                EncodeBlock(v, kTile16 ? tile_amax : block_max.amax,
                            block_max.has_nan, g, col_out, kColStochastic, key0,
                            key1, b, k0 + 2 * j + s, m0, &signs),
                col_out.decoded, col_codes, col_scales);
            col_codes += col_codes_stride;
            col_scales += col_scales_stride;
          }
        }
      }
    }
    __syncwarp();  // the partner is done with this slice
  }
}

// ---------------------------------------------------------------------------
// QuantizeRowsKernel: x [batch, m, k] -> [batch, m, k] quantized along k.
// Persistent threads take 16-element blocks i, i + stride, ... (32 bytes of
// x with 16-byte loads, 8 code bytes, one scale byte each). 1x16: block i in
// memory order (coalesced). 16x16: the 16 rows of a tile's k-block are 16
// consecutive threads, which reduce the tile amax with shuffles inside their
// half warp.
// ---------------------------------------------------------------------------
struct RowsArgs {
  const void* x;
  int64_t batch, m, k;
  int64_t blocks;  // batch * m * k / 16
  bool x_vec;      // x is 16-byte aligned
  KeyArgs key;
  OutputArgs out;
};

template <InType T>
__global__ void __launch_bounds__(kThreads)
    QuantizeRowsKernel(const RowsArgs args) {
  const int64_t k_blocks = args.k / kBlock;
  const uint32_t half_mask = 0xFFFFu << (threadIdx.x & 16);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  // First element of block i (and its row over batch * m).
  const auto first_of = [&](int64_t i, int64_t* row) {
    int64_t kb;
    if (args.out.tile16) {
      const int64_t group = i / 16;
      const int64_t tile_row = Div(group, k_blocks);
      *row = tile_row * 16 + i % 16;
      kb = group - tile_row * k_blocks;
    } else {
      *row = Div(i, k_blocks);
      kb = i - *row * k_blocks;
    }
    return *row * args.k + kb * kBlock;
  };
  // Persistent threads: blocks i, i + stride, ...; the next block's loads are
  // in flight while this one is quantized. blocks % 16 == 0 for 16x16 tiles,
  // so a half warp stays together.
  int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= args.blocks) return;
  int64_t row;
  int64_t first = first_of(i, &row);
  uint32_t w[kWords<T>];
  LoadBlockWords<T>(args.x, first, kBlock, args.x_vec, w);
  for (;;) {
    float v[kBlock];
    WordsToFloats<T>(w, v);
    const int64_t next = i + stride;
    int64_t next_row = row;
    int64_t next_first = first;
    if (next < args.blocks) {
      next_first = first_of(next, &next_row);
      LoadBlockWords<T>(args.x, next_first, kBlock, args.x_vec, w);
    }
    MaybeRht(args.out.rht, v);
    const BlockMax block_max = BlockAmax(v);
    float block_amax = block_max.amax;
    if (args.out.tile16) {
#pragma unroll
      for (int offset = 1; offset < 16; offset *= 2) {
        block_amax = fmaxf(block_amax,
                           __shfl_xor_sync(half_mask, block_amax, offset, 16));
      }
    }
    const int64_t b = Div(row, args.m);
    const int64_t kk = Div(b, args.key.batch_per_key);
    EncodeAndStore(v, block_amax, block_max.has_nan, GlobalScaleOf(args.out, b),
                   args.out, args.key.key[2 * kk], args.key.key[2 * kk + 1],
                   static_cast<uint64_t>(first), b, row - b * args.m,
                   first - row * args.k);
    if (next >= args.blocks) break;
    i = next;
    row = next_row;
    first = next_first;
  }
}

// ---------------------------------------------------------------------------
// AmaxKernel: out[b] = (max |x[b]|, max |bf16(RHT(x[b]))|). The CTAs
// blockIdx.x / ctas_per_batch == b cover batch item b; thread chunks are 16
// elements along the transformed axis: contiguous along k (kAlongK), or
// 16 rows of one column (consecutive threads: consecutive columns).
// All values are >= +0 and never NaN, so the float maximum is the unsigned
// maximum of the bit patterns (the output is zeroed first).
// ---------------------------------------------------------------------------
struct AmaxArgs {
  const void* x;
  int64_t m, k;
  int64_t chunks;  // per batch item: m * k / 16
  int64_t ctas_per_batch;
  bool x_vec;  // x is 16-byte aligned (chunks along k start on 32 bytes)
  float* out;  // [batch, 2]
};

// The CTA's maxima of its threads' (plain, transformed) into out[0..1]: a
// warp and a block reduction, then one atomicMax per output (every value is
// >= +0 and not NaN, so the float maximum is the maximum of the bit
// patterns). Every thread of the CTA calls it.
__device__ __forceinline__ void StoreAmaxPair(float plain, float transformed,
                                              float* out) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    plain = fmaxf(plain, __shfl_xor_sync(0xFFFFFFFFu, plain, offset));
    transformed =
        fmaxf(transformed, __shfl_xor_sync(0xFFFFFFFFu, transformed, offset));
  }
  __shared__ float partial[2][kThreads / 32];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    partial[0][warp] = plain;
    partial[1][warp] = transformed;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 1; i < kThreads / 32; ++i) {
      plain = fmaxf(plain, partial[0][i]);
      transformed = fmaxf(transformed, partial[1][i]);
    }
    unsigned int* bits = reinterpret_cast<unsigned int*>(out);
    atomicMax(bits, FloatBits(plain));
    atomicMax(bits + 1, FloatBits(transformed));
  }
}

template <InType T, bool kAlongK>
__global__ void __launch_bounds__(kThreads) AmaxKernel(const AmaxArgs args) {
  const int64_t b = blockIdx.x / args.ctas_per_batch;
  const int64_t cta = blockIdx.x % args.ctas_per_batch;
  const int64_t base = b * args.m * args.k;
  float plain = 0.0f, transformed = 0.0f;
  for (int64_t c = cta * kThreads + threadIdx.x; c < args.chunks;
       c += args.ctas_per_batch * kThreads) {
    float v[kBlock];
    if (kAlongK) {
      uint32_t w[kWords<T>];
      LoadBlockWords<T>(args.x, base + c * kBlock, kBlock, args.x_vec, w);
      WordsToFloats<T>(w, v);
    } else {
      const int64_t mb = Div(c, args.k);
      const int64_t col = c - mb * args.k;
      uint32_t w[kWords<T>];
#pragma unroll
      for (int j = 0; j < kWords<T>; ++j) w[j] = 0;
#pragma unroll
      for (int j = 0; j < kBlock; ++j) {
        const uint32_t e =
            LoadRawElement<T>(args.x, base + (mb * kBlock + j) * args.k + col);
        if constexpr (In<T>::kBytes == 4) {
          w[j] = e;
        } else {
          w[j >> 1] |= e << (16 * (j & 1));
        }
      }
      WordsToFloats<T>(w, v);
    }
    float y[kBlock];
    RandomHadamard16Fast(v, y);
#pragma unroll
    for (int i = 0; i < kBlock; ++i) {
      plain = fmaxf(plain, fabsf(v[i]));
      transformed = fmaxf(transformed, fabsf(y[i]));
    }
  }
  StoreAmaxPair(plain, transformed, args.out + 2 * b);
}

// ---------------------------------------------------------------------------
// AmaxColumnsBf16Kernel: AmaxKernel<kBf16, false> (the recipe's columns: the
// transform along m, the token axis) for a 16-byte aligned x with k % 8 ==
// 0. A thread's chunk is 16 rows x 8 columns, read with 16 16-byte loads
// (a warp reads 512 contiguous bytes of each row) instead of 16 2-byte
// loads per column. Fewer instructions per column, both exact:
//   * the butterfly's last stage and the maximum of its two results:
//     max(|a + b|, |a - b|) = |a| + |b| as float sums (rounding is
//     symmetric and monotonic; infinities and NaN give the same maximum with
//     NaN ignored);
//   * the bfloat16 rounding once, of the thread's maximum: rounding (with
//     subnormals flushed) is monotonic, so max |bf16(y)| = bf16(max |y|).
// ---------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads)
    AmaxColumnsBf16Kernel(const AmaxArgs args) {
  const int64_t b = blockIdx.x / args.ctas_per_batch;
  const int64_t cta = blockIdx.x % args.ctas_per_batch;
  const int64_t groups = args.k / 8;  // 16-byte column groups per row
  const int64_t chunks = args.m / kBlock * groups;
  const uint4* const x =
      static_cast<const uint4*>(args.x) + b * args.m * groups;
  float plain = 0.0f, transformed = 0.0f;
  for (int64_t c = cta * kThreads + threadIdx.x; c < chunks;
       c += args.ctas_per_batch * kThreads) {
    const int64_t mb = Div(c, groups);
    const uint4* const p = x + mb * kBlock * groups + (c - mb * groups);
    uint4 q[kBlock];
#pragma unroll
    for (int r = 0; r < kBlock; ++r) q[r] = __ldg(p + r * groups);
#pragma unroll
    for (int word = 0; word < 4; ++word) {
      uint32_t w[kBlock];
#pragma unroll
      for (int r = 0; r < kBlock; ++r) {
        w[r] = word == 0   ? q[r].x
               : word == 1 ? q[r].y
               : word == 2 ? q[r].z
                           : q[r].w;
      }
#pragma unroll
      for (int s = 0; s < 2; ++s) {  // column 2 * word + s
        float z[kBlock];
#pragma unroll
        for (int r = 0; r < kBlock; ++r) {
          const float v = BitsToFloat(s == 0 ? w[r] << 16 : w[r] & 0xFFFF0000u);
          plain = fmaxf(plain, fabsf(v));
          z[r] = v * (((kRhtSignMask >> r) & 1u) ? -0.25f : 0.25f);
        }
        // HadamardButterfly16's stages h = 1, 2, 4; then the last one's
        // maxima.
        ButterflyStages(z, /*end=*/kBlock / 2);
#pragma unroll
        for (int i = 0; i < kBlock / 2; ++i) {
          transformed = fmaxf(transformed, fabsf(z[i]) + fabsf(z[i + 8]));
        }
      }
    }
  }
  transformed = __bfloat162float(__float2bfloat16_rn(transformed));
  StoreAmaxPair(plain, transformed, args.out + 2 * b);
}

// ---------------------------------------------------------------------------
// DecodeBf16Kernel: out = e2m1(code) * E4M3 block scale as bfloat16, without
// the amax -- the operands of the Hopper GEMM (jax_nvfp4/cuda_gemm.py), the
// same values as its pure-JAX twin decode_bf16. Every such product is exact
// in bfloat16 (2 + 4 significant bits; 2^-10 .. 2688). Lane q takes the 8
// elements of 4 code bytes (half a block): its 16-byte store lies next to
// its neighbours', so a warp writes 512 contiguous bytes; kDecodeUnroll
// such groups per lane are loaded before any is decoded (DecodeCodes8Bf16).
// ---------------------------------------------------------------------------
constexpr int kDecodeUnroll = 4;

__device__ __forceinline__ uint4 DecodeHalfBlockBf16(uint32_t codes,
                                                     uint8_t scale_byte) {
  return DecodeCodes8Bf16(codes, ScaleBf16Pair(E4M3Decode(scale_byte)));
}

__global__ void __launch_bounds__(kThreads)
    DecodeBf16Kernel(const uint32_t* codes, const uint8_t* scales, uint4* out,
                     int64_t groups) {
  // Lane t takes groups t, t + stride, ... (kDecodeUnroll of them per loop
  // step); the host's grid covers every group in one step (GridFor allows
  // 2^31 - 1 CTAs), so the loop runs once but stays correct for any grid.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t first =
           static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
       first < groups; first += kDecodeUnroll * stride) {
    uint32_t c[kDecodeUnroll];
    uint8_t s[kDecodeUnroll];
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      const int64_t q = first + u * stride;
      if (q < groups) {
        c[u] = __ldg(codes + q);
        s[u] = __ldg(scales + q / 2);
      }
    }
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      const int64_t q = first + u * stride;
      if (q < groups) out[q] = DecodeHalfBlockBf16(c[u], s[u]);
    }
  }
}

// ---------------------------------------------------------------------------
// DequantizeKernel: codes [batch, rows, len / 2], scales [batch, rows,
// len / 16] -> out [batch, rows, len]. Thread i takes the 16-element block i.
// ---------------------------------------------------------------------------
struct DequantizeArgs {
  const uint8_t* codes;
  const uint8_t* scales;
  const float* amax;
  int64_t blocks;            // batch * rows * len / 16
  int64_t blocks_per_batch;  // rows * len / 16
  int64_t batch_per_amax;
  bool codes_aligned;         // 8-byte aligned
  bool out_aligned;           // 16-byte aligned
  uint32_t host_default_nan;  // what 0 * inf gives on the host CPU
  void* out;
};

// float32 NaN results carry bits that differ between processors: a GPU
// writes 0x7FFFFFFF, x86-64 the "default NaN" 0xFFC00000 for an invalid
// operation (0 * inf) and the quieted operand when one operand is NaN. A
// dequantized value is NaN only through amax (NaN: propagated, quieted) or
// 0 * inf (default NaN), so the CPU handler's bits are reproduced exactly.
__device__ __forceinline__ float HostNan(float amax, uint32_t default_nan) {
  return BitsToFloat(amax != amax ? FloatBits(amax) | 0x00400000u
                                  : default_nan);
}

template <bool kBf16Out>
__global__ void __launch_bounds__(kThreads)
    DequantizeKernel(const DequantizeArgs args) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
       i < args.blocks; i += stride) {
    const int64_t b = Div(i, args.blocks_per_batch);
    const float a = args.amax[Div(b, args.batch_per_amax)];
    const float multiplier =
        BlockDecodeMultiplier(E4M3Decode(args.scales[i]), a);
    uint64_t packed = 0;
    if (args.codes_aligned) {
      packed = reinterpret_cast<const uint64_t*>(args.codes)[i];
    } else {
#pragma unroll
      for (int byte = 0; byte < 8; ++byte) {
        packed |= static_cast<uint64_t>(args.codes[8 * i + byte]) << (8 * byte);
      }
    }
    float v[kBlock];
#pragma unroll
    for (int j = 0; j < kBlock; ++j) {
      v[j] = E2M1Decode(static_cast<uint32_t>(packed >> (4 * j)) & 0xFu) *
             multiplier;
    }
    if (kBf16Out) {
      uint32_t w[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        w[j] = static_cast<uint32_t>(FloatToBfloat16Bits(v[2 * j])) |
               (static_cast<uint32_t>(FloatToBfloat16Bits(v[2 * j + 1])) << 16);
      }
      uint16_t* out = static_cast<uint16_t*>(args.out) + kBlock * i;
      if (args.out_aligned) {
        uint4* p = reinterpret_cast<uint4*>(out);
        p[0] = make_uint4(w[0], w[1], w[2], w[3]);
        p[1] = make_uint4(w[4], w[5], w[6], w[7]);
      } else {
#pragma unroll
        for (int j = 0; j < kBlock; ++j) {
          out[j] = static_cast<uint16_t>(w[j >> 1] >> (16 * (j & 1)));
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kBlock; ++j) {
        if (v[j] != v[j]) v[j] = HostNan(a, args.host_default_nan);
      }
      float* out = static_cast<float*>(args.out) + kBlock * i;
      if (args.out_aligned) {
        float4* p = reinterpret_cast<float4*>(out);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          p[c] =
              make_float4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kBlock; ++j) out[j] = v[j];
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------
// The NaN that the host CPU makes of 0 * inf (0xFFC00000 on x86-64,
// 0x7FC00000 on Arm), computed at run time (volatile: not folded).
uint32_t HostDefaultNanBits() {
  volatile float zero = 0.0f;
  volatile float inf = INFINITY;
  const float nan = zero * inf;
  uint32_t bits;
  std::memcpy(&bits, &nan, sizeof(bits));
  return bits;
}

bool IsAligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

unsigned int GridFor(int64_t work_items) {
  return static_cast<unsigned int>(std::min<int64_t>(
      std::max<int64_t>((work_items + kThreads - 1) / kThreads, 1), kMaxGrid));
}

// Grid of a persistent kernel: as many CTAs as fit on the device at once
// (at least 1), and no more than there is work for.
template <typename Kernel>
unsigned int PersistentGrid(Kernel kernel, int64_t work_ctas) {
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads,
                                                    0) != cudaSuccess) {
    cudaGetLastError();  // clear it; fall back to a fixed grid
    sms = 132;
    per_sm = 2;
  }
  const int64_t resident =
      static_cast<int64_t>(std::max(sms, 1)) * std::max(per_sm, 1);
  return static_cast<unsigned int>(
      std::max<int64_t>(1, std::min(work_ctas, resident)));
}

ffi::Error LaunchError(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jax_nvfp4: ") + what +
                          " kernel launch failed: " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// Validates x and one output exactly as the CPU handler does.
ffi::Error CheckQuantize(const ffi::AnyBuffer& x, bool transpose,
                         const ffi::Buffer<ffi::F32>& amax,
                         const ffi::Buffer<ffi::U32>& key,
                         const QuantizeOptions& options,
                         ffi::Result<ffi::Buffer<ffi::U8>>& codes,
                         ffi::Result<ffi::AnyBuffer>& scales, MatrixDims* d) {
  if (!IsSupportedInputType(x.element_type())) {
    return InvalidArgument("input must be float32, bfloat16 or float16");
  }
  if (!Rank3Dims(x, d)) return InvalidArgument("expected a rank-3 input");
  const int64_t rows = transpose ? d->k : d->m;
  const int64_t len = transpose ? d->m : d->k;
  if (auto e = CheckQuantizeOperands(d->batch, rows, len, options, amax, key);
      e.failure()) {
    return e;
  }
  return CheckOutputSizes(d->batch, rows, len, codes, scales);
}

// CheckQuantize plus the shard placement (the origin itself is on the device).
ffi::Error CheckQuantizePlaced(
    const ffi::AnyBuffer& x, bool transpose, const ffi::Buffer<ffi::F32>& amax,
    const ffi::Buffer<ffi::U32>& key, const ffi::Buffer<ffi::S32>& origin,
    const GlobalPlace& place, const QuantizeOptions& options,
    ffi::Result<ffi::Buffer<ffi::U8>>& codes,
    ffi::Result<ffi::AnyBuffer>& scales, MatrixDims* d) {
  if (auto e =
          CheckQuantize(x, transpose, amax, key, options, codes, scales, d);
      e.failure()) {
    return e;
  }
  return CheckPlace(*d, origin, place);
}

// One output's arguments; `codes`: the codes, or, `decoded`, the bfloat16
// values (see OutputArgs).
OutputArgs MakeOutputArgs(const MatrixDims& d,
                          const ffi::Buffer<ffi::F32>& amax,
                          const ffi::Buffer<ffi::S32>& origin,
                          const GlobalPlace& place, bool transposed,
                          const QuantizeOptions& options, void* codes,
                          void* scales, bool decoded = false) {
  OutputArgs o;
  o.codes = static_cast<uint8_t*>(codes);
  o.scales = static_cast<uint8_t*>(scales);
  o.amax = amax.typed_data();
  o.batch_per_amax = d.batch / static_cast<int64_t>(amax.element_count());
  o.stream = static_cast<uint32_t>(options.stream);
  o.tile16 = options.tile_rows == 16;
  o.stochastic = options.stochastic;
  o.rht = options.rht;
  o.codes_aligned = IsAligned(o.codes, decoded ? 16 : 8);
  o.decoded = decoded;
  o.origin = origin.typed_data();
  o.place = place;
  o.transposed = transposed;
  return o;
}

KeyArgs MakeKeyArgs(const MatrixDims& d, const ffi::Buffer<ffi::U32>& key) {
  return KeyArgs{key.typed_data(),
                 d.batch / static_cast<int64_t>(key.element_count() / 2)};
}

template <InType T, bool kRows, bool kCols>
void LaunchTileKernel(cudaStream_t stream, const TileArgs& args) {
  const auto kernel = QuantizeTileKernel<T, kRows, kCols>;
  kernel<<<PersistentGrid(kernel, args.tiles), kThreads, 0, stream>>>(args);
}

// Whether QuantizePrivateTileKernel has an instantiation for these options
// (row stochastic, column RHT, column stochastic, 16x16 blocks).
constexpr bool PrivateTileOptionsValid(bool /*row_stochastic*/, bool col_rht,
                                       bool /*col_stochastic*/, bool tile16) {
  return !(tile16 && col_rht);
}

// Whether QuantizePrivateTileKernel serves these arguments (see there).
bool PrivateTileApplies(ffi::DataType type, const TileArgs& args) {
  return type == ffi::DataType::BF16 && args.x_vec && args.m % kBlock == 0 &&
         args.k % kBlock == 0 && args.row.tile16 == args.col.tile16 &&
         PrivateTileOptionsValid(args.row.stochastic, args.col.rht,
                                 args.col.stochastic, args.col.tile16) &&
         !args.row.rht && args.row.codes_aligned && args.col.codes_aligned;
}

// Launches QuantizePrivateTileKernel<kOptions...> once every option (row
// stochastic, column RHT, column stochastic, 16x16 blocks, in that order) is
// a constant: each call turns the next runtime flag into a template argument.
// Invalid combinations never come here (PrivateTileApplies checks the same
// PrivateTileOptionsValid) and are not instantiated.
template <bool... kOptions, typename... Flags>
void LaunchPrivateTile(cudaStream_t stream, TileArgs args, Flags... flags) {
  if constexpr (sizeof...(Flags) == 0) {
    args.m_tiles = (args.m + kPrivTileM - 1) / kPrivTileM;
    args.k_tiles = (args.k + kPrivTileK - 1) / kPrivTileK;
    args.tiles = args.batch * args.m_tiles * args.k_tiles;
    if constexpr (PrivateTileOptionsValid(kOptions...)) {
      const auto grid =
          static_cast<unsigned int>(std::min(args.tiles, kMaxGrid));
      QuantizePrivateTileKernel<kOptions...>
          <<<grid, kPrivThreads, 0, stream>>>(args);
    }
  } else {
    [&](bool flag, auto... rest) {
      if (flag) {
        LaunchPrivateTile<kOptions..., true>(stream, args, rest...);
      } else {
        LaunchPrivateTile<kOptions..., false>(stream, args, rest...);
      }
    }(flags...);
  }
}

template <bool kRows, bool kCols>
ffi::Error LaunchTile(cudaStream_t stream, ffi::DataType type,
                      const TileArgs& args) {
  if (kRows && kCols && PrivateTileApplies(type, args)) {
    LaunchPrivateTile(stream, args, args.row.stochastic, args.col.rht,
                      args.col.stochastic, args.col.tile16);
    return LaunchError("quantize");
  }
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
  return LaunchError("quantize");
}

TileArgs MakeTileArgs(const ffi::AnyBuffer& x, const MatrixDims& d,
                      const ffi::Buffer<ffi::U32>& key) {
  TileArgs t{};
  t.x = x.untyped_data();
  t.batch = d.batch;
  t.m = d.m;
  t.k = d.k;
  t.m_tiles = (d.m + kTileM - 1) / kTileM;
  t.k_tiles = (d.k + kTileK - 1) / kTileK;
  t.tiles = d.batch * t.m_tiles * t.k_tiles;
  const int64_t bytes = ffi::ByteWidth(x.element_type());
  t.x_vec = IsAligned(t.x, 16) && (d.k * bytes) % 16 == 0;
  t.key = MakeKeyArgs(d, key);
  return t;
}

ffi::Error QuantizeRowsCuda(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax,
    ffi::Buffer<ffi::U32> key, ffi::Buffer<ffi::S32> origin,
    ffi::Result<ffi::Buffer<ffi::U8>> codes, ffi::Result<ffi::AnyBuffer> scales,
    int64_t tile_rows, bool stochastic, bool rht, int64_t stream_id,
    int64_t global_m, int64_t global_k, int64_t example_batch) {
  const GlobalPlace place{global_m, global_k, example_batch};
  const QuantizeOptions options{tile_rows, stochastic, rht, stream_id};
  MatrixDims d;
  if (auto e = CheckQuantizePlaced(x, /*transpose=*/false, amax, key, origin,
                                   place, options, codes, scales, &d);
      e.failure()) {
    return e;
  }
  RowsArgs args;
  args.x = x.untyped_data();
  args.batch = d.batch;
  args.m = d.m;
  args.k = d.k;
  args.blocks = d.batch * d.m * (d.k / kBlock);
  if (args.blocks == 0) return ffi::Error::Success();
  args.x_vec = IsAligned(args.x, 16);
  args.key = MakeKeyArgs(d, key);
  args.out = MakeOutputArgs(d, amax, origin, place, false, options,
                            codes->typed_data(), scales->untyped_data());
  const int64_t ctas = (args.blocks + kThreads - 1) / kThreads;
  switch (x.element_type()) {
    case ffi::DataType::BF16: {
      const auto kernel = QuantizeRowsKernel<InType::kBf16>;
      kernel<<<PersistentGrid(kernel, ctas), kThreads, 0, stream>>>(args);
      break;
    }
    case ffi::DataType::F16: {
      const auto kernel = QuantizeRowsKernel<InType::kF16>;
      kernel<<<PersistentGrid(kernel, ctas), kThreads, 0, stream>>>(args);
      break;
    }
    default: {
      const auto kernel = QuantizeRowsKernel<InType::kF32>;
      kernel<<<PersistentGrid(kernel, ctas), kThreads, 0, stream>>>(args);
      break;
    }
  }
  return LaunchError("quantize_rows");
}

ffi::Error QuantizeColsCuda(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax,
    ffi::Buffer<ffi::U32> key, ffi::Buffer<ffi::S32> origin,
    ffi::Result<ffi::Buffer<ffi::U8>> codes, ffi::Result<ffi::AnyBuffer> scales,
    int64_t tile_rows, bool stochastic, bool rht, int64_t stream_id,
    int64_t global_m, int64_t global_k, int64_t example_batch) {
  const GlobalPlace place{global_m, global_k, example_batch};
  const QuantizeOptions options{tile_rows, stochastic, rht, stream_id};
  MatrixDims d;
  if (auto e = CheckQuantizePlaced(x, /*transpose=*/true, amax, key, origin,
                                   place, options, codes, scales, &d);
      e.failure()) {
    return e;
  }
  TileArgs args = MakeTileArgs(x, d, key);
  if (args.tiles == 0) return ffi::Error::Success();
  args.col = MakeOutputArgs(d, amax, origin, place, true, options,
                            codes->typed_data(), scales->untyped_data());
  args.row = args.col;  // unused
  return LaunchTile</*kRows=*/false, /*kCols=*/true>(stream, x.element_type(),
                                                     args);
}

// One side's output of the fused quantize: the codes, or their bfloat16
// values when `decoded`, and the scales.
ffi::Error CheckDecodableOutput(int64_t batch, int64_t rows, int64_t len,
                                bool decoded,
                                ffi::Result<ffi::AnyBuffer>& values,
                                ffi::Result<ffi::AnyBuffer>& scales) {
  const int64_t n = batch * rows * len;
  if (values->element_type() !=
          (decoded ? ffi::DataType::BF16 : ffi::DataType::U8) ||
      static_cast<int64_t>(values->element_count()) != (decoded ? n : n / 2) ||
      scales->element_type() != ffi::DataType::F8E4M3FN ||
      static_cast<int64_t>(scales->element_count()) != n / kBlock) {
    return InvalidArgument(
        "outputs must be bfloat16 values [b, rows, len] (decoded) or uint8 "
        "codes [b, rows, len/2], and float8_e4m3fn scales [b, rows, len/16]");
  }
  if (decoded && !IsAligned(values->untyped_data(), 16)) {
    return InvalidArgument("decoded outputs must be 16-byte aligned");
  }
  return ffi::Error::Success();
}

// The fused row-wise + column-wise quantize. Either output (`row_decoded`,
// `col_decoded`) can be written as the bfloat16 operand of the Hopper GEMM,
// e2m1(code) * scale, instead of its codes: the values the GEMM's decode
// (DecodeBf16Kernel) would make of them, without the codes' round trip
// through memory -- only where QuantizePrivateTileKernel applies. The codes
// handler is this with neither decoded.
ffi::Error QuantizeRowsColsDecodedCuda(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> row_amax,
    ffi::Buffer<ffi::F32> col_amax, ffi::Buffer<ffi::U32> key,
    ffi::Buffer<ffi::S32> origin, ffi::Result<ffi::AnyBuffer> row_values,
    ffi::Result<ffi::AnyBuffer> row_scales,
    ffi::Result<ffi::AnyBuffer> col_values,
    ffi::Result<ffi::AnyBuffer> col_scales, int64_t row_tile_rows,
    bool row_stochastic, bool row_rht, int64_t row_stream, bool row_decoded,
    int64_t col_tile_rows, bool col_stochastic, bool col_rht,
    int64_t col_stream, bool col_decoded, int64_t global_m, int64_t global_k,
    int64_t example_batch) {
  const GlobalPlace place{global_m, global_k, example_batch};
  const QuantizeOptions rows{row_tile_rows, row_stochastic, row_rht,
                             row_stream};
  const QuantizeOptions cols{col_tile_rows, col_stochastic, col_rht,
                             col_stream};
  if (!IsSupportedInputType(x.element_type())) {
    return InvalidArgument("input must be float32, bfloat16 or float16");
  }
  MatrixDims d;
  if (!Rank3Dims(x, &d)) return InvalidArgument("expected a rank-3 input");
  for (auto e : {CheckQuantizeOperands(d.batch, d.m, d.k, rows, row_amax, key),
                 CheckQuantizeOperands(d.batch, d.k, d.m, cols, col_amax, key),
                 CheckDecodableOutput(d.batch, d.m, d.k, row_decoded,
                                      row_values, row_scales),
                 CheckDecodableOutput(d.batch, d.k, d.m, col_decoded,
                                      col_values, col_scales),
                 CheckPlace(d, origin, place)}) {
    if (e.failure()) return e;
  }
  TileArgs args = MakeTileArgs(x, d, key);
  if (args.tiles == 0) return ffi::Error::Success();
  args.row = MakeOutputArgs(d, row_amax, origin, place, false, rows,
                            row_values->untyped_data(),
                            row_scales->untyped_data(), row_decoded);
  args.col = MakeOutputArgs(d, col_amax, origin, place, true, cols,
                            col_values->untyped_data(),
                            col_scales->untyped_data(), col_decoded);
  if ((row_decoded || col_decoded) &&
      !PrivateTileApplies(x.element_type(), args)) {
    return InvalidArgument(
        "decoded outputs need a bfloat16 x, 16-byte aligned, with m and k "
        "multiples of 16, no RHT on the rows and the same block shape both "
        "ways (16x16 only without column RHT); quantize and decode instead");
  }
  return LaunchTile</*kRows=*/true, /*kCols=*/true>(stream, x.element_type(),
                                                    args);
}

ffi::Error QuantizeRowsColsCuda(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> row_amax,
    ffi::Buffer<ffi::F32> col_amax, ffi::Buffer<ffi::U32> key,
    ffi::Buffer<ffi::S32> origin, ffi::Result<ffi::AnyBuffer> row_codes,
    ffi::Result<ffi::AnyBuffer> row_scales,
    ffi::Result<ffi::AnyBuffer> col_codes,
    ffi::Result<ffi::AnyBuffer> col_scales, int64_t row_tile_rows,
    bool row_stochastic, bool row_rht, int64_t row_stream,
    int64_t col_tile_rows, bool col_stochastic, bool col_rht,
    int64_t col_stream, int64_t global_m, int64_t global_k,
    int64_t example_batch) {
  return QuantizeRowsColsDecodedCuda(
      stream, x, row_amax, col_amax, key, origin, row_codes, row_scales,
      col_codes, col_scales, row_tile_rows, row_stochastic, row_rht, row_stream,
      /*row_decoded=*/false, col_tile_rows, col_stochastic, col_rht, col_stream,
      /*col_decoded=*/false, global_m, global_k, example_batch);
}

ffi::Error AmaxCuda(cudaStream_t stream, ffi::AnyBuffer x,
                    ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t rht_axis) {
  if (!IsSupportedInputType(x.element_type())) {
    return InvalidArgument("input must be float32, bfloat16 or float16");
  }
  MatrixDims d;
  if (!Rank3Dims(x, &d)) return InvalidArgument("expected a rank-3 input");
  if (rht_axis != 1 && rht_axis != 2)
    return InvalidArgument("rht_axis is 1 or 2");
  if ((rht_axis == 1 ? d.m : d.k) % kBlock != 0) {
    return InvalidArgument("the transformed axis must be a multiple of 16");
  }
  if (out->element_count() != 2 * d.batch) {
    return InvalidArgument("output must be [batch, 2]");
  }
  if (d.batch == 0) return ffi::Error::Success();
  float* out_data = out->typed_data();
  if (const cudaError_t err =
          cudaMemsetAsync(out_data, 0, 2 * d.batch * sizeof(float), stream);
      err != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jax_nvfp4: amax memset failed: ") +
                          cudaGetErrorString(err));
  }
  AmaxArgs args;
  args.x = x.untyped_data();
  args.m = d.m;
  args.k = d.k;
  args.chunks = d.m * d.k / kBlock;
  if (args.chunks == 0) return ffi::Error::Success();
  args.x_vec = IsAligned(args.x, 16);
  args.out = out_data;
  const bool along_k = rht_axis == 2;
  // The recipe's columns in bfloat16, 16-byte aligned rows: chunks of 16 rows
  // x 8 columns (AmaxColumnsBf16Kernel).
  const bool columns_bf16 = !along_k &&
                            x.element_type() == ffi::DataType::BF16 &&
                            args.x_vec && d.k % 8 == 0;
  const int64_t thread_chunks = columns_bf16 ? args.chunks / 8 : args.chunks;
  // About 4 waves of CTAs in all (at least one per batch item), each CTA
  // striding over the chunks of its batch item.
  const int64_t wanted = std::max<int64_t>(1, 4096 / d.batch);
  args.ctas_per_batch =
      std::min<int64_t>((thread_chunks + kThreads - 1) / kThreads, wanted);
  args.ctas_per_batch =
      std::min<int64_t>(args.ctas_per_batch, kMaxGrid / d.batch);
  if (args.ctas_per_batch < 1) {
    return InvalidArgument("batch too large for the amax kernel grid");
  }
  const unsigned int grid =
      static_cast<unsigned int>(d.batch * args.ctas_per_batch);
  if (columns_bf16) {
    AmaxColumnsBf16Kernel<<<grid, kThreads, 0, stream>>>(args);
    return LaunchError("amax");
  }
#define JAX_NVFP4_LAUNCH_AMAX(T)                               \
  if (along_k) {                                               \
    AmaxKernel<T, true><<<grid, kThreads, 0, stream>>>(args);  \
  } else {                                                     \
    AmaxKernel<T, false><<<grid, kThreads, 0, stream>>>(args); \
  }
  switch (x.element_type()) {
    case ffi::DataType::BF16:
      JAX_NVFP4_LAUNCH_AMAX(InType::kBf16);
      break;
    case ffi::DataType::F16:
      JAX_NVFP4_LAUNCH_AMAX(InType::kF16);
      break;
    default:
      JAX_NVFP4_LAUNCH_AMAX(InType::kF32);
      break;
  }
#undef JAX_NVFP4_LAUNCH_AMAX
  return LaunchError("amax");
}

ffi::Error DequantizeCuda(cudaStream_t stream, ffi::Buffer<ffi::U8> codes,
                          ffi::AnyBuffer scales, ffi::Buffer<ffi::F32> amax,
                          ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = out->dimensions();
  if (dims.size() != 3) return InvalidArgument("expected a rank-3 output");
  const int64_t batch = dims[0], rows = dims[1], len = dims[2];
  const int64_t n_amax = amax.element_count();
  if (len % kBlock != 0 || codes.element_count() != batch * rows * len / 2 ||
      scales.element_count() != batch * rows * len / kBlock ||
      scales.element_type() != ffi::DataType::F8E4M3FN || n_amax < 1 ||
      batch % n_amax != 0) {
    return InvalidArgument("dequantize operands have inconsistent shapes");
  }
  const ffi::DataType out_type = out->element_type();
  if (out_type != ffi::DataType::F32 && out_type != ffi::DataType::BF16) {
    return InvalidArgument("dequantize output must be float32 or bfloat16");
  }
  DequantizeArgs args;
  args.codes = codes.typed_data();
  args.scales = static_cast<const uint8_t*>(scales.untyped_data());
  args.amax = amax.typed_data();
  args.blocks = batch * rows * len / kBlock;
  if (args.blocks == 0) return ffi::Error::Success();
  args.blocks_per_batch = rows * len / kBlock;
  args.batch_per_amax = batch / n_amax;
  args.codes_aligned = IsAligned(args.codes, 8);
  args.out = out->untyped_data();
  args.out_aligned = IsAligned(args.out, 16);
  args.host_default_nan = HostDefaultNanBits();
  const unsigned int grid = GridFor(args.blocks);
  if (out_type == ffi::DataType::BF16) {
    DequantizeKernel<true><<<grid, kThreads, 0, stream>>>(args);
  } else {
    DequantizeKernel<false><<<grid, kThreads, 0, stream>>>(args);
  }
  return LaunchError("dequantize");
}

// The Hopper GEMM's operand decode (DecodeBf16Kernel): codes uint8 [n / 2],
// scales float8_e4m3fn [n / 16] -> bfloat16 [n], any shapes of those sizes.
ffi::Error DecodeBf16Cuda(cudaStream_t stream, ffi::Buffer<ffi::U8> codes,
                          ffi::AnyBuffer scales,
                          ffi::Result<ffi::Buffer<ffi::BF16>> out) {
  const int64_t n = out->element_count();
  if (n % kBlock != 0 || codes.element_count() * 2 != n ||
      scales.element_count() * kBlock != n ||
      scales.element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArgument(
        "decode_bf16 expects codes of n/2 bytes, float8_e4m3fn scales of "
        "n/16 and a bfloat16 output of n elements, n a multiple of 16");
  }
  if (n == 0) return ffi::Error::Success();
  // XLA buffers are at least 16-byte aligned; checked, not assumed.
  if (!IsAligned(codes.typed_data(), 4) || !IsAligned(out->typed_data(), 16)) {
    return InvalidArgument(
        "decode_bf16 needs 4-byte aligned codes and a "
        "16-byte aligned output");
  }
  const int64_t groups = n / 8;
  DecodeBf16Kernel<<<GridFor((groups + kDecodeUnroll - 1) / kDecodeUnroll),
                     kThreads, 0, stream>>>(
      reinterpret_cast<const uint32_t*>(codes.typed_data()),
      static_cast<const uint8_t*>(scales.untyped_data()),
      reinterpret_cast<uint4*>(out->typed_data()), groups);
  return LaunchError("decode_bf16");
}

}  // namespace
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4QuantizeRowsCuda, jax_nvfp4::QuantizeRowsCuda,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // CUDA stream
        .Arg<ffi::AnyBuffer>()                     // x [b, m, k]
        .Arg<ffi::Buffer<ffi::F32>>()              // amax [n]
        .Arg<ffi::Buffer<ffi::U32>>()              // key [n, 2]
        .Arg<ffi::Buffer<ffi::S32>>()              // origin [3]
        .Ret<ffi::Buffer<ffi::U8>>()               // codes [b, m, k/2]
        .Ret<ffi::AnyBuffer>()                     // scales [b, m, k/16]
        .Attr<int64_t>("tile_rows")
        .Attr<bool>("stochastic")
        .Attr<bool>("rht")
        .Attr<int64_t>("stream")
        .Attr<int64_t>("global_m")
        .Attr<int64_t>("global_k")
        .Attr<int64_t>("example_batch"),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4QuantizeColsCuda, jax_nvfp4::QuantizeColsCuda,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // CUDA stream
        .Arg<ffi::AnyBuffer>()                     // x [b, m, k]
        .Arg<ffi::Buffer<ffi::F32>>()              // amax [n]
        .Arg<ffi::Buffer<ffi::U32>>()              // key [n, 2]
        .Arg<ffi::Buffer<ffi::S32>>()              // origin [3]
        .Ret<ffi::Buffer<ffi::U8>>()               // codes [b, k, m/2]
        .Ret<ffi::AnyBuffer>()                     // scales [b, k, m/16]
        .Attr<int64_t>("tile_rows")
        .Attr<bool>("stochastic")
        .Attr<bool>("rht")
        .Attr<int64_t>("stream")
        .Attr<int64_t>("global_m")
        .Attr<int64_t>("global_k")
        .Attr<int64_t>("example_batch"),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4QuantizeRowsColsCuda, jax_nvfp4::QuantizeRowsColsCuda,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // CUDA stream
        .Arg<ffi::AnyBuffer>()                     // x [b, m, k]
        .Arg<ffi::Buffer<ffi::F32>>()              // row amax
        .Arg<ffi::Buffer<ffi::F32>>()              // col amax
        .Arg<ffi::Buffer<ffi::U32>>()              // key [n, 2]
        .Arg<ffi::Buffer<ffi::S32>>()              // origin [3]
        .Ret<ffi::AnyBuffer>()                     // row codes (uint8)
        .Ret<ffi::AnyBuffer>()                     // row scales
        .Ret<ffi::AnyBuffer>()                     // col codes (uint8)
        .Ret<ffi::AnyBuffer>()                     // col scales
        .Attr<int64_t>("row_tile_rows")
        .Attr<bool>("row_stochastic")
        .Attr<bool>("row_rht")
        .Attr<int64_t>("row_stream")
        .Attr<int64_t>("col_tile_rows")
        .Attr<bool>("col_stochastic")
        .Attr<bool>("col_rht")
        .Attr<int64_t>("col_stream")
        .Attr<int64_t>("global_m")
        .Attr<int64_t>("global_k")
        .Attr<int64_t>("example_batch"),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4QuantizeRowsColsDecodedCuda, jax_nvfp4::QuantizeRowsColsDecodedCuda,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // CUDA stream
        .Arg<ffi::AnyBuffer>()                     // x [b, m, k]
        .Arg<ffi::Buffer<ffi::F32>>()              // row amax
        .Arg<ffi::Buffer<ffi::F32>>()              // col amax
        .Arg<ffi::Buffer<ffi::U32>>()              // key [n, 2]
        .Arg<ffi::Buffer<ffi::S32>>()              // origin [3]
        .Ret<ffi::AnyBuffer>()  // row codes, or bf16 values [b, m, k]
        .Ret<ffi::AnyBuffer>()  // row scales
        .Ret<ffi::AnyBuffer>()  // col codes, or bf16 values [b, k, m]
        .Ret<ffi::AnyBuffer>()  // col scales
        .Attr<int64_t>("row_tile_rows")
        .Attr<bool>("row_stochastic")
        .Attr<bool>("row_rht")
        .Attr<int64_t>("row_stream")
        .Attr<bool>("row_decoded")
        .Attr<int64_t>("col_tile_rows")
        .Attr<bool>("col_stochastic")
        .Attr<bool>("col_rht")
        .Attr<int64_t>("col_stream")
        .Attr<bool>("col_decoded")
        .Attr<int64_t>("global_m")
        .Attr<int64_t>("global_k")
        .Attr<int64_t>("example_batch"),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4AmaxCuda, jax_nvfp4::AmaxCuda,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // CUDA stream
        .Arg<ffi::AnyBuffer>()                     // x [b, m, k]
        .Ret<ffi::Buffer<ffi::F32>>()              // [b, 2]
        .Attr<int64_t>("rht_axis"),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4DequantizeCuda, jax_nvfp4::DequantizeCuda,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // CUDA stream
        .Arg<ffi::Buffer<ffi::U8>>()               // codes
        .Arg<ffi::AnyBuffer>()                     // e4m3 scales
        .Arg<ffi::Buffer<ffi::F32>>()              // amax [n]
        .Ret<ffi::AnyBuffer>(),                    // [b, r, l]
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4DecodeBf16Cuda, jax_nvfp4::DecodeBf16Cuda,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // CUDA stream
        .Arg<ffi::Buffer<ffi::U8>>()               // codes
        .Arg<ffi::AnyBuffer>()                     // e4m3 scales
        .Ret<ffi::Buffer<ffi::BF16>>(),            // e2m1 * scale
    {ffi::Traits::kCmdBufferCompatible});
