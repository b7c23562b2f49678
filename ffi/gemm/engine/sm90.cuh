// The Hopper (sm_90a) instructions the GEMM engine is built on, one thin
// wrapper each: mbarriers (the pipeline's full and empty slots), the bulk
// tensor copy (TMA) into shared memory completing on an mbarrier, and the
// shared-memory descriptor wgmma reads its operands through.
#ifndef JAX_NVFP4_FFI_GEMM_ENGINE_SM90_CUH_
#define JAX_NVFP4_FFI_GEMM_ENGINE_SM90_CUH_

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

// Whether this compilation pass emits the engine's kernels: sm_90a only
// (wgmma exists on no other target). Elsewhere their bodies are empty and
// the handler never launches them (it checks the device first).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAX_NVFP4_ENGINE_ARCH 1
#else
#define JAX_NVFP4_ENGINE_ARCH 0
#endif

namespace jax_nvfp4 {
namespace engine {

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes of shared memory at a shared-window address (32-bit address
// arithmetic, no generic-to-shared conversion per load).
__device__ __forceinline__ uint4 LoadShared16(uint32_t address) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address));
  return v;
}

// 8 bytes of shared memory at a shared-window address.
__device__ __forceinline__ uint2 LoadShared8(uint32_t address) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
               : "=r"(v.x), "=r"(v.y)
               : "r"(address));
  return v;
}

// 4 bytes from global memory to a shared-window address, asynchronously
// (cp.async); CopyAsyncArrive tells a barrier when they landed.
__device__ __forceinline__ void CopyAsync4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src));
}

// The barrier's current phase also waits for this thread's earlier
// CopyAsync4 (the arrival is counted in advance, so the expected count
// stays as initialised).
__device__ __forceinline__ void CopyAsyncArrive(uint64_t* bar) {
  asm volatile(
      "cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(SmemAddress(bar)));
}

// Orders this thread's view of shared memory written by threads (generic
// proxy) before the wgmma that read it (async proxy).
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void BarrierInit(uint64_t* bar, int arrivals) {
  asm volatile(
      "mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddress(bar)),
      "r"(arrivals));
}

// Makes the initialised barriers visible to the copy engine.
__device__ __forceinline__ void BarrierInitFence() {
  asm volatile("fence.mbarrier_init.release.cluster;");
}

// One arrival that also expects `bytes` from the copy engine.
__device__ __forceinline__ void BarrierExpectBytes(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   SmemAddress(bar)),
               "r"(bytes));
}

// Expects `bytes` more from the copy engine in the current phase, without
// arriving.
__device__ __forceinline__ void BarrierExpectTx(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(
                   SmemAddress(bar)),
               "r"(bytes));
}

__device__ __forceinline__ void BarrierArrive(uint64_t* bar) {
  asm volatile(
      "mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddress(bar)));
}

// Waits until the barrier's phase of the given parity has completed (a
// fresh barrier counts its phase of parity 1 as completed).
__device__ __forceinline__ void BarrierWait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(SmemAddress(bar)),
      "r"(parity));
}

// The box of `map` at (inner, outer) into shared memory; its bytes complete
// on `bar`. Rows past the tensor's end arrive as zeros.
__device__ __forceinline__ void TmaLoad2d(void* dst, const CUtensorMap* map,
                                          uint64_t* bar, int inner, int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::"
      "bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(SmemAddress(dst)),
      "l"(map), "r"(SmemAddress(bar)), "r"(inner), "r"(outer)
      : "memory");
}

// The box of a 3-D `map` at (inner, middle, outer), as TmaLoad2d.
__device__ __forceinline__ void TmaLoad3d(void* dst, const CUtensorMap* map,
                                          uint64_t* bar, int inner, int middle,
                                          int outer) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::"
      "bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(SmemAddress(dst)),
      "l"(map), "r"(SmemAddress(bar)), "r"(inner), "r"(middle), "r"(outer)
      : "memory");
}

// The descriptor of a K-major bf16 operand tile whose rows are 64 elements
// (128 bytes) written by TMA with 128-byte swizzling: 8-row atoms 1024 bytes
// apart. One k16 step further along K is 32 bytes further.
__device__ __forceinline__ uint64_t SwizzledOperand(const void* tile) {
  uint64_t d = (uint64_t{SmemAddress(tile)} & 0x3FFFF) >> 4;
  d |= uint64_t{1} << 16;          // leading byte offset: unused, swizzled
  d |= uint64_t{1024 >> 4} << 32;  // stride byte offset: one 8-row atom
  d |= uint64_t{1} << 62;          // 128-byte swizzle
  return d;
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// Waits until at most kPending committed wgmma groups are still running.
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// All threads of all CTAs of the cluster: what each wrote to its shared
// memory before is visible to the others' cluster loads after.
__device__ __forceinline__ void ClusterSync() {
  asm volatile(
      "barrier.cluster.arrive.release;\n"
      "barrier.cluster.wait.acquire;" ::
          : "memory");
}

// Four floats of CTA `rank`'s shared memory at the address `local` has in
// this CTA's.
__device__ __forceinline__ float4 ClusterLoad(uint32_t local, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"(local), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

// One output, rounded once to Out.
__device__ __forceinline__ void StoreOne(float* p, float x) { *p = x; }
__device__ __forceinline__ void StoreOne(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16_rn(x);
}
__device__ __forceinline__ void StoreOne(__half* p, float x) {
  *p = __float2half_rn(x);
}

// Two adjacent outputs, rounded once to Out.
__device__ __forceinline__ void StorePair(float* p, float x, float y) {
  *reinterpret_cast<float2*>(p) = make_float2(x, y);
}
__device__ __forceinline__ void StorePair(__nv_bfloat16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}
__device__ __forceinline__ void StorePair(__half* p, float x, float y) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
}

// Four adjacent outputs (16-byte aligned for float, 8-byte for 16-bit
// types), rounded once to Out.
__device__ __forceinline__ void StoreQuad(float* p, float4 v) {
  *reinterpret_cast<float4*>(p) = v;
}
__device__ __forceinline__ void StoreQuad(__nv_bfloat16* p, float4 v) {
  const __nv_bfloat162 low = __floats2bfloat162_rn(v.x, v.y);
  const __nv_bfloat162 high = __floats2bfloat162_rn(v.z, v.w);
  uint2 bits;
  memcpy(&bits.x, &low, 4);
  memcpy(&bits.y, &high, 4);
  *reinterpret_cast<uint2*>(p) = bits;
}
__device__ __forceinline__ void StoreQuad(__half* p, float4 v) {
  const __half2 low = __floats2half2_rn(v.x, v.y);
  const __half2 high = __floats2half2_rn(v.z, v.w);
  uint2 bits;
  memcpy(&bits.x, &low, 4);
  memcpy(&bits.y, &high, 4);
  *reinterpret_cast<uint2*>(p) = bits;
}

}  // namespace engine
}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_ENGINE_SM90_CUH_
