// CPU handler of jax_nvfp4_matmul: the block-scaled FP4 GEMM, every output
// summed over k in order (cpu/gemm_kernels.inc), on XLA's intra-op threads.
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
  // Decode both operands into panels (cpu/gemm_kernels.inc).
  const int64_t rows = JAX_NVFP4_CALL_KERNEL(PanelRows);
  const int64_t cols = JAX_NVFP4_CALL_KERNEL(PanelCols);
  const int64_t a_panels = (m + rows - 1) / rows;  // per batch item
  const int64_t b_panels = (n + cols - 1) / cols;
  std::unique_ptr<float[]> a_packed(new float[batch * a_panels * rows * k]);
  std::unique_ptr<float[]> b_packed(new float[b_batch * b_panels * cols * k]);
  const int64_t panels = batch * a_panels + b_batch * b_panels;
  const int64_t pack_chunks = ChunkCount(
      pool, panels,
      std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, rows * k)));
  const int64_t per_chunk = (panels + pack_chunks - 1) / pack_chunks;
  ParallelFor(pool, pack_chunks, [&](int64_t c) {
    for (int64_t p = c * per_chunk; p < std::min(panels, (c + 1) * per_chunk);
         ++p) {
      if (p < batch * a_panels) {
        const int64_t item = p / a_panels, row0 = (p % a_panels) * rows;
        JAX_NVFP4_CALL_KERNEL(
            PackPanel, a_codes.typed_data() + item * m * (k / 2),
            as + item * m * (k / kBlock), k, row0, std::min(rows, m - row0),
            rows, a_packed.get() + p * rows * k);
      } else {
        const int64_t q = p - batch * a_panels;
        const int64_t item = q / b_panels, row0 = (q % b_panels) * cols;
        JAX_NVFP4_CALL_KERNEL(
            PackPanel, b_codes.typed_data() + item * n * (k / 2),
            bs + item * n * (k / kBlock), k, row0, std::min(cols, n - row0),
            cols, b_packed.get() + q * cols * k);
      }
    }
  });
  // Tiles in blocks of a panels (about 256 KiB of a, reused from the cache
  // against each b panel) times blocks of b panels (enough blocks to keep
  // every thread busy).
  const int64_t a_block =
      std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, rows * k));
  const int64_t a_blocks = (a_panels + a_block - 1) / a_block;
  const int64_t wanted = ChunkCount(pool, batch * a_blocks * b_panels, 1);
  const int64_t b_blocks = std::clamp<int64_t>(
      (wanted + batch * a_blocks - 1) / (batch * a_blocks), 1, b_panels);
  const int64_t b_block = (b_panels + b_blocks - 1) / b_blocks;
  const int64_t b_block_count = (b_panels + b_block - 1) / b_block;
  ParallelFor(pool, batch * a_blocks * b_block_count, [&](int64_t c) {
    const int64_t item = c / (a_blocks * b_block_count);
    const int64_t ab = (c / b_block_count) % a_blocks;
    const int64_t bb = c % b_block_count;
    const int64_t b_item = b_batch == 1 ? 0 : item;
    const float a_max =
        a_amax.typed_data()[a_amax.element_count() == 1 ? 0 : item];
    const float b_max =
        b_amax.typed_data()[b_amax.element_count() == 1 ? 0 : b_item];
    const float alpha = (a_max / kScaleRange) * (b_max / kScaleRange);
    void* item_out =
        static_cast<char*>(out->untyped_data()) + item * m * n * (bf16 ? 2 : 4);
    JAX_NVFP4_CALL_KERNEL(
        MultiplyPanels, a_packed.get() + item * a_panels * rows * k,
        b_packed.get() + b_item * b_panels * cols * k, m, n, k, ab * a_block,
        std::min(a_panels, (ab + 1) * a_block), bb * b_block,
        std::min(b_panels, (bb + 1) * b_block), alpha, bf16, item_out);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4MatmulCpu, jax_nvfp4::cpu::MatmulCpu,
    jax_nvfp4::MatmulBinding(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
