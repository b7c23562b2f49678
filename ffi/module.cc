// The Python extension jax_nvfp4._ffi: hands the FFI handlers of targets.inc
// to jax_nvfp4 as capsules, which jax_nvfp4/backends/library.py registers
// with jax.ffi.register_ffi_target, and exposes the host-side logic that
// Python tests check (plans of the GEMM handlers, the scale layout) and the
// rule of the fused quantize kernel.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/fused_quantize_rule.h"
#include "gemm/cublaslt/bf16_gemm_plan.h"
#include "gemm/cublaslt/fp4_gemm_plan.h"
#include "gemm/cublaslt/fp4_grouped_gemm_plan.h"
#include "gemm/mma/w4a16_gemm_plan.h"
#include "numerics/scale_layout.h"
#include "targets.h"
#include "xla/ffi/api/c_api.h"

extern "C" {
#define JAX_NVFP4_TARGET(name, symbol, platform, gate) \
  JAX_NVFP4_IF_BUILT(gate, XLA_FFI_Error* symbol(XLA_FFI_CallFrame*);)
#include "targets.inc"
#undef JAX_NVFP4_TARGET
#ifdef JAX_NVFP4_WITH_CUBLASLT
void JaxNvfp4GemmCaptureCounts(int64_t* calls, int64_t* setups);
void JaxNvfp4ForgetGemmSetup();
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
#define JAX_NVFP4_TARGET(name, symbol, platform, gate) \
  JAX_NVFP4_IF_BUILT(gate,                             \
                     JAX_NVFP4_IF_CPU(platform, d[name] = Capsule(symbol);))
#include "targets.inc"
#undef JAX_NVFP4_TARGET
    return d;
  });
  m.def("cuda_registrations", []() {
    nb::dict d;
#define JAX_NVFP4_TARGET(name, symbol, platform, gate) \
  JAX_NVFP4_IF_BUILT(gate,                             \
                     JAX_NVFP4_IF_CUDA(platform, d[name] = Capsule(symbol);))
#include "targets.inc"
#undef JAX_NVFP4_TARGET
    return d;
  });
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
  // The Blackwell scale layout's offsets, for tests of the host-side layout
  // code against jax_nvfp4.backends.fp4_gemm.swizzle_scales.
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
  // The weight-only GEMM handler's launch plan for x [m, k] and a weight
  // [n, k]: jax_nvfp4.backends.w4a16_gemm sizes the handler's workspace
  // with it. ValueError with the handler's message for shapes it refuses.
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
  // The argument checks of the Blackwell FP4 GEMM handler, for CPU tests of
  // jax_nvfp4.backends.fp4_gemm.native_operands: the handler's per-item
  // strides, or ValueError with the handler's message.
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
  // The argument checks and launches of the Blackwell grouped FP4 GEMM
  // handler for host-side group sizes, for CPU tests of
  // jax_nvfp4.backends.fp4_grouped_gemm: each launch's problem and offsets
  // and the zeroed ranges of out, or ValueError with the handler's message.
  m.def(
      "plan_grouped_fp4_gemm",
      [](bool tokens, std::vector<int64_t> a_codes,
         std::vector<int64_t> a_scales, std::vector<int64_t> b_codes,
         std::vector<int64_t> b_scales, std::vector<int64_t> a_amax,
         std::vector<int64_t> b_amax, std::vector<int64_t> out,
         std::vector<int64_t> workspace, std::vector<int64_t> group_sizes) {
        jax_nvfp4::Fp4GroupedPlan p;
        const std::vector<int64_t> sizes_shape = {
            static_cast<int64_t>(group_sizes.size())};
        std::string error = jax_nvfp4::PlanGroupedFp4Shapes(
            tokens, a_codes, a_scales, b_codes, b_scales, sizes_shape, a_amax,
            b_amax, out, workspace, &p);
        if (error.empty()) {
          error = jax_nvfp4::PlanGroupedFp4Launches(group_sizes, &p);
        }
        if (!error.empty()) throw nb::value_error(error.c_str());
        nb::list launches;
        for (const auto& l : p.launches) {
          nb::dict d;
          d["group"] = l.group;
          d["m"] = l.m;
          d["n"] = l.n;
          d["k"] = l.k;
          d["ld"] = l.ld;
          d["a_codes"] = l.a_codes;
          d["b_codes"] = l.b_codes;
          d["a_scales"] = l.a_scales;
          d["b_scales"] = l.b_scales;
          d["out"] = l.out;
          launches.append(d);
        }
        nb::list zeros;
        for (const auto& z : p.zeros)
          zeros.append(nb::make_tuple(z.begin, z.end));
        nb::dict d;
        d["launches"] = launches;
        d["zeros"] = zeros;
        d["workspace_head_bytes"] = p.workspace_head_bytes;
        return d;
      },
      nb::arg("tokens"), nb::arg("a_codes"), nb::arg("a_scales"),
      nb::arg("b_codes"), nb::arg("b_scales"), nb::arg("a_amax"),
      nb::arg("b_amax"), nb::arg("out"), nb::arg("workspace"),
      nb::arg("group_sizes"));
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
  // and how many of them did the one-time setup there
  // (gemm/cublaslt/cublaslt.h); None without the cuBLASLt handlers.
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
}
