// CPU handler of jax_nvfp4_dequantize: e2m1(code) * s_b * amax / 2688
// (cpu/dequantize_kernels.inc, on XLA's intra-op threads).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "bindings.h"
#include "checks.h"
#include "cpu/common.h"
#include "numerics/nvfp4.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace cpu {
namespace {

#define JAX_NVFP4_KERNELS "cpu/dequantize_kernels.inc"
#include "cpu/isa_variants.inc"
#undef JAX_NVFP4_KERNELS

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
  const ffi::DataType type = out->element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16) {
    return InvalidArgument("dequantize output must be float32 or bfloat16");
  }
  const bool bf16 = type == ffi::DataType::BF16;
  const int64_t element_bytes = bf16 ? 2 : 4;
  const uint8_t* scale_bytes =
      static_cast<const uint8_t*>(scales.untyped_data());
  const uint8_t* code_bytes = codes.typed_data();
  char* const out_bytes = static_cast<char*>(out->untyped_data());
  const int64_t blocks_per_row = len / kBlock;
  // Rows in chunks of about 64K elements, on XLA's intra-op threads.
  const int64_t total_rows = batch * rows;
  const int64_t chunks =
      ChunkCount(pool, total_rows,
                 std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, len)));
  const int64_t per_chunk = (total_rows + chunks - 1) / chunks;
  ParallelFor(pool, chunks, [&](int64_t c) {
    const int64_t last = std::min(total_rows, (c + 1) * per_chunk);
    // The chunk's rows by batch item, each run of them with its own amax.
    for (int64_t row = c * per_chunk; row < last;) {
      const int64_t b = row / rows;
      const int64_t end = std::min(last, (b + 1) * rows);
      const int64_t block = row * blocks_per_row;
      JAX_NVFP4_CALL_KERNEL(DequantizeBlocks, code_bytes + block * kBlock / 2,
                            scale_bytes + block,
                            amax.typed_data()[b / (batch / n_amax)],
                            (end - row) * blocks_per_row, bf16,
                            out_bytes + block * kBlock * element_bytes);
      row = end;
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
