// CUDA XLA FFI handlers: the same bytes as the CPU handlers (cpu_handlers.cc),
// computed with the arithmetic of nvfp4_numerics.h on the device. Build with
// --fmad=false and without fast-math so that every float operation rounds as
// written (IEEE division, no FMA contraction, no flush to zero).
//
// Kernels:
//   * QuantizeTileKernel: one CTA of 256 threads per 128 (m) x 64 (k) tile of
//     x[b]; the tile is read once with 16-byte loads, quantized row-wise from
//     registers and staged (raw, XOR-swizzled) in shared memory for the
//     column-wise copy. Serves quantize_cols and the fused quantize_rows_cols.
//   * QuantizeRowsKernel: one thread per 16-element block along k.
//   * AmaxKernel: one thread per 16-element chunk along the transformed axis,
//     a block reduction, then one atomicMax per block and output.
//   * DequantizeKernel: one thread per 16-element block.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "handler_common.h"
#include "nvfp4_numerics.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

constexpr int kThreads = 256;       // threads of every CTA
constexpr int kTileM = 128;         // tile rows (m) of QuantizeTileKernel
constexpr int kTileK = 64;          // tile columns (k) of QuantizeTileKernel
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
  static __device__ __forceinline__ float Element(const uint32_t* w, int j) {
    return BitsToFloat(w[j]);
  }
};

template <>
struct In<InType::kBf16> {
  static constexpr int kBytes = 2;
  static __device__ __forceinline__ float Element(const uint32_t* w, int j) {
    return Bfloat16BitsToFloat(static_cast<uint16_t>(w[j >> 1] >> (16 * (j & 1))));
  }
};

template <>
struct In<InType::kF16> {
  static constexpr int kBytes = 2;
  static __device__ __forceinline__ float Element(const uint32_t* w, int j) {
    return Float16BitsToFloat(static_cast<uint16_t>(w[j >> 1] >> (16 * (j & 1))));
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
};

struct KeyArgs {
  const uint32_t* key;    // [n_key, 2]
  int64_t batch_per_key;  // batch / n_key
};

__device__ __forceinline__ float BlockAmax(const float (&v)[kBlock]) {
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) a = fmaxf(a, fabsf(v[i]));
  return a;
}

// In place: the Random Hadamard Transform of v when `rht`.
__device__ __forceinline__ void MaybeRht(bool rht, float (&v)[kBlock]) {
  if (rht) {
    float y[kBlock];
    RandomHadamard16(v, y);
#pragma unroll
    for (int i = 0; i < kBlock; ++i) v[i] = y[i];
  }
}

// Quantizes one 16-element block (already transformed) whose scale comes
// from `block_amax`, and stores its 8 code bytes and scale byte. `flat` is
// the flat index of v[0] in the quantized layout (a multiple of 16).
__device__ __forceinline__ void EncodeAndStore(const float (&v)[kBlock],
                                               float block_amax, GlobalScale g,
                                               const OutputArgs& out,
                                               uint32_t key0, uint32_t key1,
                                               uint64_t flat) {
  const float scale = BlockScale(block_amax, g);
  const float multiplier = BlockEncodeMultiplier(scale, g);
  uint64_t packed;
  if (out.stochastic) {
    const uint64_t w = flat / 8;
    const uint64_t random_lo = RandomBytes8(key0, key1, out.stream, w);
    const uint64_t random_hi = RandomBytes8(key0, key1, out.stream, w + 1);
    packed = EncodeBlock16(v, multiplier, /*stochastic=*/true, random_lo,
                           random_hi);
  } else {
    packed = EncodeBlock16(v, multiplier, /*stochastic=*/false, 0, 0);
  }
  uint8_t* codes = out.codes + flat / 2;
  if (out.codes_aligned) {
    *reinterpret_cast<uint64_t*>(codes) = packed;  // little-endian bytes
  } else {
#pragma unroll
    for (int byte = 0; byte < 8; ++byte) {
      codes[byte] = static_cast<uint8_t>(packed >> (8 * byte));
    }
  }
  out.scales[flat / kBlock] = E4M3Encode(scale);
}

