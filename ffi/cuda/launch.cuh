// Host helpers of the CUDA handlers: alignment, grid sizes, launch errors
// and the output type a kernel is instantiated for.
#ifndef JAX_NVFP4_FFI_CUDA_LAUNCH_CUH_
#define JAX_NVFP4_FFI_CUDA_LAUNCH_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "checks.h"
#include "cuda/device.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {

namespace ffi = xla::ffi;

inline bool IsAligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline unsigned int GridFor(int64_t work_items) {
  return static_cast<unsigned int>(std::min<int64_t>(
      std::max<int64_t>((work_items + kThreads - 1) / kThreads, 1), kMaxGrid));
}

// Grid of a persistent kernel: as many CTAs as fit on the device at once
// (at least 1), and no more than there is work for.
template <typename Kernel>
unsigned int PersistentGrid(Kernel kernel, int64_t work_ctas) {
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads,
                                                    0) != cudaSuccess) {
    cudaGetLastError();  // clear it; fall back to a fixed grid
    sms = 132;
    per_sm = 2;
  }
  const int64_t resident =
      static_cast<int64_t>(std::max(sms, 1)) * std::max(per_sm, 1);
  return static_cast<unsigned int>(
      std::max<int64_t>(1, std::min(work_ctas, resident)));
}

inline ffi::Error LaunchError(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jax_nvfp4: ") + what +
                          " kernel launch failed: " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// launch(Out{}) for the output type `type`: bf16, f16 or f32; `what` names
// the handler in the error for any other type.
template <typename Launch>
ffi::Error ByOutputType(ffi::DataType type, const char* what, Launch launch) {
  switch (type) {
    case ffi::DataType::BF16:
      return launch(__nv_bfloat16{});
    case ffi::DataType::F16:
      return launch(__half{});
    case ffi::DataType::F32:
      return launch(float{});
    default:
      return InvalidArgument(std::string(what) +
                             ": the output must be bfloat16, float16 or "
                             "float32");
  }
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_CUDA_LAUNCH_CUH_
