// What the engine's kernels share around the wgmma mainloop: the ring of
// shared-memory stages the TMA producer fills and the consumer warpgroups
// drain, and the epilogue that stores a consumer's accumulators.
#ifndef JAX_NVFP4_FFI_GEMM_ENGINE_PIPELINE_CUH_
#define JAX_NVFP4_FFI_GEMM_ENGINE_PIPELINE_CUH_

#include <cstdint>

#include "gemm/engine/sm90.cuh"

namespace jax_nvfp4 {
namespace engine {

// kStages slots, each an A tile of kStageA bytes and a B tile of kStageB, in
// dynamic shared memory aligned to 1024 bytes (the 128-byte swizzle's atom);
// per slot a full barrier (the producer's bytes arrived) and an empty one
// (both consumer warpgroups are done with it). The producer and the
// consumers count the same slots, 0, 1, 2, ... over all their tiles.
template <int kStages, int kStageA, int kStageB>
struct Ring {
  static constexpr int kStageBytes = kStageA + kStageB;
  static constexpr int kSharedBytes =
      kStages * kStageBytes + 2 * kStages * 8 + 1024;
  static constexpr int kConsumers = 2;  // warpgroups

  uint8_t* a;
  uint8_t* b;
  uint64_t* full;
  uint64_t* empty;

  __device__ explicit Ring(uint8_t* shared) {
    a = reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uintptr_t>(shared) + 1023) & ~uintptr_t{1023});
    b = a + kStages * kStageA;
    full = reinterpret_cast<uint64_t*>(b + kStages * kStageB);
    empty = full + kStages;
  }

  // By one thread, before a __syncthreads.
  __device__ void Init() {
    for (int s = 0; s < kStages; ++s) {
      BarrierInit(&full[s], 1);
      BarrierInit(&empty[s], kConsumers);
    }
    BarrierInitFence();
  }

  // The producer's turn at `slot`: waits until it is free, then arrives
  // expecting `bytes` from the copy engine. Returns its stage.
  __device__ int Fill(int slot, int bytes) {
    const int s = WaitFree(slot);
    BarrierExpectBytes(&full[s], bytes);
    return s;
  }

  // Waits until `slot` is free. Returns its stage.
  __device__ int WaitFree(int slot) {
    const int s = slot % kStages;
    BarrierWait(&empty[s], ((slot / kStages) & 1) ^ 1);
    return s;
  }

  // A consumer's turn at `slot`: waits until its bytes arrived.
  __device__ int Take(int slot) {
    const int s = slot % kStages;
    BarrierWait(&full[s], (slot / kStages) & 1);
    return s;
  }

  // By one thread of each consumer warpgroup, once its wgmma are done.
  __device__ void Release(int s) { BarrierArrive(&empty[s]); }

  __device__ uint8_t* TileA(int s) const { return a + s * kStageA; }
  __device__ uint8_t* TileB(int s) const { return b + s * kStageB; }
};

// Consumer warpgroup `half`'s accumulators of a 128 x 256 tile (wgmma
// m64n256's layout: accumulator i of a thread is row warp * 16 + lane / 4,
// +8 for the odd pairs, column (i / 4) * 8 + (lane % 4) * 2 + i % 2) times
// `scale`, rounded once to Out, into out[r * ld + col0 + c] for the tile's
// local rows r < rows and columns col0 + c < cols.
template <typename Out>
__device__ __forceinline__ void StoreTile(const float (&acc)[128], float scale,
                                          Out* out, int64_t ld, int rows,
                                          int col0, int cols, int half,
                                          int thread) {
  const int warp = thread / 32, lane = thread % 32;
  const int first = half * 64 + warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int col = col0 + j * 8 + (lane % 4) * 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = first + h * 8;
      if (row < rows && col < cols) {
        StorePair(out + row * ld + col, scale * acc[j * 4 + h * 2],
                  scale * acc[j * 4 + h * 2 + 1]);
      }
    }
  }
}

}  // namespace engine
}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_ENGINE_PIPELINE_CUH_
