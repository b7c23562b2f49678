// The weight-only NVFP4 GEMM for serving (W4A16) on GPUs without FP4 tensor
// cores (compute capability >= 8.0): FFI target "jax_nvfp4_matmul_w4a16".
//
//   out[m, n] = (amax / 2688) * sum_k x[m, k] * e2m1(w[n, k]) * s[n, k / 16]
//
// x bfloat16 [M, K]; w's codes uint8 [N, K / 2] (element 2i in the low
// nibble of byte i) and E4M3 scales [N, K / 16], the layout of a weight
// quantized along K; amax float32 [1]. The weight is decoded in registers
// (e2m1 times its scale is exact in bfloat16): no bfloat16 copy of it is
// written to memory, so the kernel reads 4.5 bits per weight element, which
// is what matters at the small M of serving. Products of bf16 values are
// exact in float32 and the tensor cores (mma.sync m16n8k16) accumulate in
// float32; alpha = amax / 2688 (IEEE division) multiplies the sums and they
// are rounded once to the output type.
//
// CTA: kMTiles x 16 rows of x by 64 columns of w; K in stages of 256 (16
// blocks) through a cp.async pipeline, deep enough in bytes to keep the
// weight streaming at the few CTAs of a small M. 8 warps: 4 column groups of
// 16 by 2 halves of each stage's blocks; the halves' sums are added once at
// the end. Within a 16-k
// block, mma.sync's k index is permuted so that each lane's four elements are
// the two adjacent code bytes it reads: lane q (= lane % 4) holds actual
// elements 4q .. 4q + 3 where the instruction expects 2q, 2q + 1, 2q + 8,
// 2q + 9. x's fragments are read with the same permutation (two adjacent
// 32-bit words per row), so the sum is unchanged.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "bindings.h"
#include "checks.h"
#include "cuda/decode.cuh"
#include "cuda/launch.cuh"
#include "gemm/mma.cuh"
#include "numerics/nvfp4.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

constexpr int kTileN = 64;
constexpr int kTileK = 256;  // sixteen 16-element blocks per stage
constexpr int kBlocksPerStage = kTileK / 16;
constexpr int kStages = 3;
constexpr int kThreadsW4 = 256;  // 8 warps: 4 x 16 columns, 2 halves of K

template <int kMTiles>
struct Stage {
  static constexpr int kRows = 16 * kMTiles;
  static constexpr int kXBytes = kRows * kTileK * 2;            // 512-byte rows
  static constexpr int kCodeBytes = kTileN * kTileK / 2;        // 128-byte rows
  static constexpr int kScaleBytes = kTileN * kBlocksPerStage;  // 16-byte
  static constexpr int kBytes = kXBytes + kCodeBytes + kScaleBytes;
  static constexpr int kSmem = kStages * kBytes;
};

struct W4A16Args {
  const __nv_bfloat16* x;
  const uint8_t* codes;
  const uint8_t* scales;
  const float* amax;
  void* out;
  int64_t m, n, k;
};

// x's tile rows are 512 bytes; 16-byte chunk c of row r lies at c ^ (r % 8).
__device__ __forceinline__ int XOffset(int row, int k) {
  return row * kTileK + (((k >> 3) ^ (row & 7)) << 3) + (k & 7);
}

template <int kMTiles>
__device__ __forceinline__ void LoadStage(const W4A16Args& a,
                                          unsigned char* stage, int64_t m0,
                                          int64_t n0, int64_t k0) {
  using S = Stage<kMTiles>;
  __nv_bfloat16* x_tile = reinterpret_cast<__nv_bfloat16*>(stage);
  unsigned char* code_tile = stage + S::kXBytes;
  unsigned char* scale_tile = code_tile + S::kCodeBytes;
  constexpr int kXChunks = kTileK / 8;
  for (int i = threadIdx.x; i < S::kRows * kXChunks; i += kThreadsW4) {
    const int row = i / kXChunks, chunk = i % kXChunks;
    const int64_t r = m0 + row;
    const bool valid = r < a.m;
    const __nv_bfloat16* src = valid ? a.x + r * a.k + k0 + chunk * 8 : a.x;
    CopyChunk(SharedAddress(x_tile + XOffset(row, chunk * 8)), src, valid);
  }
  // codes: 64 rows x 8 chunks; scales: 64 rows x 1 chunk.
  constexpr int kCodeChunks = kTileK / 32;
  for (int i = threadIdx.x; i < kTileN * kCodeChunks; i += kThreadsW4) {
    const int row = i / kCodeChunks, chunk = i % kCodeChunks;
    const int64_t n = n0 + row;
    const bool valid = n < a.n;
    const uint8_t* src =
        valid ? a.codes + n * (a.k / 2) + k0 / 2 + chunk * 16 : a.codes;
    CopyChunk(SharedAddress(code_tile + row * (kTileK / 2) + chunk * 16), src,
              valid);
  }
  if (threadIdx.x < kTileN) {
    const int64_t n = n0 + threadIdx.x;
    const bool valid = n < a.n;
    const uint8_t* src = valid ? a.scales + n * (a.k / 16) + k0 / 16 : a.scales;
    CopyChunk(SharedAddress(scale_tile + threadIdx.x * kBlocksPerStage), src,
              valid);
  }
}