__device__ __forceinline__ GlobalScale GlobalScaleOf(const OutputArgs& out,
                                                     int64_t b) {
  return GlobalScaleFromAmax(out.amax[b / out.batch_per_amax]);
}

// ---------------------------------------------------------------------------
// QuantizeTileKernel: x [batch, m, k] -> row-wise output [batch, m, k]
// (quantized along k) and/or column-wise output [batch, k, m] (along m).
//
// One CTA per kTileM x kTileK tile of one batch item (grid-stride over
// tiles). Warp w owns tile rows 16w .. 16w + 15:
//   load + row phase: lane l takes row 16w + l / 2 and the k-blocks
//     2s + l % 2 (s = 0, 1): two 16-element row blocks, read with 16-byte
//     loads, quantized from registers and stored raw into shared memory;
//   column phase: lane l takes columns 2l and 2l + 1 (two 16-element column
//     blocks, m = 16w .. 16w + 15) from shared memory.
// 16x16 tiles reduce their amax with shuffles: over lanes of equal l % 2 for
// the rows (16 rows = 16 lanes), over 8 neighbouring lanes for the columns.
//
// Shared memory holds the tile's raw bits, row r at r * kTileK elements, its
// 16-byte chunks XOR-swizzled by Swizzle(r) so that the row blocks' 16-byte
// stores of a quarter warp (4 rows) hit distinct banks; the column phase
// reads whole rows and is conflict-free under any chunk permutation.
// ---------------------------------------------------------------------------
struct TileArgs {
  const void* x;
  int64_t batch, m, k;
  int64_t m_tiles, k_tiles, tiles;
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

template <InType T, bool kRows, bool kCols>
__global__ void __launch_bounds__(kThreads)
    QuantizeTileKernel(const TileArgs args) {
  constexpr int kBytes = In<T>::kBytes;
  constexpr int kRowChunks = kTileK * kBytes / 16;  // 16-byte chunks per row
  __shared__ uint4 tile_smem[kTileM * kRowChunks];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  for (int64_t tile = blockIdx.x; tile < args.tiles; tile += gridDim.x) {
    const int64_t kt = tile % args.k_tiles;
    const int64_t rest = tile / args.k_tiles;
    const int64_t mt = rest % args.m_tiles;
    const int64_t b = rest / args.m_tiles;
    const int64_t m0 = mt * kTileM;
    const int64_t k0 = kt * kTileK;
    const int64_t kk = b / args.key.batch_per_key;
    const uint32_t key0 = args.key.key[2 * kk];
    const uint32_t key1 = args.key.key[2 * kk + 1];

    // ---- Load the two row blocks of this thread; stage them. ----
    const int r = 16 * warp + lane / 2;  // tile row
    const int64_t m = m0 + r;
    uint32_t w[2][kWords<T>];
    int count[2];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int kb = 2 * s + lane % 2;
      const int64_t kfirst = k0 + kBlock * kb;
      const int64_t left = args.k - kfirst;  // elements of this row left
      count[s] = m >= args.m || left <= 0
                     ? 0
                     : (left >= kBlock ? kBlock : static_cast<int>(left));
      LoadBlockWords<T>(args.x, (b * args.m + m) * args.k + kfirst, count[s],
                        args.x_vec, w[s]);
    }
    if (kCols) {
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int kb = 2 * s + lane % 2;
#pragma unroll
        for (int c = 0; c < kChunks<T>; ++c) {
          const int chunk = (kChunks<T> * kb + c) ^ Swizzle<T>(r);
          tile_smem[r * kRowChunks + chunk] =
              make_uint4(w[s][4 * c], w[s][4 * c + 1], w[s][4 * c + 2],
                         w[s][4 * c + 3]);
        }
      }
    }

