// The C functions of the plain CPU library (libjax_nvfp4_cpu.so, built by
// Bazel): the CPU targets of targets.inc, so that Python
// (jax_nvfp4/backends/library.py, through ctypes) needs no list of its own.
#include <cstdint>

#include "targets.h"
#include "xla/ffi/api/c_api.h"

extern "C" {
#define JAX_NVFP4_TARGET(name, symbol, platform, gate) \
  JAX_NVFP4_IF_CPU(platform, XLA_FFI_Error* symbol(XLA_FFI_CallFrame*);)
#include "targets.inc"
#undef JAX_NVFP4_TARGET
}

namespace {

struct CpuTarget {
  const char* name;
  XLA_FFI_Handler* handler;
};

const CpuTarget kCpuTargets[] = {
#define JAX_NVFP4_TARGET(name, symbol, platform, gate) \
  JAX_NVFP4_IF_CPU(platform, {name, symbol}, )
#include "targets.inc"
#undef JAX_NVFP4_TARGET
};

constexpr int64_t kCpuTargetCount =
    sizeof(kCpuTargets) / sizeof(kCpuTargets[0]);

}  // namespace

extern "C" {

// How many CPU targets the library serves.
__attribute__((visibility("default"))) int64_t JaxNvfp4CpuTargetCount() {
  return kCpuTargetCount;
}

// The FFI name of target i (0 <= i < count), else nullptr.
__attribute__((visibility("default"))) const char* JaxNvfp4CpuTargetName(
    int64_t i) {
  return i >= 0 && i < kCpuTargetCount ? kCpuTargets[i].name : nullptr;
}

// The XLA_FFI_Handler* of target i (0 <= i < count), else nullptr.
__attribute__((visibility("default"))) void* JaxNvfp4CpuTargetHandler(
    int64_t i) {
  return i >= 0 && i < kCpuTargetCount
             ? reinterpret_cast<void*>(kCpuTargets[i].handler)
             : nullptr;
}

}  // extern "C"
