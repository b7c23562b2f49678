// Decoding to bfloat16 on the device: e2m1(code) * E4M3 block scale, exact
// (2 + 4 significant bits; 2^-10 .. 2688), without the amax -- the operands
// of the Hopper GEMM (jax_nvfp4/backends/bf16_gemm.py), as its pure-JAX twin
// reference.decode_bf16. Used by DecodeBf16Kernel (dequantize.cu) and by the
// decoded outputs of QuantizePrivateTileKernel (quantize_private_tile.cu).
#ifndef JAX_NVFP4_FFI_CUDA_DECODE_CUH_
#define JAX_NVFP4_FFI_CUDA_DECODE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "numerics/nvfp4.h"

namespace jax_nvfp4 {

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

// The bfloat16 bits of two E4M3 scales (bytes 0 and 1 of `pair`), each in
// both halves of a word.
__device__ __forceinline__ void ScalePairsBf16(uint32_t pair, uint32_t& first,
                                               uint32_t& second) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // E4M3 -> f16 is exact (NaN stays NaN); f16 -> f32 too, and the scale's
  // 4 significant bits fit bfloat16.
  uint32_t halves;
  asm("{\n.reg .b16 low, high;\nmov.b32 {low, high}, %1;\n"
      "cvt.rn.f16x2.e4m3x2 %0, low;\n}"
      : "=r"(halves)
      : "r"(pair));
  float f0, f1;
  asm("{\n.reg .b16 low, high;\nmov.b32 {low, high}, %2;\n"
      "cvt.f32.f16 %0, low;\ncvt.f32.f16 %1, high;\n}"
      : "=f"(f0), "=f"(f1)
      : "r"(halves));
  first = ScaleBf16Pair(f0);
  second = ScaleBf16Pair(f1);
#else
  first = ScaleBf16Pair(E4M3Decode(pair & 0xFFu));
  second = ScaleBf16Pair(E4M3Decode((pair >> 8) & 0xFFu));
#endif
}

// The 8 elements of a code word (element j in nibble j) as bfloat16
// e2m1 * scale, elements 2i and 2i + 1 in the low and high half of word i;
// elements 0-3 take scale_low, 4-7 scale_high (bfloat16 pairs as
// ScaleBf16Pair gives them). The magnitudes' bytes come from the two byte
// tables (a nibble 0..7 selects one of 8 bytes); the signs by
// sign-replicating byte selection: byte k of `codes` holds element 2k + 1's
// sign in its bit 7 and, shifted left by 4, element 2k's. One bf16x2
// multiply per two elements applies the scale.
__device__ __forceinline__ uint4 DecodeCodes8Bf16(uint32_t codes,
                                                  uint32_t scale_low,
                                                  uint32_t scale_high) {
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
  __nv_bfloat162 scale2[2];
  memcpy(&scale2[0], &scale_low, sizeof scale2[0]);
  memcpy(&scale2[1], &scale_high, sizeof scale2[1]);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 v;
    memcpy(&v, &w[i], sizeof v);
    v = __hmul2(v, scale2[i / 2]);
    memcpy(&w[i], &v, sizeof v);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// All 8 elements with one scale.
__device__ __forceinline__ uint4 DecodeCodes8Bf16(uint32_t codes,
                                                  uint32_t scale_pair) {
  return DecodeCodes8Bf16(codes, scale_pair, scale_pair);
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_CUDA_DECODE_CUH_
