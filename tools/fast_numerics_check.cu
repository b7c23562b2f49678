// Exhaustive check, on a GPU, that the fast device arithmetic of
// ffi/numerics/fast.cuh equals the header arithmetic of
// ffi/numerics/nvfp4.h (the CPU handlers' and the pure-JAX twin's):
//   1. E4M3FromFloat == E4M3RoundSatfinite / E4M3Encode for every
//      non-negative float up to +inf (clamped to FLT_MAX as BlockScale does);
//   2. EncodeBlock16Fast == EncodeBlock16, round to nearest, on every finite
//      float32 bit pattern (2^28 blocks of 16 consecutive patterns,
//      multiplier 1; the 2^20 blocks of NaN / inf patterns take step 3a,
//      codes 0, in the kernels and are skipped);
//   3. the same with stochastic rounding, two random bytes per pattern;
//   4. RandomHadamard16Fast == RandomHadamard16 on 2^24 random blocks (NaN
//      payloads aside), and RandomHadamard16FastPacked (values and packed
//      words) on 2^24 random bfloat16 blocks;
//   5. SignBits16Bf16 == SignBits16 on 2^24 random bfloat16 blocks;
//   6. BlockAmax and BlockAmaxBf16 == the header's BlockAmaxStep loop (max
//      |v|, +inf for a block holding a NaN or +-inf), and a fmaxf loop of
//      FiniteAbsOrZero == the header's MaxAbsFinite loop (the amax kernels'
//      terms), on the same blocks, NaN / inf / -0.0 / subnormal elements
//      included (a subnormal maximum counts as zero).
// Built with -ftz=true, as the handlers are: both sides flush subnormals.
//
//   nvcc -std=c++17 -O3 --fmad=false -ftz=true -arch=sm_90a -I ffi \
//        tools/fast_numerics_check.cu -o /tmp/fast_numerics_check
//   /tmp/fast_numerics_check      # prints mismatch counts; exit 1 if any
#include <cstdio>

#include "numerics/fast.cuh"

using namespace jax_nvfp4;

__device__ unsigned long long g_mismatch[7];

// The bits of v with a subnormal replaced by a zero of its sign.
__device__ __forceinline__ uint32_t FlushedBits(float v) {
  const uint32_t bits = FloatBits(v);
  return (bits & 0x7F800000u) != 0 ? bits : bits & 0x80000000u;
}

__device__ __forceinline__ uint32_t Hash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

__global__ void CheckE4M3(uint32_t first, uint32_t count) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += gridDim.x * blockDim.x) {
    const float v = fminf(BitsToFloat(first + i), FLT_MAX);
    const float want = E4M3RoundSatfinite(v);
    const BlockScaleE4M3 got = E4M3FromFloat(v);
    if (FloatBits(got.value) != FloatBits(want) ||
        got.byte != E4M3Encode(want)) {
      atomicAdd(&g_mismatch[0], 1ull);
    }
  }
}

// Block b holds the 16 bit patterns 16b .. 16b + 15.
__global__ void CheckEncode(uint64_t blocks, uint32_t salt) {
  for (uint64_t b =
           blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
       b < blocks; b += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    float v[kBlock];
    bool finite = true;
    for (int i = 0; i < kBlock; ++i) {
      v[i] = BitsToFloat(static_cast<uint32_t>(16 * b + i));
      finite &= IsFinite(v[i]);
    }
    if (!finite) continue;  // step 3a: the kernels write codes 0
    const uint32_t h0 = Hash(static_cast<uint32_t>(b) ^ salt);
    const uint32_t h1 = Hash(h0 + 1), h2 = Hash(h0 + 2), h3 = Hash(h0 + 3);
    const uint64_t lo = h0 | (static_cast<uint64_t>(h1) << 32);
    const uint64_t hi = h2 | (static_cast<uint64_t>(h3) << 32);
    if (salt == 0) {
      const uint64_t want = EncodeBlock16(v, 1.0f, false, 0, 0);
      float block_amax = 0.0f;  // below 7: the uncapped form too
      for (int i = 0; i < kBlock; ++i)
        block_amax = fmaxf(block_amax, fabsf(v[i]));
      const bool below_seven = block_amax < 7.0f;
      if (EncodeBlock16Fast(v, 1.0f, false, 0, 0) != want ||
          (below_seven &&
           EncodeBlock16Fast(v, 1.0f, false, 0, 0, true) != want)) {
        atomicAdd(&g_mismatch[1], 1ull);
      }
    }
    if (EncodeBlock16Fast(v, 1.0f, true, lo, hi) !=
        EncodeBlock16(v, 1.0f, true, lo, hi)) {
      atomicAdd(&g_mismatch[2], 1ull);
    }
  }
}

