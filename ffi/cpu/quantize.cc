// CPU handlers of jax_nvfp4_quantize_rows, _cols and _rows_cols: the bytes of
// the NVFP4 quantize of numerics/nvfp4.h, computed 16 blocks at a time
// (cpu/quantize_kernels.inc) on XLA's intra-op threads.
#include <cstdint>
#include <memory>

#include "bindings.h"
#include "checks.h"
#include "cpu/common.h"
#include "numerics/nvfp4.h"
#include "options.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace cpu {
namespace {

#define JAX_NVFP4_KERNELS "cpu/quantize_kernels.inc"
#include "cpu/isa_variants.inc"
#undef JAX_NVFP4_KERNELS

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

// One output of a quantize call: its options, amax and key operands, and
// where it goes: codes [batch, rows, len/2] (or, `decoded`, bfloat16 values
// [batch, rows, len], the codes going to a scratch buffer first) and scales
// [batch, rows, len/16].
struct Output {
  bool cols;
  const QuantizeOptions* options;
  const ffi::Buffer<ffi::F32>* amax;
  void* values;
  uint8_t* scales;
  std::unique_ptr<uint8_t[]> scratch_codes;  // the codes of a decoded output

  uint8_t* codes() {
    return options->decoded ? scratch_codes.get()
                            : static_cast<uint8_t*>(values);
  }
};

// The kernels' view of output `out` for batch item b.
QuantizeTarget TargetOf(Output& out, const MatrixDims& d,
                        const ffi::Buffer<ffi::U32>& key, const int32_t* origin,
                        const GlobalPlace& place, int64_t b) {
  const int64_t rows = out.cols ? d.k : d.m;
  const int64_t len = out.cols ? d.m : d.k;
  const int64_t n_amax = out.amax->element_count();
  const int64_t n_key = key.element_count() / 2;
  const int64_t a = b / (d.batch / n_amax);
  const int64_t kk = b / (d.batch / n_key);
  QuantizeTarget t;
  t.options = *out.options;
  t.scale = GlobalScaleFromAmax(out.amax->typed_data()[a]);
  t.key0 = key.typed_data()[2 * kk];
  t.key1 = key.typed_data()[2 * kk + 1];
  t.index_base = GlobalRandomIndex(origin, place, out.cols, b, 0, 0);
  t.index_row_stride = out.cols ? place.global_m : place.global_k;
  t.codes = out.codes() + b * rows * (len / 2);
  t.scales = out.scales + b * rows * (len / kBlock);
  return t;
}

// Quantizes every batch item of x [batch, m, k] into the outputs (null: not
// asked), in one pass over x's 16 x 16 tiles.
void QuantizeOutputs(ffi::ThreadPool& pool, const ffi::AnyBuffer& x,
                     const MatrixDims& d, const ffi::Buffer<ffi::U32>& key,
                     const int32_t* origin, const GlobalPlace& place,
                     Output* rows, Output* cols) {
  for (Output* out : {rows, cols}) {
    if (out != nullptr && out->options->decoded) {
      out->scratch_codes.reset(new uint8_t[d.batch * d.m * d.k / 2]);
    }
  }
  const int64_t item = d.m * d.k;
  const int64_t element_bytes = x.element_type() == ffi::DataType::F32 ? 4 : 2;
  ForTileRows(pool, d, [&](int64_t b, int64_t first, int64_t last) {
    const MatrixInput in{
        static_cast<const char*>(x.untyped_data()) + b * item * element_bytes,
        x.element_type(), d.m, d.k};
    QuantizeTarget row_target, col_target;
    if (rows != nullptr) row_target = TargetOf(*rows, d, key, origin, place, b);
    if (cols != nullptr) col_target = TargetOf(*cols, d, key, origin, place, b);
    JAX_NVFP4_CALL_KERNEL(QuantizeTileRows, in, first, last,
                          rows != nullptr ? &row_target : nullptr,
                          cols != nullptr ? &col_target : nullptr);
  });
  for (Output* out : {rows, cols}) {
    if (out == nullptr || !out->options->decoded) continue;
    const int64_t n = d.batch * d.m * d.k;
    const int64_t chunk = 1 << 16;  // a multiple of 16 elements
    ParallelFor(pool, (n + chunk - 1) / chunk, [&](int64_t c) {
      const int64_t first = c * chunk;
      DecodeBf16(out->codes() + first / 2, out->scales + first / kBlock,
                 std::min(chunk, n - first),
                 static_cast<uint16_t*>(out->values) + first);
    });
  }
}

// quantize_rows (kCols = false): along k; quantize_cols (true): x[b]
// transposed, along m.
template <bool kCols>
ffi::Error QuantizeCpu(ffi::ThreadPool pool, ffi::AnyBuffer x,
                       ffi::Buffer<ffi::F32> amax, ffi::Buffer<ffi::U32> key,
                       ffi::Buffer<ffi::S32> origin,
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
  Output out{kCols,
             &options,
             &amax,
             codes->typed_data(),
             static_cast<uint8_t*>(scales->untyped_data()),
             nullptr};
  QuantizeOutputs(pool, x, d, key, origin.typed_data(), place,
                  kCols ? nullptr : &out, kCols ? &out : nullptr);
  return ffi::Error::Success();
}

ffi::Error QuantizeRowsColsCpu(
    ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> row_amax,
    ffi::Buffer<ffi::F32> col_amax, ffi::Buffer<ffi::U32> key,
    ffi::Buffer<ffi::S32> origin, ffi::Result<ffi::AnyBuffer> row_codes,
    ffi::Result<ffi::AnyBuffer> row_scales,
    ffi::Result<ffi::AnyBuffer> col_codes,
    ffi::Result<ffi::AnyBuffer> col_scales, QuantizeOptions rows,
    QuantizeOptions cols, GlobalPlace place) {
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
  Output row_out{false,
                 &rows,
                 &row_amax,
                 row_codes->untyped_data(),
                 static_cast<uint8_t*>(row_scales->untyped_data()),
                 nullptr};
  Output col_out{true,
                 &cols,
                 &col_amax,
                 col_codes->untyped_data(),
                 static_cast<uint8_t*>(col_scales->untyped_data()),
                 nullptr};
  QuantizeOutputs(pool, x, d, key, origin.typed_data(), place, &row_out,
                  &col_out);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4QuantizeRowsCpu, jax_nvfp4::cpu::QuantizeCpu</*kCols=*/false>,
    jax_nvfp4::QuantizeBinding(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>(),
                               "rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4QuantizeColsCpu, jax_nvfp4::cpu::QuantizeCpu</*kCols=*/true>,
    jax_nvfp4::QuantizeBinding(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>(),
                               "cols"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4QuantizeRowsColsCpu,
                              jax_nvfp4::cpu::QuantizeRowsColsCpu,
                              jax_nvfp4::QuantizeRowsColsBinding(
                                  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
