// The Python extension: hands the FFI handlers to jax_nvfp4 as capsules,
// which jax_nvfp4/_ffi_registry.py registers with jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cublaslt_plan.h"
#include "fp4_gemm_plan.h"
#include "scale_layout.h"
#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxNvfp4QuantizeRowsCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxNvfp4QuantizeColsCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxNvfp4QuantizeRowsColsCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxNvfp4AmaxCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxNvfp4DequantizeCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxNvfp4MatmulCpu(XLA_FFI_CallFrame*);
#ifdef JAX_NVFP4_WITH_CUDA
XLA_FFI_Error* JaxNvfp4QuantizeRowsCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxNvfp4QuantizeColsCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxNvfp4QuantizeRowsColsCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxNvfp4QuantizeRowsColsDecodedCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxNvfp4AmaxCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxNvfp4DequantizeCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxNvfp4DecodeBf16Cuda(XLA_FFI_CallFrame*);
#endif
#ifdef JAX_NVFP4_WITH_CUBLASLT
XLA_FFI_Error* JaxNvfp4MatmulBf16Cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxNvfp4MatmulBf16GraphCuda(XLA_FFI_CallFrame*);
void JaxNvfp4GemmCaptureCounts(int64_t* calls, int64_t* setups);
void JaxNvfp4ForgetGemmSetup();
#endif
#ifdef JAX_NVFP4_WITH_BLACKWELL_GEMM
XLA_FFI_Error* JaxNvfp4MatmulFp4Sm100Cuda(XLA_FFI_CallFrame*);
#endif
}

namespace nb = nanobind;

