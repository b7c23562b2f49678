// NVFP4 numerics: the single source of the rounding and scaling arithmetic.
//
// Every function here is used unchanged by the CPU handlers and the CUDA
// kernels; the pure-JAX reference (jax_nvfp4/reference.py) follows the same
// steps line for line. All arithmetic is IEEE float32 (build without
// fast-math and without FMA contraction), in the order written, except that
// float32 subnormals are flushed to zero with their sign, as inputs and as
// results of every operation (FTZ and DAZ): XLA runs CPU computations in that
// mode, so the pure-JAX twin cannot do otherwise there; the CPU handlers set
// it themselves (cpu/common.h) and the CUDA kernels are built with
// -ftz=true. Only magnitudes below 2^-126 (~1.2e-38) are affected: every
// bfloat16 subnormal input quantizes as a (signed) zero.
//
// The normative spec is "Numerics" in DESIGN.md (NVIDIA Transformer Engine's
// NVFP4BlockScaling recipe). Quantizing x along its quantized axis:
//   1. A = max |x_i| over the FINITE elements of the whole tensor (NaN and
//      +-inf excluded; MaxAbsFinite); with the RHT, over the finite
//      transformed values. No finite element: A = 0.
//   2. S_enc = min(2688 / A, FLT_MAX), 1 if A == 0 or S_enc == 0; S_dec =
//      1 / S_enc (GlobalScaleFromAmax).
//   3. Per block (1x16, or a 16x16 tile), after the RHT where it applies:
//      bamax = max |x_i| over the block, a NaN or +-inf counting as +inf
//      (BlockAmaxStep).
//      3a. bamax == +inf (the block holds a NaN or +-inf; BlockIsNonFinite):
//          scale byte 0x7F (the E4M3 NaN, kNonFiniteScaleByte) and every
//          code 0 (kNonFiniteCodes, in every row of a tile); its values
//          dequantize to NaN (e2m1 * NaN) and every GEMM output summing over
//          the block is NaN. Steps 4 and 5 do not apply.
//      3b. otherwise s_b = e4m3(min(bamax * (S_enc * (1/6)), FLT_MAX))
//          (BlockScale).
//   4. enc_b = min(1 / (s_b * S_dec), FLT_MAX) (BlockEncodeMultiplier).
//   5. q_i = e2m1(x_i * enc_b), nearest even or stochastic (EncodeBlock16).
// BlockScaleOf does steps 3a/3b and 4 from bamax. A finite tensor never
// takes 3a (unless its RHT overflows: |x| ~ 1e38), so its bytes are those of
// TE's recipe.
// Documented edge cases, identical on every backend:
//   * -0.0 (and negative values that round to zero) keep their sign: code 0x8.
//   * A block whose E4M3 scale rounds to 0 gets enc_b = FLT_MAX; its values
//     dequantize to (signed) zero.
//   * The element roundings map NaN to code 0x7 (kNanCode); no quantize
//     reaches that (a block holding a NaN takes step 3a).
#ifndef JAX_NVFP4_FFI_NUMERICS_NVFP4_H_
#define JAX_NVFP4_FFI_NUMERICS_NVFP4_H_

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define NVFP4_HD __host__ __device__ __forceinline__
#else
#define NVFP4_HD inline
#endif