__global__ void CheckRht(uint32_t blocks) {
  for (uint32_t b = blockIdx.x * blockDim.x + threadIdx.x; b < blocks;
       b += gridDim.x * blockDim.x) {
    float x[kBlock], want[kBlock], got[kBlock];
    for (int i = 0; i < kBlock; ++i) {
      uint32_t u = Hash(16 * b + i);
      // A third of the blocks near one binade (sums that cancel and round).
      if (b % 3 == 0) u = (u & 0x807FFFFFu) | 0x3F800000u;
      x[i] = BitsToFloat(u);
    }
    RandomHadamard16(x, want);
    RandomHadamard16Fast(x, got);
    for (int i = 0; i < kBlock; ++i) {
      const bool both_nan = want[i] != want[i] && got[i] != got[i];
      if (!both_nan && FloatBits(got[i]) != FloatBits(want[i])) {
        atomicAdd(&g_mismatch[3], 1ull);
      }
    }
  }
}

// x's bfloat16 bits in words (element 2j in the low half of word j).
__global__ void CheckBf16Blocks(uint32_t blocks) {
  for (uint32_t b = blockIdx.x * blockDim.x + threadIdx.x; b < blocks;
       b += gridDim.x * blockDim.x) {
    float x[kBlock], want[kBlock], got[kBlock];
    uint32_t words[kBlock / 2] = {}, packed[kBlock / 2];
    for (int i = 0; i < kBlock; ++i) {
      uint32_t u = Hash(16 * b + i + 0x51ED270Bu) & 0xFFFF0000u;
      if (b % 3 == 0) u = (u & 0x807F0000u) | 0x3F800000u;  // one binade
      if (b % 7 == 0) u &= 0x80FF0000u;  // tiny: subnormal quarters
      x[i] = BitsToFloat(u);
      words[i / 2] |= (i % 2 == 0) ? u >> 16 : u;
    }
    if (SignBits16Bf16(words) != SignBits16(x)) {
      atomicAdd(&g_mismatch[4], 1ull);
    }
    // Specials at hashed places: NaN, +-inf, -0.0, a subnormal.
    const uint32_t special = Hash(b ^ 0xA5A5A5A5u);
    if (special % 5 == 0) {
      const int i = (special >> 8) % kBlock;
      const uint32_t u =
          0x7FC00000u ^ ((special >> 12) % 4 == 0 ? 0x80000000u : 0u);
      const uint32_t kinds[4] = {u, 0x7F800000u, 0xFF800000u, 0x80000000u};
      const uint32_t bits = (special >> 16) % 5 == 4
                                ? ((special >> 20) & 0x7Fu) << 16
                                : kinds[(special >> 16) % 4];
      x[i] = BitsToFloat(bits);
      words[i / 2] = (i % 2 == 0) ? (words[i / 2] & 0xFFFF0000u) | (bits >> 16)
                                  : (words[i / 2] & 0xFFFFu) | bits;
    }
    float block = 0.0f, finite = 0.0f, finite_fast = 0.0f;
    for (int i = 0; i < kBlock; ++i) {
      block = BlockAmaxStep(block, x[i]);
      finite = MaxAbsFinite(finite, x[i]);
      finite_fast = fmaxf(finite_fast, FiniteAbsOrZero(x[i]));
    }
    const float tree = BlockAmax(x), pairs = BlockAmaxBf16(words);
    // max.NaN (asm, no .ftz) and the bfloat16 maximum may keep a subnormal
    // amax that the header's loop (-ftz=true) flushes; the block scale's
    // multiply flushes it too, so the maxima agree up to that.
    if (FlushedBits(tree) != FloatBits(block) ||
        FlushedBits(pairs) != FloatBits(block) ||
        FlushedBits(finite_fast) != FloatBits(finite)) {
      atomicAdd(&g_mismatch[6], 1ull);
    }
    RandomHadamard16(x, want);
    RandomHadamard16FastPacked(x, got, packed);
    for (int i = 0; i < kBlock; ++i) {
      const bool both_nan = want[i] != want[i] && got[i] != got[i];
      const uint32_t half =
          (i % 2 == 0) ? packed[i / 2] << 16 : packed[i / 2] & 0xFFFF0000u;
      if (!both_nan && (FloatBits(got[i]) != FloatBits(want[i]) ||
                        half != FloatBits(got[i]))) {
        atomicAdd(&g_mismatch[5], 1ull);
      }
    }
  }
}

int main() {
  const int grid = 132 * 16, threads = 256;
  CheckE4M3<<<grid, threads>>>(0u, 0x7F800001u);
  CheckEncode<<<grid, threads>>>(1ull << 28, 0u);
  CheckEncode<<<grid, threads>>>(1ull << 28, 0x9E3779B9u);
  CheckRht<<<grid, threads>>>(1u << 24);
  CheckBf16Blocks<<<grid, threads>>>(1u << 24);
  unsigned long long mismatch[7];
  if (cudaMemcpyFromSymbol(mismatch, g_mismatch, sizeof(mismatch)) !=
      cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 2;
  }
  std::printf(
      "fast numerics vs header: E4M3 %llu, nearest %llu, stochastic %llu, RHT "
      "%llu, bf16 signs %llu, bf16 RHT %llu, block amax %llu mismatches\n",
      mismatch[0], mismatch[1], mismatch[2], mismatch[3], mismatch[4],
      mismatch[5], mismatch[6]);
  unsigned long long any = 0;
  for (unsigned long long m : mismatch) any |= m;
  return any ? 1 : 0;
}
