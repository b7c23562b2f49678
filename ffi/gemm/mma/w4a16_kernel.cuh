// The kernel of the weight-only NVFP4 GEMM (W4A16) for serving's few rows:
//
//   out[m, n] = (amax / 2688) * sum_k x[m, k] * e2m1(w[n, k]) * s[n, k / 16]
//
// At M <= 64 the GEMM reads the weight once and is bound by its bytes (4.5
// bits per element), so the kernel is built to keep as many weight bytes in
// flight as the memory system needs and to decode them cheaply:
//
// - The weight goes from global memory straight to registers, 16 bytes per
//   lane per load, through a ring of kDepth chunks per warp (no shared
//   memory, no barrier). A warp's load covers 8 columns (lane / 4) by 128
//   elements of K: lane q = lane % 4 reads elements 32q .. 32q + 31 of its
//   column's 128, so a quad reads 64 contiguous bytes.
// - mma.sync m16n8k16 (bf16, float32 accumulation) takes each lane's
//   elements in the order it read them: in the 128-element chunk, step s
//   (0..7) gives lane q's actual elements 32q + 4s .. 32q + 4s + 3 the roles
//   of the instruction's k = 2q, 2q + 1, 2q + 8, 2q + 9. x's fragments are
//   stored in shared memory permuted the same way, one 16-byte load per lane
//   and step, so every product pairs x[m, k] with w[n, k] of the same k.
// - e2m1 times its E4M3 scale is exact in bfloat16 (decode.cuh), products of
//   bf16 values are exact in float32: the sums differ from the reference
//   only in their order.
// - K is split into slices (grid.y) so that a few hundred CTAs share the
//   weight. With more than one slice, each CTA writes its float32 partial
//   sums to the workspace and the last CTA of a column tile (an atomic count
//   per tile) adds the slices in slice order, so the result does not depend
//   on which CTA finishes first. Alpha multiplies the final sums; one
//   rounding to the output type.
#ifndef JAX_NVFP4_FFI_GEMM_MMA_W4A16_KERNEL_CUH_
#define JAX_NVFP4_FFI_GEMM_MMA_W4A16_KERNEL_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/decode.cuh"
#include "gemm/mma/mma.cuh"
#include "gemm/mma/w4a16_gemm_plan.h"
#include "numerics/nvfp4.h"

