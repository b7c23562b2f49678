// The grouped bf16 GEMM of ragged_dot on GPUs without FP4 tensor cores
// (compute capability >= 8.0): FFI target "jax_nvfp4_grouped_gemm_bf16".
//
// jax_nvfp4/ragged_dot.py hands it NVFP4 operands decoded to bfloat16 (exact:
// e2m1 times an E4M3 scale fits bf16), laid out in a token buffer where every
// group starts at a multiple of 16 rows. Products of bf16 values are exact in
// float32 and are accumulated in float32 by the tensor cores (mma.sync
// m16n8k16); the epilogue multiplies by the group's alpha and rounds once to
// the output type. Two forms, both "TN" (both operands contiguous along the
// contraction, read in 16-element blocks):
//
//   rows   (FPROP, DGRAD): out[r, n] = alpha[g] * sum_c a[r, c] * b[g, n, c]
//          for the rows r of group g; a [R, L], b [G, N, L], out [R, N].
//          Rows outside every group are not written (ragged_dot.py reads only
//          the rows of its tokens).
//   tokens (WGRAD): out[g, m, n] = alpha[g] * sum over group g's tokens t of
//          a[t, m] * b[t, n], where a is stored as items of 16 tokens,
//          [items, M, 16] (a token-axis block per feature), and b [items, N,
//          16]; empty groups give zeros.
//
// sizes [G] are the groups' row (token) counts in the buffer, multiples of
// 16, read on the device: no host synchronization, so the handler is safe to
// record into CUDA graphs. A CTA computes a 128 x 128 tile of one group only:
// it never reads another group's rows, so a NaN stays in its group.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "bindings.h"
#include "checks.h"
#include "cuda/launch.cuh"
#include "gemm/mma/mma.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

constexpr int kTileM = 128;
constexpr int kTileN = 128;
constexpr int kTileK = 32;  // two 16-element blocks per stage
constexpr int kBlocksPerStage = kTileK / 16;
constexpr int kStages = 4;
constexpr int kGemmThreads = 256;  // 8 warps: 2 along M x 4 along N
constexpr int kWarpM = 64;         // each warp: 64 x 32 of the tile
constexpr int kWarpN = 32;
constexpr int kChunksPerRow = kTileK / 8;  // 16-byte chunks of a tile row
constexpr int kStageElements = (kTileM + kTileN) * kTileK;
constexpr int kSmemBytes = kStages * kStageElements * 2;

// Where element (row, 16 * block + j) of an operand lives.
struct OperandView {
  const __nv_bfloat16* base;
  int64_t row_stride;    // elements between rows
  int64_t block_stride;  // elements between 16-element blocks
};

struct GroupedGemmArgs {
  OperandView a, b;
  int64_t b_group_stride;  // rows form: elements between b[g] and b[g + 1]
  const int32_t* sizes;    // [groups], multiples of 16
  const float* alpha;      // [groups]
  void* out;
  int64_t groups;
  int64_t a_rows;  // rows form: R; tokens form: M
  int64_t b_rows;  // N
  int64_t blocks;  // rows form: L / 16 (tokens form: from sizes)
  bool tokens;
};

// A tile row (64 bytes) has its 16-byte chunk c at chunk c ^ ((row / 2) % 4):
// the 8 rows an ldmatrix reads then fall in 8 different bank groups.
__device__ __forceinline__ int SwizzledChunk(int row, int chunk) {
  return chunk ^ ((row >> 1) & 3);
}

// One stage: the tile's rows [row0, row0 + 128) of `view` (valid below
// row_end), 16-element blocks [block, block + 2) (valid below block_end).
template <int kRows>
__device__ __forceinline__ void LoadTile(const OperandView& view,
                                         __nv_bfloat16* tile, int64_t row0,
                                         int64_t row_end, int64_t block,
                                         int64_t block_end) {
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kGemmThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int it = 0; it < kChunks / kGemmThreads; ++it) {
    const int i = threadIdx.x + it * kGemmThreads;
    const int row = i / kChunksPerRow, chunk = i % kChunksPerRow;
    const int64_t r = row0 + row, blk = block + chunk / 2;
    const bool valid = r < row_end && blk < block_end;
    const __nv_bfloat16* src = valid ? view.base + r * view.row_stride +
                                           blk * view.block_stride +
                                           (chunk % 2) * 8
                                     : view.base;
    CopyChunk(
        SharedAddress(tile + row * kTileK + SwizzledChunk(row, chunk) * 8), src,
        valid);
  }
}

