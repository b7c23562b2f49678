// The Python extension: hands the FFI handlers to jax_nvfp4 as capsules,
// which jax_nvfp4/_ffi_registry.py registers with jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <vector>

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
XLA_FFI_Error* JaxNvfp4AmaxCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxNvfp4DequantizeCuda(XLA_FFI_CallFrame*);
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
  m.def("cuda_registrations", []() {
    nb::dict d;
#ifdef JAX_NVFP4_WITH_CUDA
    d["jax_nvfp4_quantize_rows"] = Capsule(JaxNvfp4QuantizeRowsCuda);
    d["jax_nvfp4_quantize_cols"] = Capsule(JaxNvfp4QuantizeColsCuda);
    d["jax_nvfp4_quantize_rows_cols"] = Capsule(JaxNvfp4QuantizeRowsColsCuda);
    d["jax_nvfp4_amax"] = Capsule(JaxNvfp4AmaxCuda);
    d["jax_nvfp4_dequantize"] = Capsule(JaxNvfp4DequantizeCuda);
#endif
    return d;
  });
}
