// CPU XLA FFI handlers: the exact reference implementation of NVFP4
// quantize, amax and dequantize. Straightforward loops over the arithmetic of
// nvfp4_numerics.h; the CUDA kernels compute the same bytes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "handler_common.h"
#include "nvfp4_numerics.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

// Float32 subnormals flushed to zero, as inputs and results (FTZ and DAZ;
// see nvfp4_numerics.h), for the lifetime of the object; the previous mode
// is restored after. XLA runs its CPU computations in this mode already; the
// handlers set it themselves so that their bytes do not depend on the
// calling thread. x86-64 and AArch64 only (elsewhere the thread's mode,
// XLA's, applies). No compiler promises not to move float arithmetic across
// the mode switch without FENV_ACCESS; the work here reads and writes the
// XLA buffers between the switches, which keeps it in place in practice (and
// the thread's mode is XLA's flushing one anyway).
class ScopedFlushSubnormals {
 public:
  ScopedFlushSubnormals() {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero);
#elif defined(__aarch64__)
    uint64_t fpcr;
    asm volatile("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    asm volatile("msr fpcr, %0" : : "r"(fpcr | kFlushToZeroArm));
#endif
  }
  ~ScopedFlushSubnormals() {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
    _mm_setcsr(static_cast<unsigned int>(saved_));
#elif defined(__aarch64__)
    asm volatile("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  ScopedFlushSubnormals(const ScopedFlushSubnormals&) = delete;
  ScopedFlushSubnormals& operator=(const ScopedFlushSubnormals&) = delete;

 private:
  static constexpr unsigned int kFlushToZero = 1u << 15;      // MXCSR.FTZ
  static constexpr unsigned int kDenormalsAreZero = 1u << 6;  // MXCSR.DAZ
  static constexpr uint64_t kFlushToZeroArm = 1ull << 24;     // FPCR.FZ
  uint64_t saved_ = 0;
};

float LoadAsFloat(const void* data, ffi::DataType type, int64_t i) {
  switch (type) {
    case ffi::DataType::BF16:
      return Bfloat16BitsToFloat(static_cast<const uint16_t*>(data)[i]);
    case ffi::DataType::F16:
      return Float16BitsToFloat(static_cast<const uint16_t*>(data)[i]);
    default:
      return static_cast<const float*>(data)[i];
  }
}

// The [rows, len] float matrix that one output quantizes along len: x[b] for
// a row-wise output, x[b] transposed for a column-wise one; with the Random
// Hadamard Transform applied to each 16-chunk along len when asked.
std::vector<float> OrientedMatrix(const ffi::AnyBuffer& x, int64_t b,
                                  const MatrixDims& d, bool transpose,
                                  bool rht) {
  const int64_t rows = transpose ? d.k : d.m;
  const int64_t len = transpose ? d.m : d.k;
  const void* data = x.untyped_data();
  const int64_t base = b * d.m * d.k;
  std::vector<float> q(rows * len);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t l = 0; l < len; ++l) {
      const int64_t src = transpose ? l * d.k + r : r * d.k + l;
      q[r * len + l] = LoadAsFloat(data, x.element_type(), base + src);
    }
  }
  if (rht) {
    for (int64_t c = 0; c < rows * len; c += kBlock) {
      float y[kBlock];
      RandomHadamard16(&q[c], y);
      std::copy(y, y + kBlock, &q[c]);
    }
  }
  return q;
}

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
  const int64_t tile = options.tile_rows;
  for (int64_t r0 = 0; r0 < rows; r0 += tile) {
    for (int64_t kb = 0; kb < blocks; ++kb) {
      float block_amax = 0.0f;
      for (int64_t r = r0; r < r0 + tile; ++r) {
        for (int i = 0; i < kBlock; ++i) {
          block_amax =
              MaxAbsIgnoringNan(block_amax, q[r * len + kb * kBlock + i]);
        }
      }
      const float scale = BlockScale(block_amax, g);
      const float multiplier = BlockEncodeMultiplier(scale, g);
      const uint8_t scale_byte = E4M3Encode(scale);
      for (int64_t r = r0; r < r0 + tile; ++r) {
        const uint64_t first = index_base + r * index_row_stride + kb * kBlock;
        uint64_t random_lo = 0, random_hi = 0;
        if (options.stochastic) {
          const uint32_t stream = static_cast<uint32_t>(options.stream);
          RandomBytes16(key0, key1, stream, first / kBlock, &random_lo,
                        &random_hi);
        }
        const uint64_t packed =
            EncodeBlock16(&q[r * len + kb * kBlock], multiplier,
                          options.stochastic, random_lo, random_hi);
        for (int byte = 0; byte < 8; ++byte) {
          codes[r * (len / 2) + kb * 8 + byte] =
              static_cast<uint8_t>(packed >> (8 * byte));
        }
        scales[r * blocks + kb] = scale_byte;
      }
    }
  }
}