namespace {

nb::capsule Capsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.def("cpu_registrations", []() {
    nb::dict d;
    d["jax_nvfp4_quantize_rows"] = Capsule(JaxNvfp4QuantizeRowsCpu);
    d["jax_nvfp4_quantize_cols"] = Capsule(JaxNvfp4QuantizeColsCpu);
    d["jax_nvfp4_quantize_rows_cols"] = Capsule(JaxNvfp4QuantizeRowsColsCpu);
    d["jax_nvfp4_amax"] = Capsule(JaxNvfp4AmaxCpu);
    d["jax_nvfp4_dequantize"] = Capsule(JaxNvfp4DequantizeCpu);
    d["jax_nvfp4_matmul"] = Capsule(JaxNvfp4MatmulCpu);
    return d;
  });
  // The Blackwell scale layout's offsets, for tests of the host-side layout
  // code against jax_nvfp4.blackwell.swizzle_scales.
  m.def("swizzled_scale_offsets", [](int64_t rows, int64_t cols) {
    std::vector<int64_t> offsets;
    offsets.reserve(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        offsets.push_back(jax_nvfp4::SwizzledScaleOffset(r, c, cols));
      }
    }
    return offsets;
  });
  // The argument checks of the Blackwell FP4 GEMM handler, for CPU tests of
  // jax_nvfp4.blackwell.native_operands: the handler's per-item strides, or
  // ValueError with the handler's message.
  m.def(
      "plan_fp4_gemm",
      [](std::vector<int64_t> a_codes, std::vector<int64_t> a_scales,
         std::vector<int64_t> a_amax, std::vector<int64_t> b_codes,
         std::vector<int64_t> b_scales, std::vector<int64_t> b_amax,
         std::vector<int64_t> out, std::vector<int64_t> workspace) {
        jax_nvfp4::Fp4GemmPlan p;
        const std::string error =
            jax_nvfp4::PlanFp4Gemm(a_codes, a_scales, a_amax, b_codes, b_scales,
                                   b_amax, out, workspace, &p);
        if (!error.empty()) throw nb::value_error(error.c_str());
        nb::dict d;
        d["batch"] = p.batch;
        d["m"] = p.m;
        d["n"] = p.n;
        d["k"] = p.k;
        d["a_codes_stride"] = p.a_codes_stride;
        d["b_codes_stride"] = p.b_codes_stride;
        d["a_scales_stride"] = p.a_scales_stride;
        d["b_scales_stride"] = p.b_scales_stride;
        d["out_stride"] = p.out_stride;
        d["a_amax_stride"] = p.a_amax_stride;
        d["b_amax_stride"] = p.b_amax_stride;
        d["workspace_head_bytes"] = p.workspace_head_bytes;
        d["workspace_bytes"] = p.workspace_bytes;
        return d;
      },
      nb::arg("a_codes"), nb::arg("a_scales"), nb::arg("a_amax"),
      nb::arg("b_codes"), nb::arg("b_scales"), nb::arg("b_amax"),
      nb::arg("out"), nb::arg("workspace"));
  // The argument checks and call plan of the cuBLASLt bf16 GEMM handler, for
  // CPU tests: the handler's strides and cublasLtMatmul calls, or ValueError
  // with the handler's message.
  m.def(
      "plan_bf16_gemm",
      [](std::vector<int64_t> a, std::vector<int64_t> b,
         std::vector<int64_t> a_amax, std::vector<int64_t> b_amax,
         std::vector<int64_t> out, std::vector<int64_t> workspace) {
        jax_nvfp4::Bf16GemmPlan p;
        const std::string error =
            jax_nvfp4::PlanBf16Gemm(a, b, a_amax, b_amax, out, workspace, &p);
        if (!error.empty()) throw nb::value_error(error.c_str());
        nb::dict d;
        d["batch"] = p.batch;
        d["m"] = p.m;
        d["n"] = p.n;
        d["k"] = p.k;
        d["a_stride"] = p.a_stride;
        d["b_stride"] = p.b_stride;
        d["out_stride"] = p.out_stride;
        d["a_amax_stride"] = p.a_amax_stride;
        d["b_amax_stride"] = p.b_amax_stride;
        d["alphas"] = p.alphas;
        d["calls"] = p.calls;
        d["call_batch"] = p.call_batch;
        d["call_m"] = p.call_m;
        d["workspace_head_bytes"] = p.workspace_head_bytes;
        d["workspace_bytes"] = p.workspace_bytes;
        return d;
      },
      nb::arg("a"), nb::arg("b"), nb::arg("a_amax"), nb::arg("b_amax"),
      nb::arg("out"), nb::arg("workspace"));
  // How many cuBLASLt GEMM handler calls ran inside a CUDA graph capture,
  // and how many of them did the one-time setup there (cublaslt.h);
  // None without the cuBLASLt handlers.
  m.def("gemm_capture_counts", []() -> nb::object {
#ifdef JAX_NVFP4_WITH_CUBLASLT
    int64_t calls = 0, setups = 0;
    JaxNvfp4GemmCaptureCounts(&calls, &setups);
    nb::dict d;
    d["captured_calls"] = calls;
    d["captured_setups"] = setups;
    return d;
#else
    return nb::none();
#endif
  });
  // For tests: the cuBLASLt GEMM handlers forget their cached handles and
  // algorithms (leaking the handles), so that the next call sets up again;
  // False without the cuBLASLt handlers.
  m.def("forget_gemm_setup", []() {
#ifdef JAX_NVFP4_WITH_CUBLASLT
    JaxNvfp4ForgetGemmSetup();
    return true;
#else
    return false;
#endif
  });
  m.def("cuda_registrations", []() {
    nb::dict d;
#ifdef JAX_NVFP4_WITH_CUDA
    d["jax_nvfp4_quantize_rows"] = Capsule(JaxNvfp4QuantizeRowsCuda);
    d["jax_nvfp4_quantize_cols"] = Capsule(JaxNvfp4QuantizeColsCuda);
    d["jax_nvfp4_quantize_rows_cols"] = Capsule(JaxNvfp4QuantizeRowsColsCuda);
    d["jax_nvfp4_quantize_rows_cols_decoded"] =
        Capsule(JaxNvfp4QuantizeRowsColsDecodedCuda);
    d["jax_nvfp4_amax"] = Capsule(JaxNvfp4AmaxCuda);
    d["jax_nvfp4_dequantize"] = Capsule(JaxNvfp4DequantizeCuda);
    d["jax_nvfp4_decode_bf16"] = Capsule(JaxNvfp4DecodeBf16Cuda);
#endif
#ifdef JAX_NVFP4_WITH_CUBLASLT
    d["jax_nvfp4_matmul_bf16"] = Capsule(JaxNvfp4MatmulBf16Cuda);
    d["jax_nvfp4_matmul_bf16_graph"] = Capsule(JaxNvfp4MatmulBf16GraphCuda);
#endif
#ifdef JAX_NVFP4_WITH_BLACKWELL_GEMM
    d["jax_nvfp4_matmul_fp4_sm100"] = Capsule(JaxNvfp4MatmulFp4Sm100Cuda);
#endif
    return d;
  });
}
