// CPU handlers of jax_nvfp4_quantize_rows, _cols and _rows_cols: the exact
// reference of the NVFP4 quantize (numerics/nvfp4.h).
#include <cstdint>
#include <vector>

#include "bindings.h"
#include "checks.h"
#include "cpu/common.h"
#include "numerics/nvfp4.h"
#include "options.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace cpu {
namespace {

// Quantizes one [rows, len] matrix along len into codes [rows, len/2] and
// E4M3 scale bytes [rows, len/16]. Element (r, l) draws its stochastic-
// rounding bits at flat index index_base + r * index_row_stride + l of the
// whole quantized tensor.
void QuantizeMatrix(const float* q, int64_t rows, int64_t len, float amax,
                    uint32_t key0, uint32_t key1,
                    const QuantizeOptions& options, uint64_t index_base,
                    int64_t index_row_stride, uint8_t* codes, uint8_t* scales) {
  const GlobalScale g = GlobalScaleFromAmax(amax);
  const int64_t blocks = len / kBlock;
  const int64_t block_rows = options.block_rows;
  for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
    for (int64_t kb = 0; kb < blocks; ++kb) {
      // Step 3: the block's (tile's) amax, +inf if it holds a NaN or +-inf.
      float block_amax = 0.0f;
      for (int64_t r = r0; r < r0 + block_rows; ++r) {
        for (int i = 0; i < kBlock; ++i) {
          block_amax = BlockAmaxStep(block_amax, q[r * len + kb * kBlock + i]);
        }
      }
      const BlockScaling s = BlockScaleOf(block_amax, g);  // steps 3a/3b, 4
      for (int64_t r = r0; r < r0 + block_rows; ++r) {
        const uint64_t first = index_base + r * index_row_stride + kb * kBlock;
        uint64_t random_lo = 0, random_hi = 0;
        if (options.stochastic) {
          const uint32_t stream = static_cast<uint32_t>(options.stream);
          RandomBytes16(key0, key1, stream, first / kBlock, &random_lo,
                        &random_hi);
        }
        const uint64_t packed =
            s.non_finite
                ? kNonFiniteCodes
                : EncodeBlock16(&q[r * len + kb * kBlock], s.multiplier,
                                options.stochastic, random_lo, random_hi);
        for (int byte = 0; byte < 8; ++byte) {
          codes[r * (len / 2) + kb * 8 + byte] =
              static_cast<uint8_t>(packed >> (8 * byte));
        }
        scales[r * blocks + kb] = s.scale_byte;
      }
    }
  }
}

// values[i] = bfloat16(e2m1(code i) * s_b) for i < n, the amax not applied
// (exact: 2 + 4 significant bits, 2^-10 .. 2688): what the CUDA fused kernel
// writes for a decoded output, and reference.decode_bf16.
void DecodeBf16(const uint8_t* codes, const uint8_t* scales, int64_t n,
                uint16_t* values) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t code = (codes[i / 2] >> (4 * (i & 1))) & 0xF;
    values[i] =
        FloatToBfloat16Bits(E2M1Decode(code) * E4M3Decode(scales[i / kBlock]));
  }
}

// Checks x, the options and the placement of one output (its results are
// checked by the caller).
ffi::Error CheckQuantizeInput(const ffi::AnyBuffer& x, bool cols,
                              const ffi::Buffer<ffi::F32>& amax,
                              const ffi::Buffer<ffi::U32>& key,
                              const ffi::Buffer<ffi::S32>& origin,
                              GlobalPlace* place,
                              const QuantizeOptions& options, MatrixDims* d) {
  if (!IsSupportedInputType(x.element_type())) {
    return InvalidArgument("input must be float32, bfloat16 or float16");
  }
  if (!Rank3Dims(x, d)) return InvalidArgument("expected a rank-3 input");
  const int64_t rows = cols ? d->k : d->m;
  const int64_t len = cols ? d->m : d->k;
  if (auto e = CheckQuantizeOperands(d->batch, rows, len, options, amax, key);
      e.failure()) {
    return e;
  }
  return CheckPlace(*d, origin, place);
}

// The origin operand (read on the host here) keeps the input inside the
// whole tensor.
ffi::Error CheckOrigin(const MatrixDims& d, const int32_t* o,
                       const GlobalPlace& place) {
  if (o[0] < 0 || o[1] < 0 || o[2] < 0 || o[1] + d.m > place.global_m ||
      o[2] + d.k > place.global_k) {
    return InvalidArgument("origin places the input outside the tensor");
  }
  return ffi::Error::Success();
}