template <int kMTiles, typename Out>
__global__ void __launch_bounds__(kThreadsW4) W4A16Kernel(W4A16Args a) {
  using S = Stage<kMTiles>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * S::kRows;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTileN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q = lane % 4, g = lane / 4;
  const int columns = warp % 4, half = warp / 4;

  float acc[kMTiles][2][4];
#pragma unroll
  for (int i = 0; i < kMTiles; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  const int64_t steps = a.k / kTileK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps)
      LoadStage<kMTiles>(a, smem + s * S::kBytes, m0, n0, s * kTileK);
    CommitCopies();
  }
  for (int64_t step = 0; step < steps; ++step) {
    WaitCopies<kStages - 2>();
    __syncthreads();
    const int64_t next = step + kStages - 1;
    if (next < steps) {
      LoadStage<kMTiles>(a, smem + (next % kStages) * S::kBytes, m0, n0,
                         next * kTileK);
    }
    CommitCopies();

    const unsigned char* stage = smem + (step % kStages) * S::kBytes;
    const __nv_bfloat16* x_tile = reinterpret_cast<const __nv_bfloat16*>(stage);
    const unsigned char* code_tile = stage + S::kXBytes;
    const unsigned char* scale_tile = code_tile + S::kCodeBytes;
#pragma unroll
    for (int kh = 0; kh < kBlocksPerStage / 2; ++kh) {
      const int kk = half * (kBlocksPerStage / 2) + kh;
      uint32_t b[2][2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = columns * 16 + 8 * j + g;
        const uint32_t codes = *reinterpret_cast<const uint16_t*>(
            code_tile + col * (kTileK / 2) + kk * 8 + 2 * q);
        const uint4 v = DecodeCodes8Bf16(
            codes,
            ScaleBf16Pair(E4M3Decode(scale_tile[col * kBlocksPerStage + kk])));
        b[j][0] = v.x;  // elements 4q, 4q + 1
        b[j][1] = v.y;  // elements 4q + 2, 4q + 3
      }
#pragma unroll
      for (int i = 0; i < kMTiles; ++i) {
        uint32_t x_frag[4];
        const int row = 16 * i + g;
        const uint2 lo = *reinterpret_cast<const uint2*>(
            x_tile + XOffset(row, kk * 16 + 4 * q));
        const uint2 hi = *reinterpret_cast<const uint2*>(
            x_tile + XOffset(row + 8, kk * 16 + 4 * q));
        x_frag[0] = lo.x;  // row g: elements 4q, 4q + 1
        x_frag[1] = hi.x;  // row g + 8
        x_frag[2] = lo.y;  // row g: elements 4q + 2, 4q + 3
        x_frag[3] = hi.y;
#pragma unroll
        for (int j = 0; j < 2; ++j) Mma(acc[i][j], x_frag, b[j]);
      }
    }
  }
  WaitCopies<0>();
  __syncthreads();  // the pipeline's shared memory is free again

  // The second half's sums join the first's through shared memory.
  float* partial = reinterpret_cast<float*>(smem) + (columns * 32 + lane);
  constexpr int kPerLane = kMTiles * 2 * 4;
  constexpr int kStride = 4 * 32;  // lanes of the 4 column groups
  if (half == 1) {
#pragma unroll
    for (int i = 0; i < kMTiles; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          partial[((i * 2 + j) * 4 + e) * kStride] = acc[i][j][e];
        }
  }
  __syncthreads();
  if (half == 1) return;
