// Helpers for reading targets.inc: JAX_NVFP4_IF_BUILT(gate, ...) expands to
// its arguments when the build compiles the targets of `gate`, else to
// nothing; JAX_NVFP4_IF_CPU(platform, ...) and JAX_NVFP4_IF_CUDA(platform,
// ...) to them for targets of that platform. A reader defines
// JAX_NVFP4_TARGET(name, symbol, platform, gate) with these, includes
// targets.inc and undefines it again (module.cc, cpu/library.cc).
#ifndef JAX_NVFP4_FFI_TARGETS_H_
#define JAX_NVFP4_FFI_TARGETS_H_

#define JAX_NVFP4_IF_BUILT(gate, ...) JAX_NVFP4_GATE_##gate(__VA_ARGS__)
#define JAX_NVFP4_IF_CPU(platform, ...) JAX_NVFP4_CPU_##platform(__VA_ARGS__)
#define JAX_NVFP4_IF_CUDA(platform, ...) JAX_NVFP4_CUDA_##platform(__VA_ARGS__)

#define JAX_NVFP4_GATE_ALWAYS(...) __VA_ARGS__
#ifdef JAX_NVFP4_WITH_CUDA
#define JAX_NVFP4_GATE_CUDA(...) __VA_ARGS__
#else
#define JAX_NVFP4_GATE_CUDA(...)
#endif
#ifdef JAX_NVFP4_WITH_CUBLASLT
#define JAX_NVFP4_GATE_CUBLASLT(...) __VA_ARGS__
#else
#define JAX_NVFP4_GATE_CUBLASLT(...)
#endif
#ifdef JAX_NVFP4_WITH_BLACKWELL_GEMM
#define JAX_NVFP4_GATE_BLACKWELL_GEMM(...) __VA_ARGS__
#else
#define JAX_NVFP4_GATE_BLACKWELL_GEMM(...)
#endif

#define JAX_NVFP4_CPU_cpu(...) __VA_ARGS__
#define JAX_NVFP4_CPU_cuda(...)
#define JAX_NVFP4_CUDA_cpu(...)
#define JAX_NVFP4_CUDA_cuda(...) __VA_ARGS__

#endif  // JAX_NVFP4_FFI_TARGETS_H_
