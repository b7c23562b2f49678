// What the quantize kernels share (quantize_tile.cu, quantize_private_tile.cu,
// quantize_rows.cu) with the handlers that launch them (quantize.cu): the
// kernel arguments, the encoding of one block, and the launchers.
#ifndef JAX_NVFP4_FFI_CUDA_QUANTIZE_CUH_
#define JAX_NVFP4_FFI_CUDA_QUANTIZE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device.cuh"
#include "numerics/fast.cuh"
#include "numerics/nvfp4.h"
#include "options.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {

namespace ffi = xla::ffi;

constexpr int kTileM = 128;  // tile rows (m) of QuantizeTileKernel
constexpr int kTileK = 64;   // tile columns (k) of QuantizeTileKernel

// ---------------------------------------------------------------------------
// One quantized output: where it goes and how it is produced.
// ---------------------------------------------------------------------------
struct OutputArgs {
  uint8_t* codes;          // [batch, rows, len / 2]
  uint8_t* scales;         // [batch, rows, len / 16], E4M3 bytes
  const float* amax;       // [n_amax]
  int64_t batch_per_amax;  // batch / n_amax
  uint32_t stream;         // stochastic-rounding stream id
  bool block16;            // block_rows 16: 16x16 blocks (else 1x16)
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
  bool cols;  // the column-wise output (rows = k)
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
// from `block_amax` (BlockAmax, or a 16x16 tile's maximum of those: +inf
// when the block or tile holds a NaN or +-inf, which then gets the header's
// step 3a: scale byte 0x7F and codes 0), with stochastic rounding when
// `stochastic` (out's option, or a constant the caller knows it equals).
// v[0] is element
// (b, r, l) of the output [batch, rows, len]; its index in the whole tensor
// picks the stochastic-rounding bits. `sign_bits`: see EncodeBlock16Fast.
__device__ __forceinline__ EncodedBlock EncodeBlock(
    const float (&v)[kBlock], float block_amax, GlobalScale g,
    const OutputArgs& out, bool stochastic, uint32_t key0, uint32_t key1,
    int64_t b, int64_t r, int64_t l, const uint64_t* sign_bits = nullptr) {
  // Steps 3a/3b: for a non-finite block NaN and byte 0x7F, told by the byte
  // alone (no finite block has it). Step 3a's codes by a branch rather than
  // a select after the encoding: nothing stays live across the encoding (a
  // select spills registers in the stochastic instantiations of
  // QuantizePrivateTileKernel), and for finite data it is warp-uniform.
  const BlockScaleE4M3 scale = BlockScaleFast(block_amax, g);
  const float multiplier = BlockEncodeMultiplier(scale.value, g);
  uint64_t packed = kNonFiniteCodes;
  if (scale.byte != kNonFiniteScaleByte) {  // steps 4 and 5
    if (stochastic) {
      const uint64_t block =
          GlobalRandomIndex(out.origin, out.place, out.cols, b, r, l) / kBlock;
      uint64_t random_lo, random_hi;
      RandomBytes16(key0, key1, out.stream, block, &random_lo, &random_hi);
      packed = EncodeBlock16Fast(v, multiplier, /*stochastic=*/true, random_lo,
                                 random_hi, /*below_seven=*/false, sign_bits);
    } else {
      packed = EncodeBlock16Fast(v, multiplier, /*stochastic=*/false, 0, 0,
                                 block_amax * multiplier < 7.0f, sign_bits);
    }
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

__device__ __forceinline__ void EncodeAndStore(const float (&v)[kBlock],
                                               float block_amax, GlobalScale g,
                                               const OutputArgs& out,
                                               uint32_t key0, uint32_t key1,
                                               uint64_t flat, int64_t b,
                                               int64_t r, int64_t l) {
  const EncodedBlock e =
      EncodeBlock(v, block_amax, g, out, out.stochastic, key0, key1, b, r, l);
  StoreCodes(out.codes + flat / 2, e.packed, out.codes_aligned);
  out.scales[flat / kBlock] = e.scale;
}

__device__ __forceinline__ GlobalScale GlobalScaleOf(const OutputArgs& out,
                                                     int64_t b) {
  return GlobalScaleFromAmax(out.amax[Div(b, out.batch_per_amax)]);
}

// The arguments of QuantizeTileKernel and QuantizePrivateTileKernel: x
// [batch, m, k] -> row-wise output [batch, m, k] (quantized along k) and/or
// column-wise output [batch, k, m] (along m).
struct TileArgs {
  const void* x;
  int64_t batch, m, k;
  int64_t m_tiles, k_tiles, tiles;  // tiles = batch * m_tiles * k_tiles
  bool x_vec;  // x is 16-byte aligned and so is every row (k * bytes % 16)
  KeyArgs key;
  OutputArgs row;  // [batch, m, k] quantized along k
  OutputArgs col;  // [batch, k, m] quantized along m
};

// The arguments of QuantizeRowsKernel (quantize_rows.cu).
struct RowsArgs {
  const void* x;
  int64_t batch, m, k;
  int64_t blocks;  // batch * m * k / 16
  bool x_vec;      // x is 16-byte aligned
  KeyArgs key;
  OutputArgs out;
};

// ---------------------------------------------------------------------------
// Launchers (on `stream`; the caller checks cudaGetLastError).
// ---------------------------------------------------------------------------
// QuantizeTileKernel<T, kRows, kCols> for x of type `type` (bf16, f16, else
// f32); instantiated for <false, true> and <true, true>.
template <bool kRows, bool kCols>
void LaunchQuantizeTile(cudaStream_t stream, ffi::DataType type,
                        const TileArgs& args);

// Whether QuantizePrivateTileKernel serves these arguments (see there).
bool PrivateTileApplies(ffi::DataType type, const TileArgs& args);

// QuantizePrivateTileKernel for arguments it serves (PrivateTileApplies).
void LaunchQuantizePrivateTile(cudaStream_t stream, TileArgs args);

// QuantizeRowsKernel<T> for x of type `type`.
void LaunchQuantizeRows(cudaStream_t stream, ffi::DataType type,
                        const RowsArgs& args);

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_CUDA_QUANTIZE_CUH_