    // ---- Row phase: quantize along k from registers. ----
    if (kRows) {
      const OutputArgs& out = args.row;
      const GlobalScale g = GlobalScaleOf(out, b);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int kb = 2 * s + lane % 2;
        float v[kBlock];
        WordsToFloats<T>(w[s], v);
        MaybeRht(out.rht, v);
        float block_amax = BlockAmax(v);
        if (out.tile16) {  // rows 16w .. 16w + 15: lanes of equal l % 2
#pragma unroll
          for (int offset = 2; offset < 32; offset *= 2) {
            block_amax = fmaxf(
                block_amax, __shfl_xor_sync(0xFFFFFFFFu, block_amax, offset));
          }
        }
        if (count[s] == kBlock) {
          const uint64_t flat = static_cast<uint64_t>(
              (b * args.m + m) * args.k + k0 + kBlock * kb);
          EncodeAndStore(v, block_amax, g, out, key0, key1, flat);
        }
      }
    }

    // ---- Column phase: quantize along m from shared memory. ----
    if (kCols) {
      __syncthreads();
      const OutputArgs& out = args.col;
      const GlobalScale g = GlobalScaleOf(out, b);
      // Columns 2 * lane and 2 * lane + 1 of rows 16w .. 16w + 15.
      float va[kBlock], vb[kBlock];
#pragma unroll
      for (int j = 0; j < kBlock; ++j) {
        const int row = 16 * warp + j;
        if constexpr (kBytes == 2) {
          const int chunk = (lane / 4) ^ Swizzle<T>(row);
          const uint32_t word = reinterpret_cast<const uint32_t*>(
              tile_smem)[(row * kRowChunks + chunk) * 4 + lane % 4];
          va[j] = In<T>::Element(&word, 0);
          vb[j] = In<T>::Element(&word, 1);
        } else {
          const int chunk = (lane / 2) ^ Swizzle<T>(row);
          const uint2 pair = reinterpret_cast<const uint2*>(
              tile_smem)[(row * kRowChunks + chunk) * 2 + lane % 2];
          va[j] = BitsToFloat(pair.x);
          vb[j] = BitsToFloat(pair.y);
        }
      }
      MaybeRht(out.rht, va);
      MaybeRht(out.rht, vb);
      float amax_a = BlockAmax(va);
      float amax_b = BlockAmax(vb);
      if (out.tile16) {  // k = 16g .. 16g + 15: lanes 8g .. 8g + 7, 2 each
        float t = fmaxf(amax_a, amax_b);
#pragma unroll
        for (int offset = 1; offset < 8; offset *= 2) {
          t = fmaxf(t, __shfl_xor_sync(0xFFFFFFFFu, t, offset));
        }
        amax_a = t;
        amax_b = t;
      }
      if (m0 + 16 * warp < args.m) {
        const int64_t ka = k0 + 2 * lane;
        const uint64_t flat_a = static_cast<uint64_t>(
            (b * args.k + ka) * args.m + m0 + 16 * warp);
        if (ka < args.k) {
          EncodeAndStore(va, amax_a, g, out, key0, key1, flat_a);
        }
        if (ka + 1 < args.k) {
          EncodeAndStore(vb, amax_b, g, out, key0, key1,
                         flat_a + static_cast<uint64_t>(args.m));
        }
      }
      __syncthreads();  // the next tile overwrites tile_smem
    }
  }
}