namespace jax_nvfp4 {
namespace w4a16 {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

struct Args {
  const __nv_bfloat16* x;  // [m, k]
  const uint8_t* codes;    // [n, k / 2]
  const uint8_t* scales;   // [n, k / 16], E4M3
  const float* amax;       // [1]
  void* out;               // [m, n]
  float* partial;          // [slices, m, n] where slices > 1
  unsigned int* arrivals;  // one per (m tile, column tile), zeroed
  int64_t m, n, k;
};

// x's fragments for m-tile i and step s of chunk t, lane by lane, 16 bytes:
// mma.sync's a0 .. a3 (row g's first k pair, row g + 8's, row g's second,
// row g + 8's).
template <int kMTiles>
__device__ __forceinline__ int FragmentIndex(int t, int s, int i, int lane) {
  return ((t * 8 + s) * kMTiles + i) * 32 + lane;
}

// Two CTAs per multiprocessor (at most 128 registers a thread): more warps to
// hide the weight's latency matter more than registers for deeper rings.
template <int kMTiles, int kTiles, int kDepth, int kChunks, typename Out>
__global__ void __launch_bounds__(kThreads, 2) Kernel(Args a) {
  extern __shared__ __align__(16) uint4 x_frags[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int q = lane % 4, g = lane / 4;
  const int64_t m0 = static_cast<int64_t>(blockIdx.z) * 16 * kMTiles;
  const int64_t n_warp =
      (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * 8 * kTiles;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * kChunks * 128;
  const int chunks =
      static_cast<int>(min(static_cast<int64_t>(kChunks), (a.k - k0) / 128));

  // The weight streams through a ring of kDepth chunks in registers: chunk
  // t + kDepth is requested as soon as chunk t is decoded.
  const uint8_t* code_row[kTiles];
  const uint8_t* scale_row[kTiles];
  bool column[kTiles];
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    const int64_t n = n_warp + 8 * j + g;
    column[j] = n < a.n;
    code_row[j] = a.codes + (column[j] ? n : 0) * (a.k / 2) + k0 / 2 + 16 * q;
    scale_row[j] =
        a.scales + (column[j] ? n : 0) * (a.k / 16) + k0 / 16 + 2 * q;
  }
  uint4 codes[kDepth][kTiles];
  uint32_t scales[kDepth][kTiles];
  auto request = [&](int d, int t) {
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      if (column[j] && t < chunks) {
        codes[d][j] =
            __ldg(reinterpret_cast<const uint4*>(code_row[j] + t * 64));
        scales[d][j] =
            __ldg(reinterpret_cast<const uint16_t*>(scale_row[j] + t * 8));
      } else {
        codes[d][j] = make_uint4(0, 0, 0, 0);
        scales[d][j] = 0;
      }
    }
  };
#pragma unroll
  for (int d = 0; d < kDepth; ++d) request(d, d);

  // x's slice into fragments, 16 bytes of a row (8 elements: steps s, s + 1)
  // per load; zeros past M and past K. Loads are issued in batches before
  // their stores so that their latencies overlap.
  {
    constexpr int kPerRow = kChunks * 16;  // 16-byte pieces of a row
    constexpr int kLoads = 16 * kMTiles * kPerRow / kThreads;
    constexpr int kBatch = kLoads < 4 ? kLoads : 4;
    static_assert(kLoads % kBatch == 0, "whole batches");
    uint32_t* words = reinterpret_cast<uint32_t*>(x_frags);
#pragma unroll
    for (int l0 = 0; l0 < kLoads; l0 += kBatch) {
      uint4 v[kBatch];
#pragma unroll
      for (int l = 0; l < kBatch; ++l) {
        const int f = (l0 + l) * kThreads + threadIdx.x;
        const int64_t r = m0 + f / kPerRow;
        const int u = f % kPerRow;
        v[l] = make_uint4(0, 0, 0, 0);
        if (r < a.m && u < chunks * 16)
          v[l] =
              __ldg(reinterpret_cast<const uint4*>(a.x + r * a.k + k0 + 8 * u));
      }
#pragma unroll
      for (int l = 0; l < kBatch; ++l) {
        const int f = (l0 + l) * kThreads + threadIdx.x;
        const int row = f / kPerRow, u = f % kPerRow;
        const int t = u / 16, s = 2 * (u % 4);
        const int lane_of = (row % 8) * 4 + (u % 16) / 4;
        const int upper = (row % 16) / 8, i = row / 16;
        uint32_t* step = words + 4 * FragmentIndex<kMTiles>(t, s, i, lane_of);
        uint32_t* next = step + 4 * 32 * kMTiles;  // step s + 1
        step[upper] = v[l].x;
        step[upper + 2] = v[l].y;
        next[upper] = v[l].z;
        next[upper + 2] = v[l].w;
      }
    }
  }
  __syncthreads();

  float acc[kMTiles][kTiles][4];
#pragma unroll
  for (int i = 0; i < kMTiles; ++i)
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  for (int t0 = 0; t0 < chunks; t0 += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int t = t0 + d;
      if (t >= chunks) break;
      uint32_t b[kTiles][16];  // word w's pairs: steps 2w (0, 1), 2w + 1 (2, 3)
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        uint32_t first, second;  // the blocks of words 0-1 and 2-3
        ScalePairsBf16(scales[d][j], first, second);
        const uint32_t words[4] = {codes[d][j].x, codes[d][j].y, codes[d][j].z,
                                   codes[d][j].w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const uint4 v = DecodeCodes8Bf16(words[w], w < 2 ? first : second);
          b[j][4 * w + 0] = v.x;
          b[j][4 * w + 1] = v.y;
          b[j][4 * w + 2] = v.z;
          b[j][4 * w + 3] = v.w;
        }
      }
      request(d, t + kDepth);
#pragma unroll
      for (int s = 0; s < 8; ++s) {
#pragma unroll
        for (int i = 0; i < kMTiles; ++i) {
          const uint4 xf = x_frags[FragmentIndex<kMTiles>(t, s, i, lane)];
          const uint32_t frag[4] = {xf.x, xf.y, xf.z, xf.w};
#pragma unroll
          for (int j = 0; j < kTiles; ++j) Mma(acc[i][j], frag, &b[j][2 * s]);
        }
      }
    }
  }