// Quantizes every batch item of x [batch, m, k] into one output.
ffi::Error QuantizeOutput(const ffi::AnyBuffer& x, bool transpose,
                          const ffi::Buffer<ffi::F32>& amax,
                          const ffi::Buffer<ffi::U32>& key,
                          const ffi::Buffer<ffi::S32>& origin,
                          const GlobalPlace& place,
                          const QuantizeOptions& options,
                          ffi::Result<ffi::Buffer<ffi::U8>>& codes,
                          ffi::Result<ffi::AnyBuffer>& scales) {
  if (!IsSupportedInputType(x.element_type())) {
    return InvalidArgument("input must be float32, bfloat16 or float16");
  }
  MatrixDims d;
  if (!Rank3Dims(x, &d)) return InvalidArgument("expected a rank-3 input");
  const int64_t rows = transpose ? d.k : d.m;
  const int64_t len = transpose ? d.m : d.k;
  if (auto e = CheckQuantizeOperands(d.batch, rows, len, options, amax, key);
      e.failure()) {
    return e;
  }
  if (auto e = CheckOutputSizes(d.batch, rows, len, codes, scales);
      e.failure()) {
    return e;
  }
  if (auto e = CheckPlace(d, origin, place); e.failure()) return e;
  const int32_t* o = origin.typed_data();
  if (o[0] < 0 || o[1] < 0 || o[2] < 0 || o[1] + d.m > place.global_m ||
      o[2] + d.k > place.global_k) {
    return InvalidArgument("origin places the input outside the tensor");
  }
  const int64_t n_amax = amax.element_count();
  const int64_t n_key = key.element_count() / 2;
  uint8_t* code_data = codes->typed_data();
  uint8_t* scale_data = static_cast<uint8_t*>(scales->untyped_data());
  for (int64_t b = 0; b < d.batch; ++b) {
    const std::vector<float> q =
        OrientedMatrix(x, b, d, transpose, options.rht);
    const int64_t a = b / (d.batch / n_amax);
    const int64_t kk = b / (d.batch / n_key);
    QuantizeMatrix(q.data(), rows, len, amax.typed_data()[a],
                   key.typed_data()[2 * kk], key.typed_data()[2 * kk + 1],
                   options, GlobalRandomIndex(o, place, transpose, b, 0, 0),
                   transpose ? place.global_m : place.global_k,
                   code_data + b * rows * (len / 2),
                   scale_data + b * rows * (len / 16));
  }
  return ffi::Error::Success();
}

// quantize rows (kTranspose = false): along k; cols (true): x[b] transposed,
// along m.
template <bool kTranspose>
ffi::Error QuantizeImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax,
                        ffi::Buffer<ffi::U32> key, ffi::Buffer<ffi::S32> origin,
                        ffi::Result<ffi::Buffer<ffi::U8>> codes,
                        ffi::Result<ffi::AnyBuffer> scales, int64_t tile_rows,
                        bool stochastic, bool rht, int64_t stream,
                        int64_t global_m, int64_t global_k,
                        int64_t example_batch) {
  const ScopedFlushSubnormals flush_subnormals;
  const QuantizeOptions options{tile_rows, stochastic, rht, stream};
  return QuantizeOutput(x, kTranspose, amax, key, origin,
                        GlobalPlace{global_m, global_k, example_batch}, options,
                        codes, scales);
}