// ---------------------------------------------------------------------------
// QuantizeRowsKernel: x [batch, m, k] -> [batch, m, k] quantized along k.
// Thread i takes one 16-element block. 1x16: block i in memory order. 16x16:
// the 16 rows of a tile's k-block are 16 consecutive threads, which reduce
// the tile amax with shuffles inside their half warp.
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
  // blocks % 16 == 0 for 16x16 tiles, so a half warp stays together.
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
       i < args.blocks; i += stride) {
    int64_t row, kb;  // row over batch * m
    if (args.out.tile16) {
      const int64_t group = i / 16;
      row = (group / k_blocks) * 16 + i % 16;
      kb = group % k_blocks;
    } else {
      row = i / k_blocks;
      kb = i % k_blocks;
    }
    const int64_t b = row / args.m;
    const int64_t first = row * args.k + kb * kBlock;
    uint32_t w[kWords<T>];
    LoadBlockWords<T>(args.x, first, kBlock, args.x_vec, w);
    float v[kBlock];
    WordsToFloats<T>(w, v);
    MaybeRht(args.out.rht, v);
    float block_amax = BlockAmax(v);
    if (args.out.tile16) {
#pragma unroll
      for (int offset = 1; offset < 16; offset *= 2) {
        block_amax = fmaxf(block_amax,
                           __shfl_xor_sync(half_mask, block_amax, offset, 16));
      }
    }
    const int64_t kk = b / args.key.batch_per_key;
    EncodeAndStore(v, block_amax, GlobalScaleOf(args.out, b), args.out,
                   args.key.key[2 * kk], args.key.key[2 * kk + 1],
                   static_cast<uint64_t>(first));
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
      const int64_t mb = c / args.k;
      const int64_t col = c % args.k;
      uint32_t w[kWords<T>];
#pragma unroll
      for (int j = 0; j < kWords<T>; ++j) w[j] = 0;
#pragma unroll
      for (int j = 0; j < kBlock; ++j) {
        const uint32_t e = LoadRawElement<T>(
            args.x, base + (mb * kBlock + j) * args.k + col);
        if constexpr (In<T>::kBytes == 4) {
          w[j] = e;
        } else {
          w[j >> 1] |= e << (16 * (j & 1));
        }
      }
      WordsToFloats<T>(w, v);
    }
    float y[kBlock];
    RandomHadamard16(v, y);
#pragma unroll
    for (int i = 0; i < kBlock; ++i) {
      plain = fmaxf(plain, fabsf(v[i]));
      transformed = fmaxf(transformed, fabsf(y[i]));
    }
  }
  // Block reduction, then one atomic per output.
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
    unsigned int* out = reinterpret_cast<unsigned int*>(args.out + 2 * b);
    atomicMax(out, FloatBits(plain));
    atomicMax(out + 1, FloatBits(transformed));
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
  bool codes_aligned;  // 8-byte aligned
  bool out_aligned;    // 16-byte aligned
  void* out;
};

