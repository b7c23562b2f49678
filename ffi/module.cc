// The Python extension jax_nvfp4._ffi: hands the FFI handlers of targets.inc
// to jax_nvfp4 as capsules, which jax_nvfp4/backends/library.py registers
// with jax.ffi.register_ffi_target, and the host-side rules that Python
// lowers by: where the fused quantize kernel writes decoded operands, and
// the workspace of the W4A16 GEMM. What only tests use is in
// jax_nvfp4._ffi_testing (testing_module.cc).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cuda/fused_quantize_rule.h"
#include "gemm/mma/w4a16_gemm_plan.h"
#include "targets.h"
#include "xla/ffi/api/c_api.h"

#ifndef JAX_NVFP4_CUDA_BUILD
#define JAX_NVFP4_CUDA_BUILD "unknown"
#endif

extern "C" {
#define JAX_NVFP4_TARGET(name, symbol, platform, gate) \
  JAX_NVFP4_IF_BUILT(gate, XLA_FFI_Error* symbol(XLA_FFI_CallFrame*);)
#include "targets.inc"
#undef JAX_NVFP4_TARGET
}

namespace nb = nanobind;

namespace {

// {target name: handler capsule} of the built targets of one platform
// ("cpu" or "cuda").
nb::dict Registrations(std::string_view platform) {
  nb::dict d;
#define JAX_NVFP4_TARGET(name, symbol, target_platform, gate)          \
  JAX_NVFP4_IF_BUILT(gate, if (platform == #target_platform) d[name] = \
                               nb::capsule(reinterpret_cast<void*>(symbol));)
#include "targets.inc"
#undef JAX_NVFP4_TARGET
  return d;
}

// Every target name of targets.inc, built here or not, once each (a name
// served on both platforms is listed once).
std::vector<std::string> TargetNames() {
  std::vector<std::string> names;
#define JAX_NVFP4_TARGET(name, symbol, target_platform, gate) \
  names.emplace_back(name);
#include "targets.inc"
#undef JAX_NVFP4_TARGET
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.def("cpu_registrations", []() { return Registrations("cpu"); });
  m.def("cuda_registrations", []() { return Registrations("cuda"); });
  m.def("target_names", &TargetNames);
  // The XLA FFI API version of the headers the handlers were built with: XLA
  // refuses handlers newer than its own, so jax_nvfp4 compares this with the
  // running jaxlib's before registering them.
  // Whether the CUDA handlers were built: "built", "no nvcc", "nvcc unusable"
  // or "JAX_NVFP4_CUDA=OFF" (the warning about missing handlers says which).
  m.def("cuda_build", []() { return std::string(JAX_NVFP4_CUDA_BUILD); });
  m.def("ffi_api_version",
        []() { return nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); });
  // Whether the fused CUDA quantize kernel writes decoded (bfloat16) operands
  // for these options (cuda/fused_quantize_rule.h); the handler also needs m
  // and k multiples of 16 and 16-byte aligned buffers at run time.
  m.def(
      "fused_quantize_writes_values",
      [](bool bf16_input, int64_t row_block_rows, bool row_rht,
         int64_t col_block_rows, bool col_rht) {
        return jax_nvfp4::FusedQuantizeWritesValues(
            bf16_input, row_block_rows, row_rht, col_block_rows, col_rht);
      },
      nb::arg("bf16_input"), nb::arg("row_block_rows"), nb::arg("row_rht"),
      nb::arg("col_block_rows"), nb::arg("col_rht"));
  // The W4A16 GEMM handler's launch plan for x [m, k] and a weight [n, k]
  // (gemm/mma/w4a16_gemm_plan.h): jax_nvfp4.backends.w4a16_gemm sizes the
  // handler's workspace with it. ValueError with the handler's message for
  // shapes it refuses.
  m.def(
      "plan_w4a16",
      [](int64_t m, int64_t n, int64_t k) {
        jax_nvfp4::W4A16Plan p;
        const std::string error = jax_nvfp4::PlanW4A16(m, n, k, &p);
        if (!error.empty()) throw nb::value_error(error.c_str());
        nb::dict d;
        d["m_tiles"] = p.config.m_tiles;
        d["tiles"] = p.config.tiles;
        d["depth"] = p.config.depth;
        d["chunks"] = p.config.chunks;
        d["row_tiles"] = p.row_tiles;
        d["slices"] = p.slices;
        d["column_tiles"] = p.column_tiles;
        d["arrivals_bytes"] = p.arrivals_bytes;
        d["partial_offset"] = p.partial_offset;
        d["workspace_bytes"] = p.workspace_bytes;
        return d;
      },
      nb::arg("m"), nb::arg("n"), nb::arg("k"));
}