ffi::Error QuantizeRowsColsImpl(
    ffi::AnyBuffer x, ffi::Buffer<ffi::F32> row_amax,
    ffi::Buffer<ffi::F32> col_amax, ffi::Buffer<ffi::U32> key,
    ffi::Buffer<ffi::S32> origin, ffi::Result<ffi::Buffer<ffi::U8>> row_codes,
    ffi::Result<ffi::AnyBuffer> row_scales,
    ffi::Result<ffi::Buffer<ffi::U8>> col_codes,
    ffi::Result<ffi::AnyBuffer> col_scales, int64_t row_tile_rows,
    bool row_stochastic, bool row_rht, int64_t row_stream,
    int64_t col_tile_rows, bool col_stochastic, bool col_rht,
    int64_t col_stream, int64_t global_m, int64_t global_k,
    int64_t example_batch) {
  const ScopedFlushSubnormals flush_subnormals;
  const GlobalPlace place{global_m, global_k, example_batch};
  const QuantizeOptions rows{row_tile_rows, row_stochastic, row_rht,
                             row_stream};
  const QuantizeOptions cols{col_tile_rows, col_stochastic, col_rht,
                             col_stream};
  if (auto e = QuantizeOutput(x, false, row_amax, key, origin, place, rows,
                              row_codes, row_scales);
      e.failure()) {
    return e;
  }
  return QuantizeOutput(x, true, col_amax, key, origin, place, cols, col_codes,
                        col_scales);
}

// amax[b] = (max |x[b]|, max |bf16(RHT(x[b]))|) with the transform along
// axis `rht_axis` (1: m, 2: k); NaN ignored.
ffi::Error AmaxImpl(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> out,
                    int64_t rht_axis) {
  const ScopedFlushSubnormals flush_subnormals;
  if (!IsSupportedInputType(x.element_type())) {
    return InvalidArgument("input must be float32, bfloat16 or float16");
  }
  MatrixDims d;
  if (!Rank3Dims(x, &d)) return InvalidArgument("expected a rank-3 input");
  if (rht_axis != 1 && rht_axis != 2)
    return InvalidArgument("rht_axis is 1 or 2");
  if ((rht_axis == 1 ? d.m : d.k) % kBlock != 0) {
    return InvalidArgument("the transformed axis must be a multiple of 16");
  }
  if (static_cast<int64_t>(out->element_count()) != 2 * d.batch) {
    return InvalidArgument("output must be [batch, 2]");
  }
  for (int64_t b = 0; b < d.batch; ++b) {
    const std::vector<float> q =
        OrientedMatrix(x, b, d, /*transpose=*/rht_axis == 1, /*rht=*/false);
    float plain = 0.0f, transformed = 0.0f;
    for (size_t c = 0; c < q.size(); c += kBlock) {
      float y[kBlock];
      RandomHadamard16(&q[c], y);
      for (int i = 0; i < kBlock; ++i) {
        plain = MaxAbsIgnoringNan(plain, q[c + i]);
        transformed = MaxAbsIgnoringNan(transformed, y[i]);
      }
    }
    out->typed_data()[2 * b] = plain;
    out->typed_data()[2 * b + 1] = transformed;
  }
  return ffi::Error::Success();
}

// out[flat] = value, rounded to out's type (float32 or bfloat16).
void StoreFloat(ffi::AnyBuffer& out, int64_t flat, float value) {
  if (out.element_type() == ffi::DataType::F32) {
    static_cast<float*>(out.untyped_data())[flat] = value;
  } else {
    static_cast<uint16_t*>(out.untyped_data())[flat] =
        FloatToBfloat16Bits(value);
  }
}

// out[b, r, l] = e2m1(code) * s_b * amax / 2688, as float32 or bfloat16.
ffi::Error DequantizeImpl(ffi::Buffer<ffi::U8> codes, ffi::AnyBuffer scales,
                          ffi::Buffer<ffi::F32> amax,
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
  for (int64_t b = 0; b < batch; ++b) {
    const float a = amax.typed_data()[b / (batch / n_amax)];
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t l = 0; l < len; ++l) {
        const int64_t flat = (b * rows + r) * len + l;
        const float multiplier =
            BlockDecodeMultiplier(E4M3Decode(scale_bytes[flat / kBlock]), a);
        const uint32_t code = (code_bytes[flat / 2] >> (4 * (flat & 1))) & 0xF;
        const float value = E2M1Decode(code) * multiplier;
        StoreFloat(*out, flat, value);
      }
    }
  }
  return ffi::Error::Success();
}