template <bool kBf16Out>
__global__ void __launch_bounds__(kThreads)
    DequantizeKernel(const DequantizeArgs args) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
       i < args.blocks; i += stride) {
    const int64_t b = i / args.blocks_per_batch;
    const float a = args.amax[b / args.batch_per_amax];
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
      float* out = static_cast<float*>(args.out) + kBlock * i;
      if (args.out_aligned) {
        float4* p = reinterpret_cast<float4*>(out);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          p[c] = make_float4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
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
bool IsAligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

unsigned int GridFor(int64_t work_items) {
  return static_cast<unsigned int>(std::min<int64_t>(
      std::max<int64_t>((work_items + kThreads - 1) / kThreads, 1), kMaxGrid));
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

OutputArgs MakeOutputArgs(const MatrixDims& d,
                          const ffi::Buffer<ffi::F32>& amax,
                          const QuantizeOptions& options,
                          ffi::Result<ffi::Buffer<ffi::U8>>& codes,
                          ffi::Result<ffi::AnyBuffer>& scales) {
  OutputArgs o;
  o.codes = codes->typed_data();
  o.scales = static_cast<uint8_t*>(scales->untyped_data());
  o.amax = amax.typed_data();
  o.batch_per_amax = d.batch / static_cast<int64_t>(amax.element_count());
  o.stream = static_cast<uint32_t>(options.stream);
  o.tile16 = options.tile_rows == 16;
  o.stochastic = options.stochastic;
  o.rht = options.rht;
  o.codes_aligned = IsAligned(o.codes, 8);
  return o;
}

KeyArgs MakeKeyArgs(const MatrixDims& d, const ffi::Buffer<ffi::U32>& key) {
  return KeyArgs{key.typed_data(),
                 d.batch / static_cast<int64_t>(key.element_count() / 2)};
}

template <bool kRows, bool kCols>
ffi::Error LaunchTile(cudaStream_t stream, ffi::DataType type,
                      const TileArgs& args) {
  const unsigned int grid =
      static_cast<unsigned int>(std::min<int64_t>(args.tiles, kMaxGrid));
  switch (type) {
    case ffi::DataType::BF16:
      QuantizeTileKernel<InType::kBf16, kRows, kCols>
          <<<grid, kThreads, 0, stream>>>(args);
      break;
    case ffi::DataType::F16:
      QuantizeTileKernel<InType::kF16, kRows, kCols>
          <<<grid, kThreads, 0, stream>>>(args);
      break;
    default:
      QuantizeTileKernel<InType::kF32, kRows, kCols>
          <<<grid, kThreads, 0, stream>>>(args);
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

ffi::Error QuantizeRowsCuda(cudaStream_t stream, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::F32> amax,
                            ffi::Buffer<ffi::U32> key,
                            ffi::Result<ffi::Buffer<ffi::U8>> codes,
                            ffi::Result<ffi::AnyBuffer> scales,
                            int64_t tile_rows, bool stochastic, bool rht,
                            int64_t stream_id) {
  const QuantizeOptions options{tile_rows, stochastic, rht, stream_id};
  MatrixDims d;
  if (auto e = CheckQuantize(x, /*transpose=*/false, amax, key, options, codes,
                             scales, &d);
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
  args.out = MakeOutputArgs(d, amax, options, codes, scales);
  const unsigned int grid = GridFor(args.blocks);
  switch (x.element_type()) {
    case ffi::DataType::BF16:
      QuantizeRowsKernel<InType::kBf16><<<grid, kThreads, 0, stream>>>(args);
      break;
    case ffi::DataType::F16:
      QuantizeRowsKernel<InType::kF16><<<grid, kThreads, 0, stream>>>(args);
      break;
    default:
      QuantizeRowsKernel<InType::kF32><<<grid, kThreads, 0, stream>>>(args);
      break;
  }
  return LaunchError("quantize_rows");
}

ffi::Error QuantizeColsCuda(cudaStream_t stream, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::F32> amax,
                            ffi::Buffer<ffi::U32> key,
                            ffi::Result<ffi::Buffer<ffi::U8>> codes,
                            ffi::Result<ffi::AnyBuffer> scales,
                            int64_t tile_rows, bool stochastic, bool rht,
                            int64_t stream_id) {
  const QuantizeOptions options{tile_rows, stochastic, rht, stream_id};
  MatrixDims d;
  if (auto e = CheckQuantize(x, /*transpose=*/true, amax, key, options, codes,
                             scales, &d);
      e.failure()) {
    return e;
  }
  TileArgs args = MakeTileArgs(x, d, key);
  if (args.tiles == 0) return ffi::Error::Success();
  args.col = MakeOutputArgs(d, amax, options, codes, scales);
  args.row = args.col;  // unused
  return LaunchTile</*kRows=*/false, /*kCols=*/true>(stream, x.element_type(),
                                                     args);
}

ffi::Error QuantizeRowsColsCuda(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> row_amax,
    ffi::Buffer<ffi::F32> col_amax, ffi::Buffer<ffi::U32> key,
    ffi::Result<ffi::Buffer<ffi::U8>> row_codes,
    ffi::Result<ffi::AnyBuffer> row_scales,
    ffi::Result<ffi::Buffer<ffi::U8>> col_codes,
    ffi::Result<ffi::AnyBuffer> col_scales, int64_t row_tile_rows,
    bool row_stochastic, bool row_rht, int64_t row_stream,
    int64_t col_tile_rows, bool col_stochastic, bool col_rht,
    int64_t col_stream) {
  const QuantizeOptions rows{row_tile_rows, row_stochastic, row_rht,
                             row_stream};
  const QuantizeOptions cols{col_tile_rows, col_stochastic, col_rht,
                             col_stream};
  MatrixDims d;
  if (auto e = CheckQuantize(x, /*transpose=*/false, row_amax, key, rows,
                             row_codes, row_scales, &d);
      e.failure()) {
    return e;
  }
  if (auto e = CheckQuantize(x, /*transpose=*/true, col_amax, key, cols,
                             col_codes, col_scales, &d);
      e.failure()) {
    return e;
  }
  TileArgs args = MakeTileArgs(x, d, key);
  if (args.tiles == 0) return ffi::Error::Success();
  args.row = MakeOutputArgs(d, row_amax, rows, row_codes, row_scales);
  args.col = MakeOutputArgs(d, col_amax, cols, col_codes, col_scales);
  return LaunchTile</*kRows=*/true, /*kCols=*/true>(stream, x.element_type(),
                                                    args);
}

ffi::Error AmaxCuda(cudaStream_t stream, ffi::AnyBuffer x,
                    ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t rht_axis) {
  if (!IsSupportedInputType(x.element_type())) {
    return InvalidArgument("input must be float32, bfloat16 or float16");
  }
  MatrixDims d;
  if (!Rank3Dims(x, &d)) return InvalidArgument("expected a rank-3 input");
  if (rht_axis != 1 && rht_axis != 2) return InvalidArgument("rht_axis is 1 or 2");
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
  // About 4 waves of CTAs in all (at least one per batch item), each CTA
  // striding over the chunks of its batch item.
  const int64_t wanted = std::max<int64_t>(1, 4096 / d.batch);
  args.ctas_per_batch =
      std::min<int64_t>((args.chunks + kThreads - 1) / kThreads, wanted);
  args.ctas_per_batch =
      std::min<int64_t>(args.ctas_per_batch, kMaxGrid / d.batch);
  if (args.ctas_per_batch < 1) {
    return InvalidArgument("batch too large for the amax kernel grid");
  }
  const unsigned int grid =
      static_cast<unsigned int>(d.batch * args.ctas_per_batch);
  const bool along_k = rht_axis == 2;
#define JAX_NVFP4_LAUNCH_AMAX(T)                                        \
  if (along_k) {                                                        \
    AmaxKernel<T, true><<<grid, kThreads, 0, stream>>>(args);          \
  } else {                                                              \
    AmaxKernel<T, false><<<grid, kThreads, 0, stream>>>(args);         \
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
  const unsigned int grid = GridFor(args.blocks);
  if (out_type == ffi::DataType::BF16) {
    DequantizeKernel<true><<<grid, kThreads, 0, stream>>>(args);
  } else {
    DequantizeKernel<false><<<grid, kThreads, 0, stream>>>(args);
  }
  return LaunchError("dequantize");
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
        .Ret<ffi::Buffer<ffi::U8>>()               // codes [b, m, k/2]
        .Ret<ffi::AnyBuffer>()                     // scales [b, m, k/16]
        .Attr<int64_t>("tile_rows")
        .Attr<bool>("stochastic")
        .Attr<bool>("rht")
        .Attr<int64_t>("stream"),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4QuantizeColsCuda, jax_nvfp4::QuantizeColsCuda,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // CUDA stream
        .Arg<ffi::AnyBuffer>()                     // x [b, m, k]
        .Arg<ffi::Buffer<ffi::F32>>()              // amax [n]
        .Arg<ffi::Buffer<ffi::U32>>()              // key [n, 2]
        .Ret<ffi::Buffer<ffi::U8>>()               // codes [b, k, m/2]
        .Ret<ffi::AnyBuffer>()                     // scales [b, k, m/16]
        .Attr<int64_t>("tile_rows")
        .Attr<bool>("stochastic")
        .Attr<bool>("rht")
        .Attr<int64_t>("stream"),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4QuantizeRowsColsCuda, jax_nvfp4::QuantizeRowsColsCuda,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // CUDA stream
        .Arg<ffi::AnyBuffer>()                     // x [b, m, k]
        .Arg<ffi::Buffer<ffi::F32>>()              // row amax
        .Arg<ffi::Buffer<ffi::F32>>()              // col amax
        .Arg<ffi::Buffer<ffi::U32>>()              // key [n, 2]
        .Ret<ffi::Buffer<ffi::U8>>()               // row codes
        .Ret<ffi::AnyBuffer>()                     // row scales
        .Ret<ffi::Buffer<ffi::U8>>()               // col codes
        .Ret<ffi::AnyBuffer>()                     // col scales
        .Attr<int64_t>("row_tile_rows")
        .Attr<bool>("row_stochastic")
        .Attr<bool>("row_rht")
        .Attr<int64_t>("row_stream")
        .Attr<int64_t>("col_tile_rows")
        .Attr<bool>("col_stochastic")
        .Attr<bool>("col_rht")
        .Attr<int64_t>("col_stream"),
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
