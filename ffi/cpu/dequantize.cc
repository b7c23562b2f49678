// CPU handler of jax_nvfp4_dequantize: e2m1(code) * s_b * amax / 2688.
#include <algorithm>
#include <cstdint>

#include "bindings.h"
#include "checks.h"
#include "cpu/common.h"
#include "numerics/nvfp4.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace cpu {
namespace {

// out[b, r, l] = e2m1(code) * s_b * amax / 2688, as float32 or bfloat16.
ffi::Error DequantizeCpu(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes,
                         ffi::AnyBuffer scales, ffi::Buffer<ffi::F32> amax,
                         ffi::Result<ffi::AnyBuffer> out) {
  const ScopedFlushSubnormals flush_subnormals;
  const auto dims = out->dimensions();
  if (dims.size() != 3) return InvalidArgument("expected a rank-3 output");
  const int64_t batch = dims[0], rows = dims[1], len = dims[2];
  const int64_t n_amax = amax.element_count();
  if (len % kBlock != 0 ||
      static_cast<int64_t>(codes.element_count()) != batch * rows * len / 2 ||
      static_cast<int64_t>(scales.element_count()) !=
          batch * rows * len / kBlock ||
      scales.element_type() != ffi::DataType::F8E4M3FN || n_amax < 1 ||
      batch % n_amax != 0) {
    return InvalidArgument("dequantize operands have inconsistent shapes");
  }
  if (const ffi::DataType t = out->element_type();
      t != ffi::DataType::F32 && t != ffi::DataType::BF16) {
    return InvalidArgument("dequantize output must be float32 or bfloat16");
  }
  const uint8_t* scale_bytes =
      static_cast<const uint8_t*>(scales.untyped_data());
  const uint8_t* code_bytes = codes.typed_data();
  // Rows in chunks of about 64K elements, on XLA's intra-op threads.
  const int64_t total_rows = batch * rows;
  const int64_t chunks =
      ChunkCount(pool, total_rows,
                 std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, len)));
  const int64_t per_chunk = (total_rows + chunks - 1) / chunks;
  ParallelFor(pool, chunks, [&](int64_t c) {
    const int64_t last = std::min(total_rows, (c + 1) * per_chunk);
    for (int64_t row = c * per_chunk; row < last; ++row) {
      const int64_t b = row / rows;
      const float a = amax.typed_data()[b / (batch / n_amax)];
      for (int64_t l = 0; l < len; ++l) {
        const int64_t flat = row * len + l;
        const float multiplier =
            BlockDecodeMultiplier(E4M3Decode(scale_bytes[flat / kBlock]), a);
        const uint32_t code = (code_bytes[flat / 2] >> (4 * (flat & 1))) & 0xF;
        const float value = E2M1Decode(code) * multiplier;
        StoreFloat(*out, flat, value);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4DequantizeCpu, jax_nvfp4::cpu::DequantizeCpu,
    jax_nvfp4::DequantizeBinding(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
