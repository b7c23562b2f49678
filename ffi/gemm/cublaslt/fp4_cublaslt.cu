// The native Blackwell FP4 GEMM handlers' shared cuBLASLt setup
// (fp4_cublaslt.h).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "gemm/cublaslt/cublaslt.h"
#include "gemm/cublaslt/fp4_cublaslt.h"

namespace jax_nvfp4 {
namespace {

constexpr size_t kMinCublasLtVersion = 120800;  // VEC16_UE4M3 appeared in 12.8

}  // namespace

std::string Fp4Problem(int64_t batch, int64_t m, int64_t n, int64_t k,
                       ffi::DataType out) {
  return "batch=" + std::to_string(batch) + " M=" + std::to_string(m) +
         " N=" + std::to_string(n) + " K=" + std::to_string(k) +
         " out=" + (out == ffi::DataType::BF16 ? "bf16" : "f32");
}

// Points cuBLASLt's A scales at b's and its B scales at a's.
bool SetFp4Scales(MatmulDescriptors& desc, const void* b_scales,
                  const void* a_scales, CublasFailure& ok) {
  return ok("cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)",
            desc.Set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b_scales)) &&
         ok("cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)",
            desc.Set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a_scales));
}

// The operation of fp4_gemm_plan.h: D (n x m) = alpha * b^T a with
// VEC16_UE4M3 block scales, alpha and beta read from device memory; a and b
// hold k elements of each row, `ld` apart.
bool DescribeFp4(int64_t m, int64_t n, int64_t k, int64_t ld,
                 cudaDataType_t d_type, MatmulDescriptors& desc,
                 CublasFailure& ok) {
  const cublasLtMatmulMatrixScale_t scale_mode =
      CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
  return desc.CreateTnOperation(ok) &&
         ok("cublasLtMatmulDescSetAttribute(A_SCALE_MODE)",
            desc.Set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, scale_mode)) &&
         ok("cublasLtMatmulDescSetAttribute(B_SCALE_MODE)",
            desc.Set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, scale_mode)) &&
         desc.CreateLayout(&desc.a, "cublasLtMatrixLayoutCreate(A)",
                           CUDA_R_4F_E2M1, k, n, ld, 1, 0, ok) &&
         desc.CreateLayout(&desc.b, "cublasLtMatrixLayoutCreate(B)",
                           CUDA_R_4F_E2M1, k, m, ld, 1, 0, ok) &&
         desc.CreateLayout(&desc.d, "cublasLtMatrixLayoutCreate(D)", d_type, n,
                           m, n, 1, 0, ok);
}

// The device of `stream` if it has FP4 tensor cores, and cuBLASLt if it
// knows block-scaled FP4; else the error that says why not.
ffi::Error RequireBlackwell(cudaStream_t stream, const GemmErrors& errors,
                            StreamDevice* device, const CublasLt** lt) {
  if (ffi::Error e = GetStreamDevice(stream, errors, device); e.failure()) {
    return e;
  }
  if (device->major < 10) {
    return errors.Fail(
        ffi::ErrorCode::kFailedPrecondition,
        "native FP4 GEMMs need compute capability 10.0 or newer "
        "(Blackwell); device " +
            std::to_string(device->ordinal) + " is " +
            std::to_string(device->major) + "." +
            std::to_string(device->minor) +
            ". Use jax_nvfp4.matmul / jax_nvfp4.ragged_dot, which lower to "
            "this target only where "
            "jax_nvfp4.backends.fp4_gemm.native_fp4_supported() holds.");
  }
  if (ffi::Error e = LoadCublasLt(errors, lt); e.failure()) return e;
  if ((*lt)->version < kMinCublasLtVersion) {
    return errors.FailAtRunTime(
        ffi::ErrorCode::kFailedPrecondition,
        "cuBLASLt " + std::to_string((*lt)->version) + " (" + (*lt)->path +
            ") predates block-scaled FP4 (needs 12.8 or newer, e.g. pip "
            "install nvidia-cublas).");
  }
  return ffi::Error::Success();
}

// Every operand must be 16-byte aligned (block scales and the tensor-core
// kernels' A and B).
bool Aligned16(std::initializer_list<const void*> pointers) {
  for (const void* ptr : pointers) {
    if (ptr == nullptr || CommonAlignment({Address(ptr)}) < 16) return false;
  }
  return true;
}

}  // namespace jax_nvfp4