namespace jax_nvfp4 {

inline constexpr int kBlock = 16;              // elements per scale block
inline constexpr float kE4M3Max = 448.0f;      // largest finite E4M3 value
inline constexpr float kE2M1Max = 6.0f;        // largest E2M1 magnitude
inline constexpr float kScaleRange = 2688.0f;  // kE4M3Max * kE2M1Max
inline constexpr uint8_t kNanCode = 0x7;       // E2M1Round*(NaN) (see above)
// Step 3a: the scale byte and the codes of a block holding a NaN or +-inf.
inline constexpr uint8_t kNonFiniteScaleByte = 0x7F;  // float8_e4m3fn NaN
inline constexpr uint64_t kNonFiniteCodes = 0;        // every nibble 0

NVFP4_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

NVFP4_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// ---------------------------------------------------------------------------
// Global (per-tensor) scale.
// ---------------------------------------------------------------------------
struct GlobalScale {
  float encode;  // S_enc = 2688 / amax
  float decode;  // S_dec = 1 / S_enc
};

NVFP4_HD GlobalScale GlobalScaleFromAmax(float amax) {
  float s_enc = kScaleRange / amax;
  s_enc = fminf(s_enc, FLT_MAX);  // amax -> 0: 2688/0 = inf -> FLT_MAX
  if (amax == 0.0f || s_enc == 0.0f) s_enc = 1.0f;  // zero or infinite amax
  return {s_enc, 1.0f / s_enc};
}

// ---------------------------------------------------------------------------
// E4M3 (float8_e4m3fn) block scales.
// ---------------------------------------------------------------------------

// Round half to even of a value in [0, 2^23); exact for the small integers
// used here. Written out so host and device agree without rounding modes.
NVFP4_HD float RoundHalfToEven(float t) {
  const float lower = floorf(t);
  const float frac = t - lower;  // exact: t and lower share an exponent range
  if (frac > 0.5f) return lower + 1.0f;
  if (frac < 0.5f) return lower;
  return fmodf(lower, 2.0f) == 0.0f ? lower : lower + 1.0f;
}

// Rounds v >= 0 (finite) to the nearest E4M3 value, ties to even, saturating
// at 448 (a plain cast would give NaN above 464). Returns the E4M3 value as a
// float.
NVFP4_HD float E4M3RoundSatfinite(float v) {
  v = fminf(v, kE4M3Max);
  if (v < 0.015625f) {
    // Subnormal E4M3 range [0, 2^-6): a fixed step of 2^-9.
    return RoundHalfToEven(v * 512.0f) * (1.0f / 512.0f);
  }
  // Normal range: keep 3 mantissa bits of the float32, round half to even on
  // the 20 dropped bits. Carry into the exponent is the correct result.
  uint32_t bits = FloatBits(v);
  bits = (bits + 0x7FFFFu + ((bits >> 20) & 1u)) & ~0xFFFFFu;
  return BitsToFloat(bits);
}

// Encodes a non-negative value that is exactly representable in E4M3.
NVFP4_HD uint8_t E4M3Encode(float v) {
  if (v < 0.015625f) return static_cast<uint8_t>(v * 512.0f);  // 0..7
  const uint32_t bits = FloatBits(v);
  const uint32_t exponent = ((bits >> 23) & 0xFFu) - 127u + 7u;
  return static_cast<uint8_t>((exponent << 3) | ((bits >> 20) & 0x7u));
}

// float8_e4m3fn: no infinities; 0x7F and 0xFF are NaN (a quantize writes
// 0x7F only for a block holding a NaN or +-inf, step 3a; finite scales
// saturate at 448, 0x7E).
NVFP4_HD float E4M3Decode(uint8_t byte) {
  const uint32_t exponent = (byte >> 3) & 0xFu;
  const uint32_t mantissa = byte & 0x7u;
  float magnitude;
  if (exponent == 0xFu && mantissa == 0x7u) {
    magnitude = BitsToFloat(0x7FC00000u);
  } else if (exponent == 0) {
    magnitude = static_cast<float>(mantissa) * (1.0f / 512.0f);
  } else {
    magnitude = BitsToFloat(((exponent - 7u + 127u) << 23) | (mantissa << 20));
  }
  return (byte & 0x80u) ? -magnitude : magnitude;
}

// Whether v is finite: not NaN, not +-inf (its exponent bits not all set).
NVFP4_HD bool IsFinite(float v) {
  return (FloatBits(v) & 0x7F800000u) != 0x7F800000u;
}

// Step 1, the global amax: max(acc, |v|) over finite v only (NaN and +-inf
// ignored; acc >= 0, finite). Written as compares: glibc's fmaxf returns NaN
// for a signaling NaN operand.
NVFP4_HD float MaxAbsFinite(float acc, float v) {
  const float a = fabsf(v);
  return (a > acc && IsFinite(v)) ? a : acc;
}

// Step 3, the block amax: max(acc, |v|) with a NaN or +-inf counting as
// +inf, so that a block's (or tile's) maximum is +inf exactly when it holds
// a non-finite element (a plain maximum of such partial results keeps that).
NVFP4_HD float BlockAmaxStep(float acc, float v) {
  const float a = IsFinite(v) ? fabsf(v) : INFINITY;
  return a > acc ? a : acc;
}

// Step 3a's test on a block amax made by BlockAmaxStep (or by any maximum
// that gives +inf or NaN for a non-finite block).
NVFP4_HD bool BlockIsNonFinite(float block_amax) {
  return !(block_amax < INFINITY);
}

// Per-block scale s_b (as a float E4M3 value) from the block's amax.
NVFP4_HD float BlockScale(float block_amax, GlobalScale g) {
  return E4M3RoundSatfinite(
      fminf(block_amax * (g.encode * (1.0f / 6.0f)), FLT_MAX));
}

// Multiplier that maps a block's values onto the E2M1 grid.
NVFP4_HD float BlockEncodeMultiplier(float block_scale, GlobalScale g) {
  return fminf(1.0f / (block_scale * g.decode), FLT_MAX);
}

// Steps 3a/3b and 4 of a block from its amax (BlockAmaxStep): its scale
// (NaN for a non-finite block), the scale byte, the encode multiplier
// (unused for a non-finite block, whose codes are kNonFiniteCodes).
struct BlockScaling {
  float scale;
  uint8_t scale_byte;
  float multiplier;
  bool non_finite;
};

NVFP4_HD BlockScaling BlockScaleOf(float block_amax, GlobalScale g) {
  if (BlockIsNonFinite(block_amax)) {
    return {BitsToFloat(0x7FC00000u), kNonFiniteScaleByte, 1.0f, true};
  }
  const float scale = BlockScale(block_amax, g);
  return {scale, E4M3Encode(scale), BlockEncodeMultiplier(scale, g), false};
}

// Dequantization multiplier of a block: s_b * amax / 2688.
NVFP4_HD float BlockDecodeMultiplier(float block_scale, float amax) {
  return (block_scale * amax) * (1.0f / kScaleRange);
}

// ---------------------------------------------------------------------------
// E2M1 elements. A code is 4 bits: bit 3 the sign, bits 0-2 the magnitude
// index into {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
// ---------------------------------------------------------------------------

NVFP4_HD float E2M1Magnitude(uint32_t index) {
  // 0, 0.5, 1, 1.5 (step 0.5) then 2, 3, 4, 6.
  return index < 4 ? 0.5f * static_cast<float>(index)
                   : (index == 7 ? 6.0f : static_cast<float>(index - 2));
}

NVFP4_HD float E2M1Decode(uint32_t code) {
  const float magnitude = E2M1Magnitude(code & 0x7u);
  return (code & 0x8u) ? -magnitude : magnitude;
}

NVFP4_HD uint8_t SignBit(float v) {
  return static_cast<uint8_t>((FloatBits(v) >> 28) & 0x8u);
}

// E2M1 rounding as a minimum over the three step sizes of the grid. With
// a = |v|, the magnitude index (0..7 for 0, 0.5, 1, 1.5, 2, 3, 4, 6) is
//   r(2a)         for a < 2      (step 0.5),
//   r(a) + 2      for 2 <= a < 4 (step 1),
//   r(a / 2) + 4  for a >= 4     (step 2), capped at 7,
// where r rounds to an integer; each candidate is >= the right one outside
// its own range, so the index is the minimum of the three and 7. With
// r = rintf (nearest, ties to even) this is round-to-nearest-even on the
// grid; with r = floorf it is rounding down. Branch-free: a divergent
// if-chain per element costs the CUDA kernels several times over.
NVFP4_HD float E2M1IndexMin(float c1, float c2, float c3) {
  return fminf(fminf(c1, c2), fminf(c3, 7.0f));
}

// Round to nearest, ties to even, saturating at +-6. Ties: 0.25->0, 0.75->1,
// 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. NaN -> kNanCode (fminf drops the
// NaN candidates, leaving 7; the sign is not kept): not reached by a
// quantize, whose blocks holding a NaN take step 3a.
NVFP4_HD uint8_t E2M1RoundNearest(float v) {
  const float a = fabsf(v);
  const float index =
      E2M1IndexMin(rintf(2.0f * a), rintf(a) + 2.0f, rintf(0.5f * a) + 4.0f);
  return v != v
             ? kNanCode
             : static_cast<uint8_t>(static_cast<uint32_t>(index) | SignBit(v));
}

// Spacing of the E2M1 grid above a magnitude a.
NVFP4_HD float E2M1Step(float a) {
  return a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f);
}

