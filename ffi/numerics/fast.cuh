// Fast CUDA forms of the per-element and per-block arithmetic of
// numerics/nvfp4.h, bit-identical to it (see below). Used by the quantize
// kernels (ffi/cuda/) and checked exhaustively against the header by
// tools/fast_numerics_check.cu on a GPU.
#ifndef JAX_NVFP4_FFI_NUMERICS_FAST_CUH_
#define JAX_NVFP4_FFI_NUMERICS_FAST_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "numerics/nvfp4.h"

namespace jax_nvfp4 {

// ---------------------------------------------------------------------------
// Fast forms of the per-element arithmetic of numerics/nvfp4.h.
//
// These kernels are bound by instruction issue, mostly on the integer/compare
// pipe (half rate on Hopper) and the conversion pipe (quarter rate). The
// header's E2M1RoundNearest / E2M1RoundStochastic take the minimum of three
// candidate indices made with rintf / floorf and a float -> int conversion:
// four conversion-pipe instructions (FRND x3, F2I) per element, plus a NaN
// select and a sign extraction. The forms below compute the same minimum of
// the magnitude index with the integer rounding done by adding a constant
// 2^23 + 2j (FMA pipe; ptxas keeps the constant 2 or 1/2 of two candidates
// in a register it often re-materializes, ~1.7 instructions per candidate):
// the sum rounds
// |v| * 2^k + 2j to an integer (round to nearest even -- 2j is even, so ties
// keep their parity -- or toward zero with the _rz forms, as rintf / floorf
// do for a >= 0), and its low 3 bits are the magnitude index. The sign bits
// of 8 elements are gathered with 6 byte permutes (SignNibbles8) and OR-ed in
// after packing. These forms serve finite blocks only: a block holding a NaN
// or +-inf (its BlockAmax is +inf) takes the header's step 3a, scale byte
// kNonFiniteScaleByte and codes kNonFiniteCodes, and the caller skips these
// forms for it (EncodeBlock in cuda/quantize.cuh: a branch on the scale
// byte, warp-uniform for finite data). Checked against the header for every
// float32 bit pattern of finite blocks (tools/fast_numerics_check.cu; with
// two random bytes per pattern for stochastic rounding); the tests compare
// every kernel with the CPU.
//
// RandomHadamard16Fast is the header's RandomHadamard16 (its
// HadamardButterfly16, then the rounding to bfloat16) with the final rounding
// to bfloat16 done by cvt.rn.bf16x2.f32, which equals RoundToBfloat16 for every
// non-NaN float (checked exhaustively). A NaN stays a NaN with another
// payload, which no output can show: every amax ignores it and a block
// holding one takes step 3a (scale byte 0x7F, codes 0).
//
// Building with -DJAX_NVFP4_CUDA_HEADER_ARITHMETIC uses the header's
// EncodeBlock16 and RandomHadamard16 verbatim instead (same bytes, slower).
// ---------------------------------------------------------------------------
#if !defined(JAX_NVFP4_CUDA_HEADER_ARITHMETIC)
constexpr float kTwo23 = 8388608.0f;  // 2^23: integers are exact below 2^24

// min(candidates, 7) -> bits 0x4B000000 + magnitude index.
__device__ __forceinline__ uint32_t IndexBits(float g1, float g2, float g3) {
  return FloatBits(fminf(fminf(g1, g2), fminf(g3, kTwo23 + 7.0f)));
}

// The magnitude index of E2M1RoundNearest(v), non-NaN v, as 0x4B000000 +
// index. kBelowSeven: |v| < 7 is known, so rne(|v|/2) + 4 <= 7 and the cap
// at index 7 changes nothing (one instruction less).
template <bool kBelowSeven = false>
__device__ __forceinline__ uint32_t NearestIndexBits(float v) {
  const float a = fabsf(v);
  const float g1 = __fmaf_rn(a, 2.0f, kTwo23);         // 2^23 + rne(2a)
  const float g2 = __fadd_rn(a, kTwo23 + 2.0f);        // 2^23 + rne(a) + 2
  const float g3 = __fmaf_rn(a, 0.5f, kTwo23 + 4.0f);  // 2^23 + rne(a/2) + 4
  if constexpr (kBelowSeven) return FloatBits(fminf(fminf(g1, g2), g3));
  return IndexBits(g1, g2, g3);
}

// The magnitude index of E2M1RoundStochastic(v, byte), non-NaN v, as
// 0x4B000000 + index; `byte_as_float` is float(byte).
__device__ __forceinline__ uint32_t StochasticIndexBits(float v,
                                                        float byte_as_float) {
  const float a = fabsf(v);
  // t exactly as in E2M1RoundStochastic: u * step(a) = byte * (step(a) / 256)
  // is exact either way, and t = a + (that) is the one rounding.
  const float t =
      __fadd_rn(a, __fmul_rn(byte_as_float, E2M1Step(a) * (1.0f / 256.0f)));
  const float h1 = __fmaf_rz(t, 2.0f, kTwo23);         // 2^23 + floor(2t)
  const float h2 = __fadd_rz(t, kTwo23 + 2.0f);        // 2^23 + floor(t) + 2
  const float h3 = __fmaf_rz(t, 0.5f, kTwo23 + 4.0f);  // 2^23 + floor(t/2) + 4
  return IndexBits(h1, h2, h3);
}

// float(byte k of word), exact: the byte in the mantissa of 2^23.
__device__ __forceinline__ float ByteAsFloat(uint32_t word, int k) {
  return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7650u + k)) - kTwo23;
}
#endif  // !JAX_NVFP4_CUDA_HEADER_ARITHMETIC

