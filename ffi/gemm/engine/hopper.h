// Which GPU the engine's kernels run on: they are compiled for sm_90a only,
// so their handlers check the current device before a launch.
#ifndef JAX_NVFP4_FFI_GEMM_ENGINE_HOPPER_H_
#define JAX_NVFP4_FFI_GEMM_ENGINE_HOPPER_H_

#include <cuda_runtime.h>

namespace jax_nvfp4 {
namespace engine {

// The current device's multiprocessor count, or 0 if it is not compute
// capability 9.0.
inline int HopperSms() {
  int device = 0, major = 0, minor = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                             device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor,
                             device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) !=
          cudaSuccess) {
    return 0;
  }
  return major == 9 && minor == 0 ? sms : 0;
}

}  // namespace engine
}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_ENGINE_HOPPER_H_