// Stochastic rounding with 8 random bits:
//   1. u = bits / 256, uniform in [0, 1);
//   2. t = |v| + u * step(|v|) (one rounding: u * step is exact);
//   3. q = t rounded down to the grid, clamped to 6, i.e. the index
//      min(floor(2t), floor(t) + 2, floor(t / 2) + 4, 7);
//   4. the sign of v is kept.
// Round-up happens with probability frac(|v| / step), so E[q] = |v| inside
// the grid.
NVFP4_HD uint8_t E2M1RoundStochastic(float v, uint32_t random_byte) {
  const float a = fabsf(v);
  const float u = static_cast<float>(random_byte) * (1.0f / 256.0f);
  const float t = a + u * E2M1Step(a);
  const float index =
      E2M1IndexMin(floorf(2.0f * t), floorf(t) + 2.0f, floorf(0.5f * t) + 4.0f);
  return v != v
             ? kNanCode
             : static_cast<uint8_t>(static_cast<uint32_t>(index) | SignBit(v));
}

// ---------------------------------------------------------------------------
// Random Hadamard Transform: R = diag(s) * H16 * 0.25, y = x16 * R.
// ---------------------------------------------------------------------------

// Sign vector s as a bit mask (bit j set <=> s_j = -1):
// [1,1,1,-1,1,-1,-1,-1,-1,-1,-1,1,-1,1,-1,-1].
inline constexpr uint32_t kRhtSignMask = 0xD7E8u;