// Sign bits of s[0..7] at bits 4i + 3 (the code layout): the top bytes of
// the even elements gathered into one word (signs at bits 7, 15, 23, 31,
// shifted down by 4), those of the odd elements into another (in place).
__device__ __forceinline__ uint32_t SignNibbles8(const float* s) {
  const uint32_t e01 = __byte_perm(FloatBits(s[0]), FloatBits(s[2]), 0x0073);
  const uint32_t e23 = __byte_perm(FloatBits(s[4]), FloatBits(s[6]), 0x0073);
  const uint32_t o01 = __byte_perm(FloatBits(s[1]), FloatBits(s[3]), 0x0073);
  const uint32_t o23 = __byte_perm(FloatBits(s[5]), FloatBits(s[7]), 0x0073);
  const uint32_t evens = __byte_perm(e01, e23, 0x5410);
  const uint32_t odds = __byte_perm(o01, o23, 0x5410);
  return ((evens & 0x80808080u) >> 4) | (odds & 0x80808080u);
}

// Sign bits of the 8 bfloat16 elements of w[0..3] (element 2j in the low
// half of w[j]) at bits 4i + 3: the high bytes of the even elements
// gathered into one word, those of the odd elements into another.
__device__ __forceinline__ uint32_t SignNibbles8Bf16(const uint32_t* w) {
  const uint32_t t01 = __byte_perm(w[0], w[1], 0x7531);  // w0.b1 w0.b3 w1.b1 ..
  const uint32_t t23 = __byte_perm(w[2], w[3], 0x7531);
  const uint32_t evens = __byte_perm(t01, t23, 0x6420);
  const uint32_t odds = __byte_perm(t01, t23, 0x7531);
  return ((evens & 0x80808080u) >> 4) | (odds & 0x80808080u);
}

// The sign bits of a whole block at bits 4i + 3 (EncodeBlock16Fast's
// sign_bits): from 16 floats, or from the 8 words of 16 bfloat16 values.
__device__ __forceinline__ uint64_t SignBits16(const float* s) {
  return SignNibbles8(s) | (static_cast<uint64_t>(SignNibbles8(s + 8)) << 32);
}

__device__ __forceinline__ uint64_t SignBits16Bf16(const uint32_t* w) {
  return SignNibbles8Bf16(w) |
         (static_cast<uint64_t>(SignNibbles8Bf16(w + 4)) << 32);
}

#if !defined(JAX_NVFP4_CUDA_HEADER_ARITHMETIC)
// The codes of EncodeBlock16 with the sign bits clear, for a finite block,
// from the scaled values v[i] * encode_multiplier.
__device__ __forceinline__ uint64_t
MagnitudeCodes16(const float (&scaled)[kBlock], bool stochastic,
                 uint64_t random_lo, uint64_t random_hi, bool below_seven) {
  // Indices as bits 0x4B000000 + index, packed with shift-adds; the 0x4B of
  // elements 0 and 1 (the rest shift out) is subtracted at the end.
  constexpr uint32_t kPackedOffset = 0x4B000000u + (0x4B000000u << 4);
  uint32_t half[2] = {0u, 0u};
  if (stochastic) {
#pragma unroll
    for (int i = 0; i < kBlock; ++i) {
      const uint64_t bytes = i < 8 ? random_lo : random_hi;
      const uint32_t word =
          static_cast<uint32_t>(bytes >> (32 * ((i >> 2) & 1)));
      half[i >> 3] += StochasticIndexBits(scaled[i], ByteAsFloat(word, i & 3))
                      << (4 * (i & 7));
    }
  } else if (below_seven) {
#pragma unroll
    for (int i = 0; i < kBlock; ++i) {
      half[i >> 3] += NearestIndexBits<true>(scaled[i]) << (4 * (i & 7));
    }
  } else {
#pragma unroll
    for (int i = 0; i < kBlock; ++i) {
      half[i >> 3] += NearestIndexBits(scaled[i]) << (4 * (i & 7));
    }
  }
  return static_cast<uint64_t>(half[0] - kPackedOffset) |
         (static_cast<uint64_t>(half[1] - kPackedOffset) << 32);
}
#endif  // !JAX_NVFP4_CUDA_HEADER_ARITHMETIC