#pragma unroll
  for (int i = 0; i < kMTiles; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc[i][j][e] += partial[((i * 2 + j) * 4 + e) * kStride];
      }
  static_assert(kPerLane * kStride * 4 <= Stage<kMTiles>::kSmem, "fits");

  const float alpha = a.amax[0] / kScaleRange;  // IEEE division (no fast-math)
  Out* out = static_cast<Out*>(a.out);
#pragma unroll
  for (int i = 0; i < kMTiles; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = m0 + 16 * i + g + 8 * h;
      if (r >= a.m) continue;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int64_t n = n0 + columns * 16 + 8 * j + 2 * q;
        if (n >= a.n) continue;  // N is even: n + 1 < N too
        StorePair(out + r * a.n + n, acc[i][j][2 * h] * alpha,
                  acc[i][j][2 * h + 1] * alpha);
      }
    }
  }
}

template <int kMTiles, typename Out>
ffi::Error Launch(cudaStream_t stream, const W4A16Args& a) {
  const auto kernel = W4A16Kernel<kMTiles, Out>;
  constexpr int smem = Stage<kMTiles>::kSmem;
  if (smem > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           smem) != cudaSuccess) {
    return LaunchError("matmul_w4a16 (shared memory)");
  }
  const int64_t m_tiles = (a.m + 16 * kMTiles - 1) / (16 * kMTiles);
  const dim3 grid(static_cast<unsigned int>((a.n + kTileN - 1) / kTileN),
                  static_cast<unsigned int>(m_tiles));
  kernel<<<grid, kThreadsW4, smem, stream>>>(a);
  return LaunchError("matmul_w4a16");
}

template <typename Out>
ffi::Error LaunchFor(cudaStream_t stream, const W4A16Args& a) {
  // Rows of x per CTA: the weight tile is decoded once per CTA, so larger M
  // takes taller tiles.
  if (a.m <= 16) return Launch<1, Out>(stream, a);
  if (a.m <= 32) return Launch<2, Out>(stream, a);
  return Launch<4, Out>(stream, a);
}

ffi::Error MatmulW4A16Cuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> x,
                           ffi::Buffer<ffi::U8> codes, ffi::AnyBuffer scales,
                           ffi::Buffer<ffi::F32> amax,
                           ffi::Result<ffi::AnyBuffer> out) {
  const auto xd = x.dimensions(), cd = codes.dimensions();
  const auto od = out->dimensions();
  if (xd.size() != 2 || cd.size() != 2 || od.size() != 2 ||
      cd[1] * 2 != xd[1] || od[0] != xd[0] || od[1] != cd[0] ||
      scales.element_count() != cd[0] * xd[1] / 16 ||
      scales.element_type() != ffi::DataType::F8E4M3FN ||
      amax.element_count() != 1) {
    return InvalidArgument(
        "matmul_w4a16 expects x bf16 [M, K], codes u8 [N, K/2], e4m3 scales "
        "[N, K/16], amax f32 [1] and out [M, N]");
  }
  W4A16Args a;
  a.x = static_cast<const __nv_bfloat16*>(x.untyped_data());
  a.codes = codes.typed_data();
  a.scales = static_cast<const uint8_t*>(scales.untyped_data());
  a.amax = amax.typed_data();
  a.out = out->untyped_data();
  a.m = xd[0];
  a.n = cd[0];
  a.k = xd[1];
  if (a.k % kTileK != 0 || a.n % 2 != 0) {
    return InvalidArgument(
        "matmul_w4a16 needs K a multiple of 256 and N even (jax_nvfp4 runs "
        "the decoding GEMM otherwise)");
  }
  if (!IsAligned(a.x, 16) || !IsAligned(a.codes, 16) ||
      !IsAligned(a.scales, 4) || !IsAligned(a.out, 8)) {
    return InvalidArgument("matmul_w4a16 needs 16-byte aligned operands");
  }
  if (a.m == 0 || a.n == 0) return ffi::Error::Success();
  if ((a.m + 15) / 16 > 65535) {
    return InvalidArgument("matmul_w4a16: at most 1048560 rows of x per call");
  }
  switch (out->element_type()) {
    case ffi::DataType::BF16:
      return LaunchFor<__nv_bfloat16>(stream, a);
    case ffi::DataType::F32:
      return LaunchFor<float>(stream, a);
    default:
      return InvalidArgument(
          "matmul_w4a16: the output must be bfloat16 or float32");
  }
}

}  // namespace
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4MatmulW4A16Cuda, jax_nvfp4::MatmulW4A16Cuda,
    jax_nvfp4::MatmulW4A16Binding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
