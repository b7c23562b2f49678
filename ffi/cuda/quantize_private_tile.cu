// QuantizePrivateTileKernel: the fused quantize_rows_cols of the recipe's
// bfloat16 operands, which can also write decoded (bfloat16) outputs.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/decode.cuh"
#include "cuda/device.cuh"
#include "cuda/fused_quantize_rule.h"
#include "cuda/launch.cuh"
#include "cuda/quantize.cuh"
#include "numerics/fast.cuh"
#include "numerics/nvfp4.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

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
// shuffle per 16x16 block for its amax). The tile is not held in registers:
// code indexed by a loop counter cannot address registers, and a fully
// unrolled form (~200 KB of code per instantiation) is bound by the
// instruction cache. Half a tile per thread (rather than a whole one) halves
// the slice and the load registers, so twice the warps fit on an SM to hide
// the latency of the arithmetic's dependency chains. The rounding and RHT
// options are template arguments: one straight path per instantiation.
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
// takes one tile (the hardware balances the CTAs across the SMs). The IEEE
// division per block stays: a shared-memory table of encode multipliers (one
// per scale byte) saves instructions but puts a table load in every block's
// dependency chain, and built once per persistent CTA it leaves a tail of
// CTAs with one tile left; both are slower.
// ---------------------------------------------------------------------------
constexpr int kPrivThreads = 64;
constexpr int kPrivTileM = 128;        // CTA tile rows (m)
constexpr int kPrivTileK = 64;         // CTA tile columns (k)
constexpr int kHalfRows = kBlock / 2;  // tile rows per lane
constexpr int kSliceWords = kHalfRows * kBlock / 2 + 1;
// 12 CTAs (24 warps) per SM: at most 80 registers per thread (the
// stochastic-rounding instantiations would take 96, 20 warps), 12 x 17.7 KB
// of shared memory (16.6 KB + the 1 KB the SM reserves per CTA).
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

template <bool kRowStochastic, bool kColRht, bool kColStochastic, bool kBlock16>
__global__ void __launch_bounds__(kPrivThreads, kPrivCtasPerSm)
    QuantizePrivateTileKernel(const TileArgs args) {
  // 16x16 blocks share one amax both ways only without RHT on the columns.
  static_assert(!(kBlock16 && kColRht), "16x16 blocks with column RHT");
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
    // maximum over both halves (+inf if any element is NaN or +-inf).
    float tile_amax = 0.0f;
    if (kBlock16) {
      if (active) {
#pragma unroll 1
        for (int r = 0; r < kHalfRows; ++r) {
          float v[kBlock];
#pragma unroll
          for (int j = 0; j < kBlock; ++j) {
            v[j] = T::FromRaw(slice[SliceWord(r, j / 2)] >> (16 * (j % 2)));
          }
          tile_amax = fmaxf(tile_amax, BlockAmax(v));
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
          const float block_amax = kBlock16 ? tile_amax : BlockAmaxBf16(words);
          StoreBlock(EncodeBlock(v, block_amax, g, row_out, kRowStochastic,
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
// the latency, and the code stays short (with more unrolled, the larger
// instantiations stall on instruction fetch).
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
            float block_amax;
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
              block_amax = BlockAmaxBf16(packed);
            } else {
              signs = SignBits16(v);
              block_amax = BlockAmax(v);
            }
            StoreBlock(EncodeBlock(v, kBlock16 ? tile_amax : block_amax, g,
                                   col_out, kColStochastic, key0, key1, b,
                                   k0 + 2 * j + s, m0, &signs),
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

// Whether QuantizePrivateTileKernel has an instantiation for these options
// (row stochastic, column RHT, column stochastic, 16x16 blocks): those of
// FusedQuantizeWritesValues for a bfloat16 x without row RHT.
constexpr bool PrivateTileOptionsValid(bool /*row_stochastic*/, bool col_rht,
                                       bool /*col_stochastic*/, bool block16) {
  return FusedQuantizeWritesValues(/*bf16_input=*/true, block16 ? 16 : 1,
                                   /*row_rht=*/false, block16 ? 16 : 1,
                                   col_rht);
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

}  // namespace

// Whether QuantizePrivateTileKernel serves these arguments (see there).
bool PrivateTileApplies(ffi::DataType type, const TileArgs& args) {
  return FusedQuantizeWritesValues(type == ffi::DataType::BF16,
                                   args.row.block16 ? 16 : 1, args.row.rht,
                                   args.col.block16 ? 16 : 1, args.col.rht) &&
         args.x_vec && args.m % kBlock == 0 && args.k % kBlock == 0 &&
         args.row.codes_aligned && args.col.codes_aligned;
}

void LaunchQuantizePrivateTile(cudaStream_t stream, TileArgs args) {
  LaunchPrivateTile(stream, args, args.row.stochastic, args.col.rht,
                    args.col.stochastic, args.col.block16);
}

}  // namespace jax_nvfp4
