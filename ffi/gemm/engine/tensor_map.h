// Host side of the engine's TMA loads: tensor maps (bf16 operands, FP4
// codes and E4M3 scales), encoded per call
// through the driver's cuTensorMapEncodeTiled, found at run time (the
// extension links the CUDA runtime only, not libcuda). A map is 128 bytes
// the kernel takes by value (__grid_constant__), so a launch recorded into a
// CUDA graph carries its own.
#ifndef JAX_NVFP4_FFI_GEMM_ENGINE_TENSOR_MAP_H_
#define JAX_NVFP4_FFI_GEMM_ENGINE_TENSOR_MAP_H_

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_nvfp4 {
namespace engine {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType,
                                   cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion,
                                   CUtensorMapFloatOOBfill);

// The driver's encoder; nullptr if the driver has none (older than 12.0).
inline EncodeTiledFn EncodeTiled() {
  static const EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                         cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return EncodeTiledFn{nullptr};
    }
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

// The map of a contiguous tensor of `rank` dims `dims` (innermost first) of
// `element_bytes`-byte elements of `type`, read in boxes `box`, with
// `swizzle`; boxes past the ends arrive as zeros. False if the driver
// rejects it.
inline bool TensorMap(CUtensorMapDataType type, int element_bytes,
                      const void* base, int rank, const uint64_t* dims,
                      const uint32_t* box, CUtensorMapSwizzle swizzle,
                      CUtensorMap* map) {
  const EncodeTiledFn encode = EncodeTiled();
  if (encode == nullptr || rank < 1 || rank > 5) return false;
  cuuint64_t sizes[5], strides[4];
  cuuint32_t boxes[5], steps[5];
  cuuint64_t stride = element_bytes;
  for (int i = 0; i < rank; ++i) {
    sizes[i] = dims[i];
    boxes[i] = box[i];
    steps[i] = 1;
    if (i + 1 < rank) strides[i] = stride *= dims[i];
  }
  return encode(map, type, rank, const_cast<void*>(base), sizes, strides, boxes,
                steps, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A bf16 tensor's map.
inline bool Bf16TensorMap(const void* base, int rank, const uint64_t* dims,
                          const uint32_t* box, CUtensorMapSwizzle swizzle,
                          CUtensorMap* map) {
  return TensorMap(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, rank, dims, box,
                   swizzle, map);
}

// A byte tensor's map (FP4 codes, E4M3 scales).
inline bool ByteTensorMap(const void* base, int rank, const uint64_t* dims,
                          const uint32_t* box, CUtensorMapSwizzle swizzle,
                          CUtensorMap* map) {
  return TensorMap(CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, base, rank, dims, box,
                   swizzle, map);
}

}  // namespace engine
}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_ENGINE_TENSOR_MAP_H_
