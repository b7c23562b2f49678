// The Python extension jax_nvfp4._ffi_testing: what the Python tests compare
// against the C++, kept out of the product extension jax_nvfp4._ffi.
//   * The plans of the cuBLASLt GEMM handlers (gemm/cublaslt/*_plan.h) and
//     the Blackwell scale layout (numerics/scale_layout.h), for the tests
//     that check Python's operand preparation (jax_nvfp4.backends.fp4_gemm,
//     fp4_grouped_gemm, bf16_gemm) against the handlers' checks. The plans
//     themselves are tested in C++ (tests/cpp/).
//   * The cuBLASLt handlers' CUDA-graph capture counts and setup reset
//     (gemm/cublaslt/cublaslt.h), for the GPU tests: their state lives in
//     jax_nvfp4._ffi, which exports two C functions for them; None / False
//     where that extension was built without the cuBLASLt handlers.
#include <dlfcn.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gemm/cublaslt/bf16_gemm_plan.h"
#include "gemm/cublaslt/fp4_gemm_plan.h"
#include "gemm/cublaslt/fp4_grouped_gemm_plan.h"
#include "gemm/cublaslt/gemm_plan.h"
#include "numerics/scale_layout.h"

namespace nb = nanobind;

namespace {

using Shape = std::vector<int64_t>;

// A plan as a dict: the call's fields, "launches" (a dict per launch) and
// "zeros" ((begin, end) per range). ValueError with the handler's message
// where the plan refuses the arguments.
nb::dict PlanDict(const std::string& error, const jax_nvfp4::GemmCallPlan& p) {
  if (!error.empty()) throw nb::value_error(error.c_str());
  nb::list launches;
  for (const jax_nvfp4::GemmLaunch& l : p.launches) {
    nb::dict d;
    d["m"] = l.m;
    d["n"] = l.n;
    d["k"] = l.k;
    d["ld"] = l.ld;
    d["batch"] = l.batch;
    d["a_stride"] = l.a_stride;
    d["b_stride"] = l.b_stride;
    d["out_stride"] = l.out_stride;
    d["a"] = l.a;
    d["b"] = l.b;
    d["a_scales"] = l.a_scales;
    d["b_scales"] = l.b_scales;
    d["out"] = l.out;
    d["alpha"] = l.alpha;
    d["group"] = l.group;
    launches.append(d);
  }
  nb::list zeros;
  for (const jax_nvfp4::ElementRange& z : p.zeros) {
    zeros.append(nb::make_tuple(z.begin, z.end));
  }
  nb::dict d;
  d["batch"] = p.batch;
  d["m"] = p.m;
  d["n"] = p.n;
  d["k"] = p.k;
  d["alphas"] = p.alphas;
  d["a_amax_stride"] = p.a_amax_stride;
  d["b_amax_stride"] = p.b_amax_stride;
  d["workspace_head_bytes"] = p.workspace_head_bytes;
  d["workspace_bytes"] = p.workspace_bytes;
  d["launches"] = launches;
  d["zeros"] = zeros;
  return d;
}

// A C function of the extension jax_nvfp4._ffi, or nullptr.
void* ExtensionFunction(const char* name) {
  const nb::object ffi = nb::module_::import_("jax_nvfp4._ffi");
  const std::string path = nb::cast<std::string>(ffi.attr("__file__"));
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (library == nullptr) return nullptr;
  void* function = dlsym(library, name);
  dlclose(library);  // the extension stays loaded: Python holds it
  return function;
}

}  // namespace

NB_MODULE(_ffi_testing, m) {
  m.def(
      "plan_bf16_gemm",
      [](Shape a, Shape b, Shape a_amax, Shape b_amax, Shape out,
         Shape workspace) {
        jax_nvfp4::GemmCallPlan p;
        return PlanDict(
            jax_nvfp4::PlanBf16Gemm(a, b, a_amax, b_amax, out, workspace, &p),
            p);
      },
      nb::arg("a"), nb::arg("b"), nb::arg("a_amax"), nb::arg("b_amax"),
      nb::arg("out"), nb::arg("workspace"));
  m.def(
      "plan_fp4_gemm",
      [](Shape a_codes, Shape a_scales, Shape a_amax, Shape b_codes,
         Shape b_scales, Shape b_amax, Shape out, Shape workspace) {
        jax_nvfp4::GemmCallPlan p;
        return PlanDict(
            jax_nvfp4::PlanFp4Gemm(a_codes, a_scales, a_amax, b_codes, b_scales,
                                   b_amax, out, workspace, &p),
            p);
      },
      nb::arg("a_codes"), nb::arg("a_scales"), nb::arg("a_amax"),
      nb::arg("b_codes"), nb::arg("b_scales"), nb::arg("b_amax"),
      nb::arg("out"), nb::arg("workspace"));
  // The grouped plan for group sizes known on the host (the handler reads
  // them from the device).
  m.def(
      "plan_grouped_fp4_gemm",
      [](bool tokens, Shape a_codes, Shape a_scales, Shape b_codes,
         Shape b_scales, Shape a_amax, Shape b_amax, Shape out, Shape workspace,
         Shape group_sizes) {
        jax_nvfp4::Fp4GroupedPlan p;
        const Shape sizes_shape = {static_cast<int64_t>(group_sizes.size())};
        std::string error = jax_nvfp4::PlanGroupedFp4Shapes(
            tokens, a_codes, a_scales, b_codes, b_scales, sizes_shape, a_amax,
            b_amax, out, workspace, &p);
        if (error.empty()) {
          error = jax_nvfp4::PlanGroupedFp4Launches(group_sizes, &p);
        }
        return PlanDict(error, p);
      },
      nb::arg("tokens"), nb::arg("a_codes"), nb::arg("a_scales"),
      nb::arg("b_codes"), nb::arg("b_scales"), nb::arg("a_amax"),
      nb::arg("b_amax"), nb::arg("out"), nb::arg("workspace"),
      nb::arg("group_sizes"));
  // The byte offset of every scale of a [rows, cols] matrix in the Blackwell
  // layout, row-major.
  m.def(
      "swizzled_scale_offsets",
      [](int64_t rows, int64_t cols) {
        std::vector<int64_t> offsets;
        offsets.reserve(rows * cols);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            offsets.push_back(jax_nvfp4::SwizzledScaleOffset(r, c, cols));
          }
        }
        return offsets;
      },
      nb::arg("rows"), nb::arg("cols"));
  // How many cuBLASLt GEMM handler calls ran inside a CUDA graph capture,
  // and how many one-time setups ran there.
  m.def("gemm_capture_counts", []() -> nb::object {
    using Counts = void (*)(int64_t*, int64_t*);
    auto counts = reinterpret_cast<Counts>(
        ExtensionFunction("JaxNvfp4GemmCaptureCounts"));
    if (counts == nullptr) return nb::none();
    int64_t calls = 0, setups = 0;
    counts(&calls, &setups);
    nb::dict d;
    d["captured_calls"] = calls;
    d["captured_setups"] = setups;
    return d;
  });
  // The cuBLASLt GEMM handlers forget their cached handles and algorithms
  // (leaking the handles), so that the next call sets up again.
  m.def("forget_gemm_setup", []() {
    using Forget = void (*)();
    auto forget =
        reinterpret_cast<Forget>(ExtensionFunction("JaxNvfp4ForgetGemmSetup"));
    if (forget == nullptr) return false;
    forget();
    return true;
  });
}