  const float alpha = a.amax[0] / kScaleRange;  // IEEE division (no fast-math)
  Out* out = static_cast<Out*>(a.out);
  if (gridDim.y == 1) {
#pragma unroll
    for (int i = 0; i < kMTiles; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t r = m0 + 16 * i + g + 8 * h;
        if (r >= a.m) continue;
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
          const int64_t n = n_warp + 8 * j + 2 * q;
          if (n < a.n)
            StorePair(out + r * a.n + n, acc[i][j][2 * h] * alpha,
                      acc[i][j][2 * h + 1] * alpha);
        }
      }
    return;
  }

  // Split K: partial sums out, then the last CTA of the tile adds them.
  float* mine = a.partial + static_cast<int64_t>(blockIdx.y) * a.m * a.n;
#pragma unroll
  for (int i = 0; i < kMTiles; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = m0 + 16 * i + g + 8 * h;
      if (r >= a.m) continue;
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        const int64_t n = n_warp + 8 * j + 2 * q;
        if (n < a.n)
          __stcg(reinterpret_cast<float2*>(mine + r * a.n + n),
                 make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]));
      }
    }
  __threadfence();
  __syncthreads();
  __shared__ unsigned int arrived;
  unsigned int* count = a.arrivals + blockIdx.z * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0) arrived = atomicAdd(count, 1u);
  __syncthreads();
  if (arrived != gridDim.y - 1) return;
  __threadfence();  // the other slices' partial sums are visible
#pragma unroll
  for (int i = 0; i < kMTiles; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = m0 + 16 * i + g + 8 * h;
      if (r >= a.m) continue;
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        const int64_t n = n_warp + 8 * j + 2 * q;
        if (n >= a.n) continue;
        float2 sum = make_float2(0.0f, 0.0f);
        for (unsigned int slice = 0; slice < gridDim.y; ++slice) {
          const float2 p = __ldcg(reinterpret_cast<const float2*>(
              a.partial + (slice * a.m + r) * a.n + n));
          sum.x += p.x;
          sum.y += p.y;
        }
        StorePair(out + r * a.n + n, sum.x * alpha, sum.y * alpha);
      }
    }
}

template <int kMTiles, int kTiles, int kDepth, int kChunks, typename Out>
cudaError_t LaunchConfig(cudaStream_t stream, const Args& a, int slices) {
  const auto kernel = Kernel<kMTiles, kTiles, kDepth, kChunks, Out>;
  const int smem = kChunks * 8 * kMTiles * 32 * 16;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  const int64_t columns = kWarps * 8 * kTiles;
  const dim3 grid(
      static_cast<unsigned int>((a.n + columns - 1) / columns),
      static_cast<unsigned int>(slices),
      static_cast<unsigned int>((a.m + 16 * kMTiles - 1) / (16 * kMTiles)));
  kernel<<<grid, kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

// The kernel in the configuration a plan chose (PlanW4A16). The arrival
// counts must be zeroed before.
template <typename Out>
cudaError_t LaunchPlanned(cudaStream_t stream, const Args& a,
                          const W4A16Plan& p) {
  const int slices = static_cast<int>(p.slices);
  const W4A16Config c = p.config;
  // The configurations ChooseW4A16Config returns.
  if (c.m_tiles == 1 && c.tiles == 2 && c.depth == 3 && c.chunks == 16)
    return LaunchConfig<1, 2, 3, 16, Out>(stream, a, slices);
  if (c.m_tiles == 2 && c.tiles == 2 && c.depth == 2 && c.chunks == 8)
    return LaunchConfig<2, 2, 2, 8, Out>(stream, a, slices);
  if (c.m_tiles == 4 && c.tiles == 2 && c.depth == 2 && c.chunks == 4)
    return LaunchConfig<4, 2, 2, 4, Out>(stream, a, slices);
  return cudaErrorInvalidConfiguration;
}

}  // namespace w4a16
}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_MMA_W4A16_KERNEL_CUH_
