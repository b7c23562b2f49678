// The body of the cuBLASLt GEMM handlers: the bf16 GEMM (bf16_gemm.cu), the
// native FP4 GEMM (fp4_gemm.cu) and the grouped FP4 GEMM
// (fp4_grouped_gemm.cu) each plan their call (gemm_plan.h) and hand the plan
// to RunGemmCall, which
//   1. returns the plan's refusal, or out's if it is not bfloat16 or
//      float32, as kInvalidArgument;
//   2. zeroes the ranges of out that no launch writes;
//   3. checks the device (its compute capability), loads cuBLASLt (and its
//      version) and checks the alignment of every operand;
//   4. writes beta and the alphas to the head of the workspace (cublaslt.h's
//      alpha kernel);
//   5. runs each launch: its descriptors (kept while the launches' shape
//      stays the same), the device's handle and the algorithm (cached, else
//      cuBLASLt's heuristic, told the real alignment of each matrix), one
//      cublasLtMatmul.
// Steps 3 to 5 only when there is a launch.
//
// The operands' element type decides the requirements:
//   CUDA_R_16BF (bf16 values): compute capability 8.0 or newer, any
//     cuBLASLt of 12.0 or newer; operands aligned to their elements.
//   CUDA_R_4F_E2M1 (FP4 codes with VEC16_UE4M3 block scales; built with
//     JAX_NVFP4_WITH_BLACKWELL_GEMM): compute capability 10.0 or newer,
//     cuBLASLt 12.8 or newer; codes and scales 16-byte aligned.
#ifndef JAX_NVFP4_FFI_GEMM_CUBLASLT_GEMM_CALL_H_
#define JAX_NVFP4_FFI_GEMM_CUBLASLT_GEMM_CALL_H_

#include <cuda_runtime.h>
#include <library_types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gemm/cublaslt/cublaslt.h"
#include "gemm/cublaslt/gemm_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {

namespace ffi = xla::ffi;

// A buffer's dimensions, as the plans take them.
template <typename Buffer>
std::vector<int64_t> Dims(const Buffer& buffer) {
  const auto dims = buffer.dimensions();
  return std::vector<int64_t>(dims.begin(), dims.end());
}

// What differs between the handlers besides their plans: how their errors
// read and the operands' element type.
struct GemmHandler {
  GemmErrors errors;
  cudaDataType_t ab_type;
};

// The base addresses the plan's offsets are into; the scales only for FP4.
struct GemmOperands {
  // bf16 values.
  GemmOperands(const ffi::Buffer<ffi::BF16>& a_values,
               const ffi::Buffer<ffi::BF16>& b_values,
               const ffi::Buffer<ffi::F32>& a_amax,
               const ffi::Buffer<ffi::F32>& b_amax)
      : a(a_values.untyped_data()),
        b(b_values.untyped_data()),
        a_amax(a_amax.typed_data()),
        b_amax(b_amax.typed_data()) {}
  // FP4 codes and their block scales.
  GemmOperands(const ffi::Buffer<ffi::U8>& a_codes,
               const ffi::Buffer<ffi::U8>& a_scales,
               const ffi::Buffer<ffi::U8>& b_codes,
               const ffi::Buffer<ffi::U8>& b_scales,
               const ffi::Buffer<ffi::F32>& a_amax,
               const ffi::Buffer<ffi::F32>& b_amax)
      : a(a_codes.untyped_data()),
        b(b_codes.untyped_data()),
        a_scales(a_scales.untyped_data()),
        b_scales(b_scales.untyped_data()),
        a_amax(a_amax.typed_data()),
        b_amax(b_amax.typed_data()) {}

  const void* a = nullptr;
  const void* b = nullptr;
  const void* a_scales = nullptr;
  const void* b_scales = nullptr;
  const float* a_amax = nullptr;
  const float* b_amax = nullptr;
};

ffi::Error RunGemmCall(const GemmHandler& handler, cudaStream_t stream,
                       const std::string& plan_error, const GemmCallPlan& plan,
                       const GemmOperands& operands, ffi::AnyBuffer out,
                       ffi::Buffer<ffi::U8> workspace);

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_CUBLASLT_GEMM_CALL_H_