template <typename Out>
__global__ void __launch_bounds__(kGemmThreads)
    GroupedGemmKernel(GroupedGemmArgs args) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __nv_bfloat16* smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);

  // The tile's group, its rows of a (rows form) and its contraction blocks.
  int64_t group = -1, a_row0 = 0, a_row_end = args.a_rows;
  int64_t block0 = 0, block_end = args.blocks;
  const int64_t b_row0 = static_cast<int64_t>(blockIdx.y) * kTileN;
  OperandView b = args.b;
  if (args.tokens) {
    group = blockIdx.z;
    a_row0 = static_cast<int64_t>(blockIdx.x) * kTileM;
    int64_t start = 0;
    for (int64_t g = 0; g < group; ++g) start += args.sizes[g];
    block0 = start / 16;
    block_end = block0 + args.sizes[group] / 16;
  } else {
    int64_t tile = blockIdx.x, start = 0;
    for (int64_t g = 0; g < args.groups; ++g) {
      const int64_t size = args.sizes[g];
      const int64_t tiles = (size + kTileM - 1) / kTileM;
      if (tile < tiles) {
        group = g;
        a_row0 = start + tile * kTileM;
        a_row_end = min(start + size, args.a_rows);
        break;
      }
      tile -= tiles;
      start += size;
    }
    if (group < 0) return;  // past the groups' tiles
    b.base += group * args.b_group_stride;
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = (warp / (kTileN / kWarpN)) * kWarpM;
  const int warp_n = (warp % (kTileN / kWarpN)) * kWarpN;

  float acc[4][4][4];  // [m16 tile][n8 tile][fragment]
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  const int64_t steps =
      (block_end - block0 + kBlocksPerStage - 1) / kBlocksPerStage;
  auto load_stage = [&](int64_t step) {
    __nv_bfloat16* a_tile = smem + (step % kStages) * kStageElements;
    __nv_bfloat16* b_tile = a_tile + kTileM * kTileK;
    const int64_t block = block0 + kBlocksPerStage * step;
    LoadTile<kTileM>(args.a, a_tile, a_row0, a_row_end, block, block_end);
    LoadTile<kTileN>(b, b_tile, b_row0, args.b_rows, block, block_end);
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) load_stage(s);
    CommitCopies();
  }
  for (int64_t step = 0; step < steps; ++step) {
    WaitCopies<kStages - 2>();
    __syncthreads();
    if (step + kStages - 1 < steps) load_stage(step + kStages - 1);
    CommitCopies();

    const __nv_bfloat16* a_tile = smem + (step % kStages) * kStageElements;
    const __nv_bfloat16* b_tile = a_tile + kTileM * kTileK;
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) {
      uint32_t a_frag[4][4], b_frag[4][2];
      const int quad = lane / 8, row8 = lane % 8;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        // Matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15): a0, a1, a2, a3.
        const int row = warp_m + 16 * i + row8 + (quad & 1) * 8;
        const int chunk = 2 * kk + (quad >> 1);
        LoadMatrices(SharedAddress(a_tile + row * kTileK +
                                   SwizzledChunk(row, chunk) * 8),
                     a_frag[i]);
      }
#pragma unroll
      for (int j = 0; j < 4; j += 2) {
        // Matrices (n 0-7: k 0-7 | 8-15), (n 8-15: k 0-7 | 8-15).
        const int row = warp_n + 8 * j + row8 + (quad >> 1) * 8;
        const int chunk = 2 * kk + (quad & 1);
        uint32_t r[4];
        LoadMatrices(SharedAddress(b_tile + row * kTileK +
                                   SwizzledChunk(row, chunk) * 8),
                     r);
        b_frag[j][0] = r[0];
        b_frag[j][1] = r[1];
        b_frag[j + 1][0] = r[2];
        b_frag[j + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) Mma(acc[i][j], a_frag[i], b_frag[j]);
    }
  }
  WaitCopies<0>();

  const float alpha = args.alpha[group];
  Out* out = static_cast<Out*>(args.out);
  if (args.tokens) out += group * args.a_rows * args.b_rows;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t r = a_row0 + warp_m + 16 * i + lane / 4 + 8 * half;
      if (r >= a_row_end) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t n = b_row0 + warp_n + 8 * j + 2 * (lane % 4);
        if (n >= args.b_rows) continue;  // N is even: n + 1 < N too
        StorePair(out + r * args.b_rows + n, acc[i][j][2 * half] * alpha,
                  acc[i][j][2 * half + 1] * alpha);
      }
    }
  }
}

const __nv_bfloat16* Bf16(const void* p) {
  return static_cast<const __nv_bfloat16*>(p);
}

