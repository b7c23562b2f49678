// Device helpers shared by the CUDA kernels (ffi/cuda/*.cu): the CTA size,
// the input element types and their loads, and integer division. The
// kernels compute the bytes of the CPU handlers (ffi/cpu) with the arithmetic
// of numerics/nvfp4.h and numerics/fast.cuh; CMakeLists.txt builds them with
// --fmad=false and without fast-math, so that every float operation rounds
// as written (IEEE division, no FMA contraction), and with -ftz=true, the
// subnormal flushing of numerics/nvfp4.h.
#ifndef JAX_NVFP4_FFI_CUDA_DEVICE_CUH_
#define JAX_NVFP4_FFI_CUDA_DEVICE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "numerics/fast.cuh"
#include "numerics/nvfp4.h"

namespace jax_nvfp4 {

constexpr int kThreads = 256;             // threads of every CTA (but one)
constexpr int64_t kMaxGrid = 0x7FFFFFFF;  // gridDim.x limit

// ---------------------------------------------------------------------------
// Input element types. A 16-element block of x is held as its raw bits in
// kWords 32-bit words (little-endian: element j of a 16-bit type is half
// j % 2 of word j / 2), and widened to float32 exactly as on the CPU.
// ---------------------------------------------------------------------------
enum class InType { kF32, kBf16, kF16 };

template <InType T>
struct In;

template <>
struct In<InType::kF32> {
  static constexpr int kBytes = 4;
  static __device__ __forceinline__ float FromRaw(uint32_t raw) {
    return BitsToFloat(raw);
  }
  static __device__ __forceinline__ float Element(const uint32_t* w, int j) {
    return BitsToFloat(w[j]);
  }
};

template <>
struct In<InType::kBf16> {
  static constexpr int kBytes = 2;
  static __device__ __forceinline__ float FromRaw(uint32_t raw) {
    return Bfloat16BitsToFloat(static_cast<uint16_t>(raw));
  }
  static __device__ __forceinline__ float Element(const uint32_t* w, int j) {
    return FromRaw(w[j >> 1] >> (16 * (j & 1)));
  }
};

template <>
struct In<InType::kF16> {
  static constexpr int kBytes = 2;
  static __device__ __forceinline__ float FromRaw(uint32_t raw) {
    return Float16BitsToFloat(static_cast<uint16_t>(raw));
  }
  static __device__ __forceinline__ float Element(const uint32_t* w, int j) {
    return FromRaw(w[j >> 1] >> (16 * (j & 1)));
  }
};

// 32-bit words (and 16-byte chunks) of one 16-element block.
template <InType T>
constexpr int kWords = 4 * In<T>::kBytes;
template <InType T>
constexpr int kChunks = In<T>::kBytes;

// Raw bits of element i of x.
template <InType T>
__device__ __forceinline__ uint32_t LoadRawElement(const void* x, int64_t i) {
  if constexpr (In<T>::kBytes == 4) {
    return static_cast<const uint32_t*>(x)[i];
  } else {
    return static_cast<const uint16_t*>(x)[i];
  }
}

// Loads the raw words of elements [first, first + count) of x (count <= 16)
// into w, zero-filling the rest. `vec`: 16-byte loads, valid when count == 16
// and the block starts on a 16-byte boundary.
template <InType T>
__device__ __forceinline__ void LoadBlockWords(const void* x, int64_t first,
                                               int count, bool vec,
                                               uint32_t (&w)[kWords<T>]) {
  if (vec && count == kBlock) {
    const uint4* p = reinterpret_cast<const uint4*>(
        static_cast<const char*>(x) + first * In<T>::kBytes);
#pragma unroll
    for (int c = 0; c < kChunks<T>; ++c) {
      const uint4 q = __ldg(p + c);
      w[4 * c] = q.x;
      w[4 * c + 1] = q.y;
      w[4 * c + 2] = q.z;
      w[4 * c + 3] = q.w;
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kWords<T>; ++i) w[i] = 0;
#pragma unroll
  for (int j = 0; j < kBlock; ++j) {
    if (j < count) {
      const uint32_t e = LoadRawElement<T>(x, first + j);
      if constexpr (In<T>::kBytes == 4) {
        w[j] = e;
      } else {
        w[j >> 1] |= e << (16 * (j & 1));
      }
    }
  }
}

template <InType T>
__device__ __forceinline__ void WordsToFloats(const uint32_t (&w)[kWords<T>],
                                              float (&v)[kBlock]) {
#pragma unroll
  for (int j = 0; j < kBlock; ++j) v[j] = In<T>::Element(w, j);
}

// a / b for a >= 0, b > 0, with a 32-bit division when both fit.
__device__ __forceinline__ int64_t Div(int64_t a, int64_t b) {
  if (((a | b) >> 32) == 0) {
    return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
  }
  return a / b;
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_CUDA_DEVICE_CUH_