NVFP4_HD constexpr int Popcount4(uint32_t v) {
  return (v & 1) + ((v >> 1) & 1) + ((v >> 2) & 1) + ((v >> 3) & 1);
}

// R[j][i] in {+0.25, -0.25}.
NVFP4_HD constexpr float RhtEntry(int j, int i) {
  return (((kRhtSignMask >> j) & 1u) ^ (Popcount4(j & i) & 1)) ? -0.25f : 0.25f;
}

// Round a float32 to bfloat16 (nearest, ties to even) and back to float32.
NVFP4_HD float RoundToBfloat16(float f) {
  if (f != f) return BitsToFloat(0x7FC00000u);
  uint32_t bits = FloatBits(f);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  return BitsToFloat(bits);
}

// Stages h = 1, 2, 4, 8 (those below `end`) of the radix-2 fast
// Walsh-Hadamard butterfly on z, in place: each replaces the pair (z_i,
// z_{i+h}), i & h == 0, by (z_i + z_{i+h}, z_i - z_{i+h}).
NVFP4_HD void ButterflyStages(float z[kBlock], int end = kBlock) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int h = 1; h < end; h <<= 1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int i = 0; i < kBlock; ++i) {
      if ((i & h) == 0) {
        const float a = z[i];
        const float b = z[i + h];
        z[i] = a + b;
        z[i + h] = a - b;
      }
    }
  }
}

// z = x16 * R in float32: z_j = x_j * s_j * 0.25 (exact), then z * H16 by
// the butterfly, stages h = 1, 2, 4, 8.
NVFP4_HD void HadamardButterfly16(const float x[kBlock], float z[kBlock]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int j = 0; j < kBlock; ++j) {
    z[j] = x[j] * (((kRhtSignMask >> j) & 1u) ? -0.25f : 0.25f);
  }
  ButterflyStages(z);
}

// y = bf16(x16 * R): the butterfly, each result rounded to bfloat16.
NVFP4_HD void RandomHadamard16(const float x[kBlock], float y[kBlock]) {
  float z[kBlock];
  HadamardButterfly16(x, z);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < kBlock; ++i) y[i] = RoundToBfloat16(z[i]);
}

