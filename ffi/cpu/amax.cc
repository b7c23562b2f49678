// CPU handlers of jax_nvfp4_amax, the plain and the RHT amax of each batch
// item (the values of the CUDA amax kernels), and of jax_nvfp4_abs_max, the
// plain amax alone (the CPU's global_amax); cpu/quantize_kernels.inc, on
// XLA's intra-op threads.
#include <algorithm>
#include <cstdint>
#include <mutex>

#include "bindings.h"
#include "checks.h"
#include "cpu/common.h"
#include "numerics/nvfp4.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace cpu {
namespace {

#define JAX_NVFP4_KERNELS "cpu/quantize_kernels.inc"
#include "cpu/isa_variants.inc"
#undef JAX_NVFP4_KERNELS

// out[b] = (max |x[b]|, max |bf16(RHT(x[b]))|) over the finite values (NaN
// and +-inf ignored; 0 if there is none), with the
// transform on 16-chunks along k (`cols` false, as quantize_rows transforms)
// or along m (`cols` true, as quantize_cols).
ffi::Error AmaxCpu(ffi::ThreadPool pool, ffi::AnyBuffer x,
                   ffi::Result<ffi::Buffer<ffi::F32>> out, bool cols) {
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
  // A maximum of values that are 0 or normal (never a subnormal: FTZ and
  // DAZ) is the same in any order, so the partial maxima of the chunks
  // combine to the bits of one sequential pass.
  float* const result = out->typed_data();
  std::fill(result, result + 2 * d.batch, 0.0f);
  std::mutex mu;
  const int64_t item = d.m * d.k;
  const int64_t element_bytes = x.element_type() == ffi::DataType::F32 ? 4 : 2;
  ForTileRows(pool, d, [&](int64_t b, int64_t first, int64_t last) {
    const MatrixInput in{
        static_cast<const char*>(x.untyped_data()) + b * item * element_bytes,
        x.element_type(), d.m, d.k};
    float plain = 0.0f, transformed = 0.0f;
    JAX_NVFP4_CALL_KERNEL(AmaxTileRows, in, first, last, cols, &plain,
                          &transformed);
    std::lock_guard<std::mutex> lock(mu);
    result[2 * b] = std::max(result[2 * b], plain);
    result[2 * b + 1] = std::max(result[2 * b + 1], transformed);
  });
  return ffi::Error::Success();
}

// out[b] = max |x[b]| over the finite values (NaN and +-inf ignored; 0 if
// there is none), x [batch, m, k] of any m and k.
ffi::Error AbsMaxCpu(ffi::ThreadPool pool, ffi::AnyBuffer x,
                     ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const ScopedFlushSubnormals flush_subnormals;
  if (!IsSupportedInputType(x.element_type())) {
    return InvalidArgument("input must be float32, bfloat16 or float16");
  }
  MatrixDims d;
  if (!Rank3Dims(x, &d)) return InvalidArgument("expected a rank-3 input");
  if (static_cast<int64_t>(out->element_count()) != d.batch) {
    return InvalidArgument("output must be [batch]");
  }
  // As in AmaxCpu, the partial maxima combine to the bits of one pass.
  float* const result = out->typed_data();
  std::fill(result, result + d.batch, 0.0f);
  const int64_t item = d.m * d.k;
  if (item == 0) return ffi::Error::Success();
  // Chunks of 64K elements at least, none spanning two batch items.
  const int64_t per_item = ChunkCount(pool, item, 1 << 16);
  const int64_t size = (item + per_item - 1) / per_item;
  const int64_t element_bytes = x.element_type() == ffi::DataType::F32 ? 4 : 2;
  std::mutex mu;
  ParallelFor(pool, d.batch * per_item, [&](int64_t c) {
    const int64_t b = c / per_item;
    const int64_t first = (c % per_item) * size;
    if (first >= item) return;
    const float partial = JAX_NVFP4_CALL_KERNEL(
        AbsMaxRange,
        static_cast<const char*>(x.untyped_data()) + b * item * element_bytes,
        x.element_type(), first, std::min(first + size, item));
    std::lock_guard<std::mutex> lock(mu);
    result[b] = std::max(result[b], partial);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4AmaxCpu, jax_nvfp4::cpu::AmaxCpu,
    jax_nvfp4::AmaxBinding(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

// CPU only (the CUDA build has no jax_nvfp4_abs_max: its XLA reduce is the
// global amax there), so the binding lives here.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4AbsMaxCpu, jax_nvfp4::cpu::AbsMaxCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [b, m, k]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [b]
