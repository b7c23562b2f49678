// CPU handler of jax_nvfp4_matmul: the exact reference of the block-scaled
// FP4 GEMM.
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

// out[b, m, n] = alpha * sum_k e2m1(a[b, m, k]) s_a * e2m1(b[b', n, k]) s_b,
// alpha = (amax_a / 2688) * (amax_b / 2688). Every product is exact in
// float32 (2 + 4 significant bits per factor); the sum runs over k = 0, 1,
// ..., K - 1 in float32. b has batch 1 (shared) or the batch of a; each
// amax has one value per batch item of its operand, or one in all.
ffi::Error MatmulCpu(ffi::Buffer<ffi::U8> a_codes, ffi::AnyBuffer a_scales,
                     ffi::Buffer<ffi::F32> a_amax, ffi::Buffer<ffi::U8> b_codes,
                     ffi::AnyBuffer b_scales, ffi::Buffer<ffi::F32> b_amax,
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
  // Decoded (unscaled-by-amax) values e2m1 * s_b of one row.
  auto decode_row = [](const uint8_t* codes, const uint8_t* scales, int64_t len,
                       float* row) {
    for (int64_t l = 0; l < len; ++l) {
      const uint32_t code = (codes[l / 2] >> (4 * (l & 1))) & 0xF;
      row[l] = E2M1Decode(code) * E4M3Decode(scales[l / kBlock]);
    }
  };
  // b transposed, k-major: the kLanes sums of one row of a run side by side
  // (vectorizable), each still adding its products in the order k = 0, 1, ...
  constexpr int64_t kLanes = 8;
  std::vector<float> b_rows(static_cast<size_t>(n * k));
  std::vector<float> b_cols(static_cast<size_t>(k * n));
  std::vector<float> a_row(static_cast<size_t>(k));
  std::vector<float> sums(static_cast<size_t>(n));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t bb = b_batch == 1 ? 0 : b;
    const float a_max =
        a_amax.typed_data()[a_amax.element_count() == 1 ? 0 : b];
    const float b_max =
        b_amax.typed_data()[b_amax.element_count() == 1 ? 0 : bb];
    const float alpha = (a_max / kScaleRange) * (b_max / kScaleRange);
    if (b == 0 || b_batch != 1) {
      for (int64_t j = 0; j < n; ++j) {
        decode_row(b_codes.typed_data() + (bb * n + j) * (k / 2),
                   bs + (bb * n + j) * (k / kBlock), k, &b_rows[j * k]);
      }
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t l = 0; l < k; ++l) b_cols[l * n + j] = b_rows[j * k + l];
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      decode_row(a_codes.typed_data() + (b * m + i) * (k / 2),
                 as + (b * m + i) * (k / kBlock), k, a_row.data());
      int64_t j0 = 0;
      for (; j0 + kLanes <= n; j0 += kLanes) {
        float acc[kLanes] = {};
        for (int64_t l = 0; l < k; ++l) {
          const float x = a_row[l];
          const float* col = &b_cols[l * n + j0];
          for (int64_t t = 0; t < kLanes; ++t) acc[t] += x * col[t];
        }
        for (int64_t t = 0; t < kLanes; ++t) sums[j0 + t] = acc[t];
      }
      for (int64_t j = j0; j < n; ++j) {
        float acc = 0.0f;
        for (int64_t l = 0; l < k; ++l) acc += a_row[l] * b_rows[j * k + l];
        sums[j] = acc;
      }
      for (int64_t j = 0; j < n; ++j) {
        const float value = sums[j] * alpha;
        const int64_t flat = (b * m + i) * n + j;
        StoreFloat(*out, flat, value);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4MatmulCpu, jax_nvfp4::cpu::MatmulCpu,
                              jax_nvfp4::MatmulBinding(ffi::Ffi::Bind()));