// ---------------------------------------------------------------------------
// Input element types: exact widening of bfloat16 and float16 bit patterns.
// ---------------------------------------------------------------------------
NVFP4_HD float Bfloat16BitsToFloat(uint16_t bits) {
  return BitsToFloat(static_cast<uint32_t>(bits) << 16);
}

NVFP4_HD uint16_t FloatToBfloat16Bits(float f) {
  return static_cast<uint16_t>(FloatBits(RoundToBfloat16(f)) >> 16);
}

NVFP4_HD float Float16BitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  float magnitude;
  if (exponent == 0) {
    magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);  // 2^-24
  } else if (exponent == 31) {
    magnitude = BitsToFloat(0x7F800000u | (mantissa << 13));
  } else {
    magnitude = BitsToFloat(((exponent + 112u) << 23) | (mantissa << 13));
  }
  return BitsToFloat(FloatBits(magnitude) | sign);
}

// ---------------------------------------------------------------------------
// Stochastic-rounding bits: Philox-4x32-10 (Salmon et al. 2011, as in
// Random123 and cuRAND), keyed by a JAX key's two words. The 16 elements of
// block B (elements 16B .. 16B + 15 in the flat quantized layout, quantized
// axis last) of stream `stream` take the 16 bytes of the output for the
// counter (B mod 2^32, B / 2^32, stream, 0): element 16B + i takes byte
// i % 4 of output word i / 4, low byte first. One call per block (a
// Threefry-2x32 call gives 8 bytes: two per block, at twice the
// instructions).
// ---------------------------------------------------------------------------

struct Philox4x32Output {
  uint32_t word[4];
};

NVFP4_HD Philox4x32Output Philox4x32(uint32_t key0, uint32_t key1, uint32_t c0,
                                     uint32_t c1, uint32_t c2, uint32_t c3) {
  constexpr uint32_t kMultiplier0 = 0xD2511F53u, kMultiplier1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {  // the key schedule: a Weyl sequence
      key0 += kWeyl0;
      key1 += kWeyl1;
    }
    const uint64_t p0 = static_cast<uint64_t>(kMultiplier0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMultiplier1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32);
    c0 = hi1 ^ c1 ^ key0;
    c1 = static_cast<uint32_t>(p1);
    c2 = hi0 ^ c3 ^ key1;
    c3 = static_cast<uint32_t>(p0);
  }
  return {{c0, c1, c2, c3}};
}

// The 16 random bytes of block `block` of a stream: elements 0-7 in
// `*lo` and 8-15 in `*hi`, element i in byte i % 8, low byte first.
NVFP4_HD void RandomBytes16(uint32_t key0, uint32_t key1, uint32_t stream,
                            uint64_t block, uint64_t* lo, uint64_t* hi) {
  const Philox4x32Output out =
      Philox4x32(key0, key1, static_cast<uint32_t>(block),
                 static_cast<uint32_t>(block >> 32), stream, 0u);
  *lo = static_cast<uint64_t>(out.word[0]) |
        (static_cast<uint64_t>(out.word[1]) << 32);
  *hi = static_cast<uint64_t>(out.word[2]) |
        (static_cast<uint64_t>(out.word[3]) << 32);
}

// ---------------------------------------------------------------------------
// Step 5 of one 16-element block: codes (packed, element 2k in the low
// nibble of byte k) from the block's values and its encode multiplier. For a
// finite block (a non-finite one has kNonFiniteCodes, step 3a).
// ---------------------------------------------------------------------------
NVFP4_HD uint64_t EncodeBlock16(const float v[kBlock], float encode_multiplier,
                                bool stochastic, uint64_t random_lo,
                                uint64_t random_hi) {
  uint64_t packed = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < kBlock; ++i) {
    const float scaled = v[i] * encode_multiplier;
    uint32_t code;
    if (stochastic) {
      const uint64_t bytes = i < 8 ? random_lo : random_hi;
      code = E2M1RoundStochastic(
          scaled, static_cast<uint32_t>(bytes >> (8 * (i & 7))) & 0xFFu);
    } else {
      code = E2M1RoundNearest(scaled);
    }
    packed |= static_cast<uint64_t>(code) << (4 * i);
  }
  return packed;
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_NUMERICS_NVFP4_H_