// EncodeBlock16(v, encode_multiplier, stochastic, random_lo, random_hi) for
// a finite block (anything, unused, for a block holding a NaN or +-inf: the
// caller writes kNonFiniteCodes there). `below_seven` (round to nearest only):
// every |v[i]| * encode_multiplier is below 7 -- true when the block's amax
// times the multiplier is (rounding is monotonic), i.e. for every block
// whose scale neither saturates nor underflows. `sign_bits`, when given:
// the sign bit of each v[i] at bit 4i + 3 (SignBits16Bf16 of the block's
// bfloat16 words), else taken from v.
__device__ __forceinline__ uint64_t EncodeBlock16Fast(
    const float (&v)[kBlock], float encode_multiplier, bool stochastic,
    uint64_t random_lo, uint64_t random_hi, bool below_seven = false,
    const uint64_t* sign_bits = nullptr) {
#if defined(JAX_NVFP4_CUDA_HEADER_ARITHMETIC)
  return EncodeBlock16(v, encode_multiplier, stochastic, random_lo, random_hi);
#else
  float scaled[kBlock];
#pragma unroll
  for (int i = 0; i < kBlock; ++i) scaled[i] = v[i] * encode_multiplier;
  const uint64_t magnitudes =
      MagnitudeCodes16(scaled, stochastic, random_lo, random_hi, below_seven);
  // Signs: those of v (the multiplier is positive; -0.0 keeps its sign).
  return magnitudes | (sign_bits != nullptr ? *sign_bits : SignBits16(scaled));
#endif
}

// RandomHadamard16 with the bfloat16 rounding in hardware (see above), the
// results also packed: `packed[j]` holds y[2j] in its low half and y[2j + 1]
// in its high half (the words BlockAmaxBf16 and the sign gathering read).
//
// The first butterfly stage is not folded into the 1/4 scaling as
// fma(x_{i+1}, +-s/4, z_i) (8 instructions less per block): with subnormals
// flushed (-ftz=true, see numerics/nvfp4.h) the header's z_{i+1} =
// x_{i+1} * s / 4 is zero when |x_{i+1}| < 2^-124, while the FMA's product
// is not flushed, so the sums differ for tiny values.
__device__ __forceinline__ void RandomHadamard16FastPacked(
    const float (&x)[kBlock], float (&y)[kBlock],
    uint32_t (&packed)[kBlock / 2]) {
#if defined(JAX_NVFP4_CUDA_HEADER_ARITHMETIC)
  RandomHadamard16(x, y);
#pragma unroll
  for (int i = 0; i < kBlock; i += 2) {
    packed[i / 2] =
        (FloatBits(y[i]) >> 16) | (FloatBits(y[i + 1]) & 0xFFFF0000u);
  }
#else
  float z[kBlock];
  HadamardButterfly16(x, z);
  // RoundToBfloat16 of each result, two per instruction.
#pragma unroll
  for (int i = 0; i < kBlock; i += 2) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(z[i], z[i + 1]);
    const uint32_t w = *reinterpret_cast<const uint32_t*>(&b);
    packed[i / 2] = w;
    y[i] = BitsToFloat(w << 16);
    y[i + 1] = BitsToFloat(w & 0xFFFF0000u);
  }
#endif
}

__device__ __forceinline__ void RandomHadamard16Fast(const float (&x)[kBlock],
                                                     float (&y)[kBlock]) {
  uint32_t unused[kBlock / 2];
  RandomHadamard16FastPacked(x, y, unused);
}

// ---------------------------------------------------------------------------
// Block maxima for the block scales (step 3 of numerics/nvfp4.h): the
// largest |v[i]|, +inf when the block holds a NaN or +-inf -- the header's
// BlockAmaxStep loop. One NaN-propagating maximum tree (max.NaN: a NaN or an
// inf reaches the root), then fminf(root, +inf), which turns a NaN root into
// +inf: one instruction, no branch, and a 16x16 tile's maximum over its
// blocks (plain fmaxf) stays +inf when any block is. BlockIsNonFinite tests
// the result (EncodeBlock).
// ---------------------------------------------------------------------------
__device__ __forceinline__ float MaxPropagatingNan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float BlockAmax(const float (&v)[kBlock]) {
  float a[kBlock / 2];
#pragma unroll
  for (int i = 0; i < kBlock / 2; ++i) {
    a[i] = MaxPropagatingNan(fabsf(v[i]), fabsf(v[i + kBlock / 2]));
  }
#pragma unroll
  for (int n = kBlock / 4; n > 0; n /= 2) {
#pragma unroll
    for (int i = 0; i < n; ++i) a[i] = MaxPropagatingNan(a[i], a[i + n]);
  }
  return fminf(a[0], INFINITY);
}

