// CPU handler of jax_nvfp4_amax: the plain and the RHT amax of each batch
// item, the exact reference of the CUDA amax kernels.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "bindings.h"
#include "checks.h"
#include "cpu/common.h"
#include "numerics/nvfp4.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace cpu {
namespace {

// out[b] = (max |x[b]|, max |bf16(RHT(x[b]))|) over the finite values (NaN
// and +-inf ignored; 0 if there is none), with the
// transform on 16-chunks along k (`cols` false, as quantize_rows transforms)
// or along m (`cols` true, as quantize_cols).
ffi::Error AmaxCpu(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> out,
                   bool cols) {
  const ScopedFlushSubnormals flush_subnormals;
  if (!IsSupportedInputType(x.element_type())) {
    return InvalidArgument("input must be float32, bfloat16 or float16");
  }
  MatrixDims d;
  if (!Rank3Dims(x, &d)) return InvalidArgument("expected a rank-3 input");
  if ((cols ? d.m : d.k) % kBlock != 0) {
    return InvalidArgument("the transformed axis must be a multiple of 16");
  }
  if (static_cast<int64_t>(out->element_count()) != 2 * d.batch) {
    return InvalidArgument("output must be [batch, 2]");
  }
  for (int64_t b = 0; b < d.batch; ++b) {
    const std::vector<float> q = OrientedMatrix(x, b, d, cols, /*rht=*/false);
    float plain = 0.0f, transformed = 0.0f;
    for (size_t c = 0; c < q.size(); c += kBlock) {
      float y[kBlock];
      RandomHadamard16(&q[c], y);
      for (int i = 0; i < kBlock; ++i) {
        plain = MaxAbsFinite(plain, q[c + i]);
        transformed = MaxAbsFinite(transformed, y[i]);
      }
    }
    out->typed_data()[2 * b] = plain;
    out->typed_data()[2 * b + 1] = transformed;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4AmaxCpu, jax_nvfp4::cpu::AmaxCpu,
                              jax_nvfp4::AmaxBinding(ffi::Ffi::Bind()));
