// CPU handler of jax_nvfp4_matmul: the block-scaled FP4 GEMM, every output
// summed over k in order (cpu/gemm_kernels.inc), on XLA's intra-op threads,
// with a few MiB of decoded operands at a time.
#include <algorithm>
#include <cstdint>
#include <memory>

#include "bindings.h"
#include "checks.h"
#include "cpu/common.h"
#include "numerics/nvfp4.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace cpu {
namespace {

// One batch item's operand of the kernels: codes [rows, K/2] and scale bytes
// [rows, K/16].
struct GemmOperand {
  const uint8_t* codes;
  const uint8_t* scales;
  int64_t rows;
};

#define JAX_NVFP4_KERNELS "cpu/gemm_kernels.inc"
#include "cpu/isa_variants.inc"
#undef JAX_NVFP4_KERNELS

// out[b, m, n] = alpha * sum_k e2m1(a[b, m, k]) s_a * e2m1(b[b', n, k]) s_b,
// alpha = (amax_a / 2688) * (amax_b / 2688). Every product is exact in
// float32 (2 + 4 significant bits per factor); each output adds its products
// over k = 0, 1, ..., K - 1 in order in one float32 accumulator (from +0),
// then multiplies by alpha and rounds once to the output type: the same bits
// for any split over threads and any kernel variant. b has batch 1 (shared)
// or the batch of a; each amax has one value per batch item of its operand,
// or one in all.
ffi::Error MatmulCpu(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> a_codes,
                     ffi::AnyBuffer a_scales, ffi::Buffer<ffi::F32> a_amax,
                     ffi::Buffer<ffi::U8> b_codes, ffi::AnyBuffer b_scales,
                     ffi::Buffer<ffi::F32> b_amax,
                     ffi::Result<ffi::AnyBuffer> out) {
  const ScopedFlushSubnormals flush_subnormals;
  const auto ad = a_codes.dimensions();
  const auto bd = b_codes.dimensions();
  const auto od = out->dimensions();
  if (ad.size() != 3 || bd.size() != 3 || od.size() != 3) {
    return InvalidArgument("matmul operands must be rank 3");
  }
  const int64_t batch = ad[0], m = ad[1], k = 2 * ad[2];
  const int64_t b_batch = bd[0], n = bd[1];
  if (2 * bd[2] != k || k % kBlock != 0 || (b_batch != 1 && b_batch != batch) ||
      od[0] != batch || od[1] != m || od[2] != n ||
      static_cast<int64_t>(a_scales.element_count()) !=
          batch * m * k / kBlock ||
      static_cast<int64_t>(b_scales.element_count()) !=
          b_batch * n * k / kBlock ||
      a_scales.element_type() != ffi::DataType::F8E4M3FN ||
      b_scales.element_type() != ffi::DataType::F8E4M3FN ||
      (a_amax.element_count() != 1 &&
       static_cast<int64_t>(a_amax.element_count()) != batch) ||
      (b_amax.element_count() != 1 &&
       static_cast<int64_t>(b_amax.element_count()) != b_batch)) {
    return InvalidArgument("matmul operands have inconsistent shapes");
  }
  if (const ffi::DataType t = out->element_type();
      t != ffi::DataType::F32 && t != ffi::DataType::BF16) {
    return InvalidArgument("matmul output must be float32 or bfloat16");
  }
  const uint8_t* as = static_cast<const uint8_t*>(a_scales.untyped_data());
  const uint8_t* bs = static_cast<const uint8_t*>(b_scales.untyped_data());
  const bool bf16 = out->element_type() == ffi::DataType::BF16;
  if (batch == 0 || m == 0 || n == 0) return ffi::Error::Success();
  // b's rows (the output's columns) in blocks of about 8 MiB of decoded
  // panels: each block decoded once, by all threads, then multiplied by every
  // block of a's rows, decoded slice by slice (cpu/gemm_kernels.inc), in
  // chunks over (batch item, block of a, part of b's block).
  const int64_t cols = JAX_NVFP4_CALL_KERNEL(PanelCols);
  const int64_t block_rows = JAX_NVFP4_CALL_KERNEL(BlockRows);
  const int64_t n_block = std::clamp<int64_t>(
      (int64_t{1} << 21) / std::max<int64_t>(1, k) / cols * cols, cols,
      4096 / cols * cols);
  const int64_t a_blocks = (m + block_rows - 1) / block_rows;
  std::unique_ptr<float[]> b_packed(
      new float[std::min(n_block, (n + cols - 1) / cols * cols) * k]);
  for (int64_t b_item = 0; b_item < b_batch; ++b_item) {
    const GemmOperand b_op{b_codes.typed_data() + b_item * n * (k / 2),
                           bs + b_item * n * (k / kBlock), n};
    const float b_max =
        b_amax.typed_data()[b_amax.element_count() == 1 ? 0 : b_item];
    // The a items that meet this b: all of them for a shared b.
    const int64_t first_item = b_batch == 1 ? 0 : b_item;
    const int64_t items = b_batch == 1 ? batch : 1;
    for (int64_t n0 = 0; n0 < n; n0 += n_block) {
      const int64_t count = std::min(n_block, n - n0);
      const int64_t panels = (count + cols - 1) / cols;
      ParallelFor(pool, ChunkCount(pool, panels, 1), [&](int64_t c) {
        const int64_t chunks = ChunkCount(pool, panels, 1);
        const int64_t per_chunk = (panels + chunks - 1) / chunks;
        for (int64_t q = c * per_chunk;
             q < std::min(panels, (c + 1) * per_chunk); ++q) {
          JAX_NVFP4_CALL_KERNEL(PackPanel, b_op.codes, b_op.scales, k,
                                n0 + q * cols, std::min(cols, count - q * cols),
                                cols, 0, k, b_packed.get() + q * k * cols);
        }
      });
      // Enough parts of b's block to keep every thread busy.
      const int64_t wanted = ChunkCount(pool, items * a_blocks * panels, 1);
      const int64_t parts = std::clamp<int64_t>(
          (wanted + items * a_blocks - 1) / (items * a_blocks), 1, panels);
      const int64_t per_part = (panels + parts - 1) / parts;
      ParallelFor(pool, items * a_blocks * parts, [&](int64_t c) {
        const int64_t item = first_item + c / (a_blocks * parts);
        const int64_t a_row0 = (c / parts) % a_blocks * block_rows;
        const int64_t q0 = c % parts * per_part;
        if (q0 >= panels) return;
        const GemmOperand a_op{a_codes.typed_data() + item * m * (k / 2),
                               as + item * m * (k / kBlock), m};
        const float a_max =
            a_amax.typed_data()[a_amax.element_count() == 1 ? 0 : item];
        const float alpha = (a_max / kScaleRange) * (b_max / kScaleRange);
        JAX_NVFP4_CALL_KERNEL(
            MultiplyBlock, a_op, a_row0, std::min(block_rows, m - a_row0),
            b_packed.get() + q0 * k * cols, n0 + q0 * cols,
            std::min(per_part * cols, count - q0 * cols), n, k, alpha, bf16,
            static_cast<char*>(out->untyped_data()) +
                item * m * n * (bf16 ? 2 : 4));
      });
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4MatmulCpu, jax_nvfp4::cpu::MatmulCpu,
    jax_nvfp4::MatmulBinding(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