// out[b, m, n] = alpha * sum_k e2m1(a[b, m, k]) s_a * e2m1(b[b', n, k]) s_b,
// alpha = (amax_a / 2688) * (amax_b / 2688). Every product is exact in
// float32 (2 + 4 significant bits per factor); the sum runs over k = 0, 1,
// ..., K - 1 in float32. b has batch 1 (shared) or the batch of a; each
// amax has one value per batch item of its operand, or one in all.
ffi::Error MatmulImpl(ffi::Buffer<ffi::U8> a_codes, ffi::AnyBuffer a_scales,
                      ffi::Buffer<ffi::F32> a_amax,
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
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4QuantizeRowsCpu,
                              jax_nvfp4::QuantizeImpl<false>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // x [b, m, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // amax [n]
                                  .Arg<ffi::Buffer<ffi::U32>>()  // key [n, 2]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // origin [3]
                                  .Ret<ffi::Buffer<ffi::U8>>()   // codes
                                  .Ret<ffi::AnyBuffer>()         // e4m3 scales
                                  .Attr<int64_t>("tile_rows")
                                  .Attr<bool>("stochastic")
                                  .Attr<bool>("rht")
                                  .Attr<int64_t>("stream")
                                  .Attr<int64_t>("global_m")
                                  .Attr<int64_t>("global_k")
                                  .Attr<int64_t>("example_batch"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4QuantizeColsCpu, jax_nvfp4::QuantizeImpl<true>,
    ffi::Ffi::Bind()
        .Arg<ffi::AnyBuffer>()         // x [b, m, k]
        .Arg<ffi::Buffer<ffi::F32>>()  // amax [n]
        .Arg<ffi::Buffer<ffi::U32>>()  // key [n, 2]
        .Arg<ffi::Buffer<ffi::S32>>()  // origin [3]
        .Ret<ffi::Buffer<ffi::U8>>()   // codes [b,k,m/2]
        .Ret<ffi::AnyBuffer>()         // scales [b,k,m/16]
        .Attr<int64_t>("tile_rows")
        .Attr<bool>("stochastic")
        .Attr<bool>("rht")
        .Attr<int64_t>("stream")
        .Attr<int64_t>("global_m")
        .Attr<int64_t>("global_k")
        .Attr<int64_t>("example_batch"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4QuantizeRowsColsCpu,
                              jax_nvfp4::QuantizeRowsColsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // x [b, m, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // row amax
                                  .Arg<ffi::Buffer<ffi::F32>>()  // col amax
                                  .Arg<ffi::Buffer<ffi::U32>>()  // key [n, 2]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // origin [3]
                                  .Ret<ffi::Buffer<ffi::U8>>()   // row codes
                                  .Ret<ffi::AnyBuffer>()         // row scales
                                  .Ret<ffi::Buffer<ffi::U8>>()   // col codes
                                  .Ret<ffi::AnyBuffer>()         // col scales
                                  .Attr<int64_t>("row_tile_rows")
                                  .Attr<bool>("row_stochastic")
                                  .Attr<bool>("row_rht")
                                  .Attr<int64_t>("row_stream")
                                  .Attr<int64_t>("col_tile_rows")
                                  .Attr<bool>("col_stochastic")
                                  .Attr<bool>("col_rht")
                                  .Attr<int64_t>("col_stream")
                                  .Attr<int64_t>("global_m")
                                  .Attr<int64_t>("global_k")
                                  .Attr<int64_t>("example_batch"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4AmaxCpu, jax_nvfp4::AmaxImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // x [b, m, k]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // [b, 2]
                                  .Attr<int64_t>("rht_axis"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4DequantizeCpu, jax_nvfp4::DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes
                                  .Arg<ffi::AnyBuffer>()         // e4m3 scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // amax [n]
                                  .Ret<ffi::AnyBuffer>());       // [b, r, l]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4MatmulCpu, jax_nvfp4::MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // a codes
                                  .Arg<ffi::AnyBuffer>()         // a scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a amax [1|b]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // b codes
                                  .Arg<ffi::AnyBuffer>()         // b scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b amax [1|b]
                                  .Ret<ffi::AnyBuffer>());       // [b, m, n]
