// What the native Blackwell FP4 GEMM handlers share (fp4_gemm.cu: the 2-D
// GEMM; fp4_grouped_gemm.cu: ragged_dot's grouped GEMM): the description of
// one block-scaled FP4 cuBLASLt problem, the device and cuBLASLt checks, and
// the alignment check. Loading cuBLASLt, the handle and algorithm caches and
// the errors are cublaslt.h's.
#ifndef JAX_NVFP4_FFI_GEMM_CUBLASLT_FP4_CUBLASLT_H_
#define JAX_NVFP4_FFI_GEMM_CUBLASLT_FP4_CUBLASLT_H_

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "gemm/cublaslt/cublaslt.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {

namespace ffi = xla::ffi;

// "batch=.. M=.. N=.. K=.. out=..", for error messages.
std::string Fp4Problem(int64_t batch, int64_t m, int64_t n, int64_t k,
                       ffi::DataType out);

// Points cuBLASLt's A scales at b's and its B scales at a's.
bool SetFp4Scales(MatmulDescriptors& desc, const void* b_scales,
                  const void* a_scales, CublasFailure& ok);

// The row-major problem out[m, n] = alpha * sum_k a[m, k] b[n, k] as
// cuBLASLt's TN operation D (n x m) = b^T a with VEC16_UE4M3 block scales,
// alpha and beta read from device memory; a and b hold k elements of each
// row, `ld` apart.
bool DescribeFp4(int64_t m, int64_t n, int64_t k, int64_t ld,
                 cudaDataType_t d_type, MatmulDescriptors& desc,
                 CublasFailure& ok);

// The device of `stream` if it has FP4 tensor cores, and cuBLASLt if it
// knows block-scaled FP4 (12.8 or newer); else the error that says why not.
ffi::Error RequireBlackwell(cudaStream_t stream, const GemmErrors& errors,
                            StreamDevice* device, const CublasLt** lt);

// Whether every pointer is non-null and 16-byte aligned (block scales and
// the tensor-core kernels' A and B need it).
bool Aligned16(std::initializer_list<const void*> pointers);

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_CUBLASLT_FP4_CUBLASLT_H_