// Quantizes every batch item of x [batch, m, k] into one output: codes
// [batch, rows, len/2] and scales [batch, rows, len/16], or, `decoded`
// options, the bfloat16 values [batch, rows, len] in place of the codes.
void QuantizeOutput(const ffi::AnyBuffer& x, const MatrixDims& d, bool cols,
                    const ffi::Buffer<ffi::F32>& amax,
                    const ffi::Buffer<ffi::U32>& key, const int32_t* origin,
                    const GlobalPlace& place, const QuantizeOptions& options,
                    void* codes, uint8_t* scale_data) {
  const int64_t rows = cols ? d.k : d.m;
  const int64_t len = cols ? d.m : d.k;
  const int64_t n_amax = amax.element_count();
  const int64_t n_key = key.element_count() / 2;
  std::vector<uint8_t> item_codes(options.decoded ? rows * (len / 2) : 0);
  for (int64_t b = 0; b < d.batch; ++b) {
    const std::vector<float> q = OrientedMatrix(x, b, d, cols, options.rht);
    const int64_t a = b / (d.batch / n_amax);
    const int64_t kk = b / (d.batch / n_key);
    uint8_t* const item_scales = scale_data + b * rows * (len / 16);
    uint8_t* const code_data =
        options.decoded ? item_codes.data()
                        : static_cast<uint8_t*>(codes) + b * rows * (len / 2);
    QuantizeMatrix(q.data(), rows, len, amax.typed_data()[a],
                   key.typed_data()[2 * kk], key.typed_data()[2 * kk + 1],
                   options, GlobalRandomIndex(origin, place, cols, b, 0, 0),
                   cols ? place.global_m : place.global_k, code_data,
                   item_scales);
    if (options.decoded) {
      DecodeBf16(code_data, item_scales, rows * len,
                 static_cast<uint16_t*>(codes) + b * rows * len);
    }
  }
}

// quantize_rows (kCols = false): along k; quantize_cols (true): x[b]
// transposed, along m.
template <bool kCols>
ffi::Error QuantizeCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax,
                       ffi::Buffer<ffi::U32> key, ffi::Buffer<ffi::S32> origin,
                       ffi::Result<ffi::Buffer<ffi::U8>> codes,
                       ffi::Result<ffi::AnyBuffer> scales,
                       QuantizeOptions options, GlobalPlace place) {
  const ScopedFlushSubnormals flush_subnormals;
  if (auto e = CheckNotDecoded(options); e.failure()) return e;
  MatrixDims d;
  if (auto e =
          CheckQuantizeInput(x, kCols, amax, key, origin, &place, options, &d);
      e.failure()) {
    return e;
  }
  const int64_t rows = kCols ? d.k : d.m;
  const int64_t len = kCols ? d.m : d.k;
  if (auto e = CheckOutputSizes(d.batch, rows, len, codes, scales);
      e.failure()) {
    return e;
  }
  if (auto e = CheckOrigin(d, origin.typed_data(), place); e.failure()) {
    return e;
  }
  QuantizeOutput(x, d, kCols, amax, key, origin.typed_data(), place, options,
                 codes->typed_data(),
                 static_cast<uint8_t*>(scales->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error QuantizeRowsColsCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> row_amax,
                               ffi::Buffer<ffi::F32> col_amax,
                               ffi::Buffer<ffi::U32> key,
                               ffi::Buffer<ffi::S32> origin,
                               ffi::Result<ffi::AnyBuffer> row_codes,
                               ffi::Result<ffi::AnyBuffer> row_scales,
                               ffi::Result<ffi::AnyBuffer> col_codes,
                               ffi::Result<ffi::AnyBuffer> col_scales,
                               QuantizeOptions rows, QuantizeOptions cols,
                               GlobalPlace place) {
  const ScopedFlushSubnormals flush_subnormals;
  MatrixDims d;
  for (const bool side_cols : {false, true}) {
    if (auto e = CheckQuantizeInput(
            x, side_cols, side_cols ? col_amax : row_amax, key, origin, &place,
            side_cols ? cols : rows, &d);
        e.failure()) {
      return e;
    }
  }
  for (auto e : {CheckDecodableOutput(d.batch, d.m, d.k, rows.decoded,
                                      row_codes, row_scales),
                 CheckDecodableOutput(d.batch, d.k, d.m, cols.decoded,
                                      col_codes, col_scales),
                 CheckOrigin(d, origin.typed_data(), place)}) {
    if (e.failure()) return e;
  }
  QuantizeOutput(x, d, /*cols=*/false, row_amax, key, origin.typed_data(),
                 place, rows, row_codes->untyped_data(),
                 static_cast<uint8_t*>(row_scales->untyped_data()));
  QuantizeOutput(x, d, /*cols=*/true, col_amax, key, origin.typed_data(), place,
                 cols, col_codes->untyped_data(),
                 static_cast<uint8_t*>(col_scales->untyped_data()));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4QuantizeRowsCpu,
                              jax_nvfp4::cpu::QuantizeCpu</*kCols=*/false>,
                              jax_nvfp4::QuantizeBinding(ffi::Ffi::Bind(),
                                                         "rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4QuantizeColsCpu,
                              jax_nvfp4::cpu::QuantizeCpu</*kCols=*/true>,
                              jax_nvfp4::QuantizeBinding(ffi::Ffi::Bind(),
                                                         "cols"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4QuantizeRowsColsCpu, jax_nvfp4::cpu::QuantizeRowsColsCpu,
    jax_nvfp4::QuantizeRowsColsBinding(ffi::Ffi::Bind()));
