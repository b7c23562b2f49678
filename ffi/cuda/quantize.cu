// CUDA handlers of jax_nvfp4_quantize_rows, _cols and _rows_cols: the same
// bytes as the CPU handlers (cpu/quantize.cc). Kernels:
//   * QuantizePrivateTileKernel (quantize_private_tile.cu, 64 threads): the
//     recipe's fused bf16 quantize (1x16 or 16x16 blocks both ways, m and k
//     multiples of 16); each pair of lanes quantizes one 16x16 tile both
//     ways from their own slices of shared memory.
//   * QuantizeTileKernel (quantize_tile.cu): persistent CTAs over 128 (m) x
//     64 (k) tiles of x[b]; a tile is read once with coalesced 16-byte loads
//     into shared memory, quantized along k (rows) and along m (columns) from
//     there, and its code and scale bytes are written back in whole sectors.
//     Serves quantize_cols and the other fused quantize_rows_cols cases.
//   * QuantizeRowsKernel (quantize_rows.cu): persistent threads, one
//     16-element block along k at a time (the next block's loads in flight).
#include <cuda_runtime.h>

#include <cstdint>

#include "bindings.h"
#include "checks.h"
#include "cuda/launch.cuh"
#include "cuda/quantize.cuh"
#include "options.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

// Validates x and one output exactly as the CPU handler does.
ffi::Error CheckQuantize(const ffi::AnyBuffer& x, bool cols,
                         const ffi::Buffer<ffi::F32>& amax,
                         const ffi::Buffer<ffi::U32>& key,
                         const QuantizeOptions& options,
                         ffi::Result<ffi::Buffer<ffi::U8>>& codes,
                         ffi::Result<ffi::AnyBuffer>& scales, MatrixDims* d) {
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
  return CheckOutputSizes(d->batch, rows, len, codes, scales);
}

// CheckQuantize plus the shard placement (the origin itself is on the device).
ffi::Error CheckQuantizePlaced(
    const ffi::AnyBuffer& x, bool cols, const ffi::Buffer<ffi::F32>& amax,
    const ffi::Buffer<ffi::U32>& key, const ffi::Buffer<ffi::S32>& origin,
    GlobalPlace* place, const QuantizeOptions& options,
    ffi::Result<ffi::Buffer<ffi::U8>>& codes,
    ffi::Result<ffi::AnyBuffer>& scales, MatrixDims* d) {
  if (auto e = CheckQuantize(x, cols, amax, key, options, codes, scales, d);
      e.failure()) {
    return e;
  }
  return CheckPlace(*d, origin, place);
}

// One output's arguments; `codes`: the codes, or, `options.decoded`, the
// bfloat16 values (see OutputArgs).
OutputArgs MakeOutputArgs(const MatrixDims& d,
                          const ffi::Buffer<ffi::F32>& amax,
                          const ffi::Buffer<ffi::S32>& origin,
                          const GlobalPlace& place, bool cols,
                          const QuantizeOptions& options, void* codes,
                          void* scales) {
  OutputArgs o;
  o.codes = static_cast<uint8_t*>(codes);
  o.scales = static_cast<uint8_t*>(scales);
  o.amax = amax.typed_data();
  o.batch_per_amax = d.batch / static_cast<int64_t>(amax.element_count());
  o.stream = static_cast<uint32_t>(options.stream);
  o.block16 = options.block_rows == 16;
  o.stochastic = options.stochastic;
  o.rht = options.rht;
  o.codes_aligned = IsAligned(o.codes, options.decoded ? 16 : 8);
  o.decoded = options.decoded;
  o.origin = origin.typed_data();
  o.place = place;
  o.cols = cols;
  return o;
}

KeyArgs MakeKeyArgs(const MatrixDims& d, const ffi::Buffer<ffi::U32>& key) {
  return KeyArgs{key.typed_data(),
                 d.batch / static_cast<int64_t>(key.element_count() / 2)};
}

template <bool kRows, bool kCols>
ffi::Error LaunchTile(cudaStream_t stream, ffi::DataType type,
                      const TileArgs& args) {
  if (kRows && kCols && PrivateTileApplies(type, args)) {
    LaunchQuantizePrivateTile(stream, args);
    return LaunchError("quantize");
  }
  LaunchQuantizeTile<kRows, kCols>(stream, type, args);
  return LaunchError("quantize");
}

TileArgs MakeTileArgs(const ffi::AnyBuffer& x, const MatrixDims& d,
                      const ffi::Buffer<ffi::U32>& key) {
  TileArgs t{};
  t.x = x.untyped_data();
  t.batch = d.batch;
  t.m = d.m;
  t.k = d.k;
  t.m_tiles = (d.m + kTileM - 1) / kTileM;
  t.k_tiles = (d.k + kTileK - 1) / kTileK;
  t.tiles = d.batch * t.m_tiles * t.k_tiles;
  const int64_t bytes = ffi::ByteWidth(x.element_type());
  t.x_vec = IsAligned(t.x, 16) && (d.k * bytes) % 16 == 0;
  t.key = MakeKeyArgs(d, key);
  return t;
}

