// QuantizeRowsKernel: quantize_rows.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device.cuh"
#include "cuda/launch.cuh"
#include "cuda/quantize.cuh"
#include "numerics/fast.cuh"
#include "numerics/nvfp4.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

// ---------------------------------------------------------------------------
// QuantizeRowsKernel: x [batch, m, k] -> [batch, m, k] quantized along k.
// Persistent threads take 16-element blocks i, i + stride, ... (32 bytes of
// x with 16-byte loads, 8 code bytes, one scale byte each). 1x16: block i in
// memory order (coalesced). 16x16: the 16 rows of one 16x16 block are 16
// consecutive threads, which reduce the block's amax with shuffles inside
// their half warp.
// ---------------------------------------------------------------------------
template <InType T>
__global__ void __launch_bounds__(kThreads)
    QuantizeRowsKernel(const RowsArgs args) {
  const int64_t k_blocks = args.k / kBlock;
  const uint32_t half_mask = 0xFFFFu << (threadIdx.x & 16);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  // First element of block i (and its row over batch * m).
  const auto first_of = [&](int64_t i, int64_t* row) {
    int64_t kb;
    if (args.out.block16) {
      const int64_t group = i / 16;
      const int64_t tile_row = Div(group, k_blocks);
      *row = tile_row * 16 + i % 16;
      kb = group - tile_row * k_blocks;
    } else {
      *row = Div(i, k_blocks);
      kb = i - *row * k_blocks;
    }
    return *row * args.k + kb * kBlock;
  };
  // Persistent threads: blocks i, i + stride, ...; the next block's loads are
  // in flight while this one is quantized. blocks % 16 == 0 for 16x16 blocks,
  // so a half warp stays together.
  int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= args.blocks) return;
  int64_t row;
  int64_t first = first_of(i, &row);
  uint32_t w[kWords<T>];
  LoadBlockWords<T>(args.x, first, kBlock, args.x_vec, w);
  for (;;) {
    float v[kBlock];
    WordsToFloats<T>(w, v);
    const int64_t next = i + stride;
    int64_t next_row = row;
    int64_t next_first = first;
    if (next < args.blocks) {
      next_first = first_of(next, &next_row);
      LoadBlockWords<T>(args.x, next_first, kBlock, args.x_vec, w);
    }
    MaybeRht(args.out.rht, v);
    float block_amax = BlockAmax(v);  // +inf: a NaN or +-inf in the block
    if (args.out.block16) {  // the tile's maximum: +inf if any block's is
#pragma unroll
      for (int offset = 1; offset < 16; offset *= 2) {
        block_amax = fmaxf(block_amax,
                           __shfl_xor_sync(half_mask, block_amax, offset, 16));
      }
    }
    const int64_t b = Div(row, args.m);
    const int64_t kk = Div(b, args.key.batch_per_key);
    EncodeAndStore(v, block_amax, GlobalScaleOf(args.out, b), args.out,
                   args.key.key[2 * kk], args.key.key[2 * kk + 1],
                   static_cast<uint64_t>(first), b, row - b * args.m,
                   first - row * args.k);
    if (next >= args.blocks) break;
    i = next;
    row = next_row;
    first = next_first;
  }
}

}  // namespace

void LaunchQuantizeRows(cudaStream_t stream, ffi::DataType type,
                        const RowsArgs& args) {
  const int64_t ctas = (args.blocks + kThreads - 1) / kThreads;
  switch (type) {
    case ffi::DataType::BF16: {
      const auto kernel = QuantizeRowsKernel<InType::kBf16>;
      kernel<<<PersistentGrid(kernel, ctas), kThreads, 0, stream>>>(args);
      break;
    }
    case ffi::DataType::F16: {
      const auto kernel = QuantizeRowsKernel<InType::kF16>;
      kernel<<<PersistentGrid(kernel, ctas), kThreads, 0, stream>>>(args);
      break;
    }
    default: {
      const auto kernel = QuantizeRowsKernel<InType::kF32>;
      kernel<<<PersistentGrid(kernel, ctas), kThreads, 0, stream>>>(args);
      break;
    }
  }
}

}  // namespace jax_nvfp4