// BlockAmax of the 16 bfloat16 values in w[0..7], the maximum taken on
// bfloat16 pairs (exact: no rounding), so that it needs only the words. NaN
// propagates through max.NaN.bf16x2, inf as the largest value.
// Like BlockAmax's max.NaN.f32 (no .ftz), the tree may keep a subnormal
// maximum where the header's loop (flushing) has 0; the final fminf (built
// with -ftz=true) and every use (the block scale, the below-seven test)
// multiply or flush it, so the bytes agree.
__device__ __forceinline__ float BlockAmaxBf16(
    const uint32_t (&w)[kBlock / 2]) {
  __nv_bfloat162 m[kBlock / 4];
#pragma unroll
  for (int i = 0; i < kBlock / 4; ++i) {
    const uint32_t a = w[i] & 0x7FFF7FFFu, b = w[i + kBlock / 4] & 0x7FFF7FFFu;
    m[i] = __hmax2_nan(*reinterpret_cast<const __nv_bfloat162*>(&a),
                       *reinterpret_cast<const __nv_bfloat162*>(&b));
  }
  m[0] = __hmax2_nan(__hmax2_nan(m[0], m[2]), __hmax2_nan(m[1], m[3]));
  const uint32_t bits = *reinterpret_cast<const uint32_t*>(&m[0]);
  return fminf(MaxPropagatingNan(BitsToFloat(bits << 16),
                                 BitsToFloat(bits & 0xFFFF0000u)),
               INFINITY);
}

// |v| where v is finite, else 0 (NaN and +-inf): the terms of the global
// amax (step 1, the header's MaxAbsFinite), for a plain fmaxf reduction.
__device__ __forceinline__ float FiniteAbsOrZero(float v) {
  const float a = fabsf(v);
  return a < INFINITY ? a : 0.0f;
}

// A block scale: its E4M3 value (as a float) and byte.
struct BlockScaleE4M3 {
  float value;
  uint8_t byte;
};

// E4M3RoundSatfinite(v) and its E4M3Encode byte, v >= 0 and not NaN. On
// sm_89+ the rounding is cvt.rn.satfinite.e4m3x2.f32 (nearest even,
// saturating at 448, E4M3 subnormals included) and the value comes back
// through cvt to float16 (exact): equal to the header for every such float
// (checked exhaustively by tools/fast_numerics_check.cu).
__device__ __forceinline__ BlockScaleE4M3 E4M3FromFloat(float v) {
#if defined(JAX_NVFP4_CUDA_HEADER_ARITHMETIC) || __CUDA_ARCH__ < 890
  const float scale = E4M3RoundSatfinite(v);
  return {scale, E4M3Encode(scale)};
#else
  uint16_t pair;  // the E4M3 byte of v in the low byte (of 0 in the high)
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;"
      : "=h"(pair)
      : "f"(0.0f), "f"(v));
  uint32_t halves;  // both bytes as float16, exactly
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(pair));
  const float value =
      __half2float(__ushort_as_half(static_cast<uint16_t>(halves & 0xFFFFu)));
  return {value, static_cast<uint8_t>(pair & 0xFFu)};
#endif
}

// The header's BlockScaleOf(block_amax, g) scale and byte: BlockScale and
// its byte, or for a non-finite block (block_amax +inf, see BlockAmax) NaN
// and kNonFiniteScaleByte (step 3a; selected, no branch). The finite path
// never gives the byte 0x7F (scales saturate at 448, 0x7E), so a caller can
// tell step 3a from the byte alone, which it keeps anyway: no flag stays
// live across the encoding (EncodeBlock, cuda/quantize.cuh).
__device__ __forceinline__ BlockScaleE4M3 BlockScaleFast(float block_amax,
                                                         GlobalScale g) {
  const BlockScaleE4M3 finite =
      E4M3FromFloat(fminf(block_amax * (g.encode * (1.0f / 6.0f)), FLT_MAX));
  const bool non_finite = BlockIsNonFinite(block_amax);
  return {non_finite ? BitsToFloat(0x7FC00000u) : finite.value,
          non_finite ? kNonFiniteScaleByte : finite.byte};
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_NUMERICS_FAST_CUH_