ffi::Error QuantizeRowsCuda(cudaStream_t stream, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::F32> amax,
                            ffi::Buffer<ffi::U32> key,
                            ffi::Buffer<ffi::S32> origin,
                            ffi::Result<ffi::Buffer<ffi::U8>> codes,
                            ffi::Result<ffi::AnyBuffer> scales,
                            QuantizeOptions options, GlobalPlace place) {
  if (auto e = CheckNotDecoded(options); e.failure()) return e;
  MatrixDims d;
  if (auto e = CheckQuantizePlaced(x, /*cols=*/false, amax, key, origin, &place,
                                   options, codes, scales, &d);
      e.failure()) {
    return e;
  }
  RowsArgs args;
  args.x = x.untyped_data();
  args.batch = d.batch;
  args.m = d.m;
  args.k = d.k;
  args.blocks = d.batch * d.m * (d.k / kBlock);
  if (args.blocks == 0) return ffi::Error::Success();
  args.x_vec = IsAligned(args.x, 16);
  args.key = MakeKeyArgs(d, key);
  args.out = MakeOutputArgs(d, amax, origin, place, false, options,
                            codes->typed_data(), scales->untyped_data());
  LaunchQuantizeRows(stream, x.element_type(), args);
  return LaunchError("quantize_rows");
}

ffi::Error QuantizeColsCuda(cudaStream_t stream, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::F32> amax,
                            ffi::Buffer<ffi::U32> key,
                            ffi::Buffer<ffi::S32> origin,
                            ffi::Result<ffi::Buffer<ffi::U8>> codes,
                            ffi::Result<ffi::AnyBuffer> scales,
                            QuantizeOptions options, GlobalPlace place) {
  if (auto e = CheckNotDecoded(options); e.failure()) return e;
  MatrixDims d;
  if (auto e = CheckQuantizePlaced(x, /*cols=*/true, amax, key, origin, &place,
                                   options, codes, scales, &d);
      e.failure()) {
    return e;
  }
  TileArgs args = MakeTileArgs(x, d, key);
  if (args.tiles == 0) return ffi::Error::Success();
  args.col = MakeOutputArgs(d, amax, origin, place, true, options,
                            codes->typed_data(), scales->untyped_data());
  args.row = args.col;  // unused
  return LaunchTile</*kRows=*/false, /*kCols=*/true>(stream, x.element_type(),
                                                     args);
}

// The fused row-wise + column-wise quantize. Either output (`rows.decoded`,
// `cols.decoded`) can be written as the bfloat16 operand of the Hopper GEMM,
// e2m1(code) * scale, instead of its codes: the values the GEMM's decode
// (DecodeBf16Kernel) would make of them, without the codes' round trip
// through memory -- only where QuantizePrivateTileKernel applies
// (fused_quantize_rule.h, and the run-time conditions of PrivateTileApplies).
ffi::Error QuantizeRowsColsCuda(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> row_amax,
    ffi::Buffer<ffi::F32> col_amax, ffi::Buffer<ffi::U32> key,
    ffi::Buffer<ffi::S32> origin, ffi::Result<ffi::AnyBuffer> row_values,
    ffi::Result<ffi::AnyBuffer> row_scales,
    ffi::Result<ffi::AnyBuffer> col_values,
    ffi::Result<ffi::AnyBuffer> col_scales, QuantizeOptions rows,
    QuantizeOptions cols, GlobalPlace place) {
  if (!IsSupportedInputType(x.element_type())) {
    return InvalidArgument("input must be float32, bfloat16 or float16");
  }
  MatrixDims d;
  if (!Rank3Dims(x, &d)) return InvalidArgument("expected a rank-3 input");
  for (auto e : {CheckQuantizeOperands(d.batch, d.m, d.k, rows, row_amax, key),
                 CheckQuantizeOperands(d.batch, d.k, d.m, cols, col_amax, key),
                 CheckDecodableOutput(d.batch, d.m, d.k, rows.decoded,
                                      row_values, row_scales),
                 CheckDecodableOutput(d.batch, d.k, d.m, cols.decoded,
                                      col_values, col_scales),
                 CheckPlace(d, origin, &place)}) {
    if (e.failure()) return e;
  }
  if ((rows.decoded && !IsAligned(row_values->untyped_data(), 16)) ||
      (cols.decoded && !IsAligned(col_values->untyped_data(), 16))) {
    return InvalidArgument("decoded outputs must be 16-byte aligned");
  }
  TileArgs args = MakeTileArgs(x, d, key);
  if (args.tiles == 0) return ffi::Error::Success();
  args.row =
      MakeOutputArgs(d, row_amax, origin, place, false, rows,
                     row_values->untyped_data(), row_scales->untyped_data());
  args.col =
      MakeOutputArgs(d, col_amax, origin, place, true, cols,
                     col_values->untyped_data(), col_scales->untyped_data());
  if ((rows.decoded || cols.decoded) &&
      !PrivateTileApplies(x.element_type(), args)) {
    return InvalidArgument(
        "decoded outputs need a bfloat16 x, 16-byte aligned, with m and k "
        "multiples of 16, no RHT on the rows and the same block shape both "
        "ways (16x16 only without column RHT); quantize and decode instead");
  }
  return LaunchTile</*kRows=*/true, /*kCols=*/true>(stream, x.element_type(),
                                                    args);
}

}  // namespace
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4QuantizeRowsCuda, jax_nvfp4::QuantizeRowsCuda,
    jax_nvfp4::QuantizeBinding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(), "rows"),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4QuantizeColsCuda, jax_nvfp4::QuantizeColsCuda,
    jax_nvfp4::QuantizeBinding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(), "cols"),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4QuantizeRowsColsCuda, jax_nvfp4::QuantizeRowsColsCuda,
    jax_nvfp4::QuantizeRowsColsBinding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