template <typename Out>
ffi::Error Launch(cudaStream_t stream, const GroupedGemmArgs& args,
                  int64_t a_tiles) {
  const auto kernel = GroupedGemmKernel<Out>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           kSmemBytes) != cudaSuccess) {
    return LaunchError("grouped_gemm_bf16 (shared memory)");
  }
  const dim3 grid(
      static_cast<unsigned int>(a_tiles),
      static_cast<unsigned int>((args.b_rows + kTileN - 1) / kTileN),
      static_cast<unsigned int>(args.tokens ? args.groups : 1));
  kernel<<<grid, kGemmThreads, kSmemBytes, stream>>>(args);
  return LaunchError("grouped_gemm_bf16");
}

ffi::Error GroupedGemmBf16Cuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> a,
                               ffi::Buffer<ffi::BF16> b,
                               ffi::Buffer<ffi::S32> sizes,
                               ffi::Buffer<ffi::F32> alpha,
                               ffi::Result<ffi::AnyBuffer> out, bool tokens) {
  const auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  const int64_t groups = sizes.element_count();
  GroupedGemmArgs args{};
  args.tokens = tokens;
  args.groups = groups;
  args.sizes = sizes.typed_data();
  args.alpha = alpha.typed_data();
  args.out = out->untyped_data();
  int64_t a_tiles = 0;
  if (groups < 1 || alpha.element_count() != groups) {
    return InvalidArgument("grouped_gemm_bf16: sizes and alpha must be [G]");
  }
  if (!tokens) {
    // a [R, L], b [G, N, L], out [R, N]
    if (ad.size() != 2 || bd.size() != 3 || od.size() != 2 || bd[0] != groups ||
        bd[2] != ad[1] || ad[1] % 16 != 0 || od[0] != ad[0] || od[1] != bd[1] ||
        bd[1] % 2 != 0) {
      return InvalidArgument(
          "grouped_gemm_bf16 (rows) expects a [R, L], b [G, N, L], out "
          "[R, N] with L a multiple of 16 and N even");
    }
    args.a = {Bf16(a.typed_data()), ad[1], 16};
    args.b = {Bf16(b.typed_data()), bd[2], 16};
    args.b_group_stride = bd[1] * bd[2];
    args.a_rows = ad[0];
    args.b_rows = bd[1];
    args.blocks = ad[1] / 16;
    // Every group's tiles: at most R / 128 + G of them.
    a_tiles = (ad[0] + kTileM - 1) / kTileM + groups;
  } else {
    // a [items, M, 16], b [items, N, 16], out [G, M, N]
    if (ad.size() != 3 || bd.size() != 3 || od.size() != 3 || ad[2] != 16 ||
        bd[2] != 16 || ad[0] != bd[0] || od[0] != groups || od[1] != ad[1] ||
        od[2] != bd[1] || bd[1] % 2 != 0) {
      return InvalidArgument(
          "grouped_gemm_bf16 (tokens) expects a [items, M, 16], b [items, N, "
          "16], out [G, M, N] with N even");
    }
    args.a = {Bf16(a.typed_data()), 16, ad[1] * 16};
    args.b = {Bf16(b.typed_data()), 16, bd[1] * 16};
    args.a_rows = ad[1];
    args.b_rows = bd[1];
    a_tiles = (ad[1] + kTileM - 1) / kTileM;
    if (groups > 65535) {
      return InvalidArgument(
          "grouped_gemm_bf16 (tokens): at most 65535 groups");
    }
  }
  if (out->element_count() == 0 || a_tiles == 0) return ffi::Error::Success();
  if ((args.b_rows + kTileN - 1) / kTileN > 65535 || a_tiles > kMaxGrid) {
    return InvalidArgument(
        "grouped_gemm_bf16: operands too large for one grid");
  }
  // cp.async copies 16-byte chunks: every row and block starts 16-byte
  // aligned when the bases are (XLA's buffers are).
  if (!IsAligned(a.typed_data(), 16) || !IsAligned(b.typed_data(), 16) ||
      !IsAligned(out->untyped_data(), 8)) {
    return InvalidArgument("grouped_gemm_bf16 needs 16-byte aligned operands");
  }
  switch (out->element_type()) {
    case ffi::DataType::BF16:
      return Launch<__nv_bfloat16>(stream, args, a_tiles);
    case ffi::DataType::F16:
      return Launch<__half>(stream, args, a_tiles);
    case ffi::DataType::F32:
      return Launch<float>(stream, args, a_tiles);
    default:
      return InvalidArgument(
          "grouped_gemm_bf16: the output must be bfloat16, float16 or float32");
  }
}

}  // namespace
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4GroupedGemmBf16Cuda, jax_nvfp4::GroupedGemmBf16Cuda,
    jax_nvfp4::GroupedGemmBf16Binding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
