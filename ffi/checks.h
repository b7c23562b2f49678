// Shape checks shared by the CPU and CUDA FFI handlers. The Python layer
// validates user input first and says what to change; these checks keep a
// malformed custom call from reading or writing out of bounds.
#ifndef JAX_NVFP4_FFI_CHECKS_H_
#define JAX_NVFP4_FFI_CHECKS_H_

#include <cstdint>
#include <string>

#include "numerics/nvfp4.h"
#include "options.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {

namespace ffi = xla::ffi;

inline ffi::Error InvalidArgument(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_nvfp4: " + message);
}

// Reads [batch, m, k]; false if x is not rank 3.
inline bool Rank3Dims(const ffi::AnyBuffer& x, MatrixDims* d) {
  const auto dims = x.dimensions();
  if (dims.size() != 3) return false;
  *d = MatrixDims{dims[0], dims[1], dims[2]};
  return true;
}

inline bool IsSupportedInputType(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 ||
         t == ffi::DataType::F16;
}

// Checks one quantized output: `rows` x `len` per batch item, quantized along
// len, with amax and key arrays whose sizes divide the batch.
inline ffi::Error CheckQuantizeOperands(int64_t batch, int64_t rows,
                                        int64_t len,
                                        const QuantizeOptions& options,
                                        const ffi::Buffer<ffi::F32>& amax,
                                        const ffi::Buffer<ffi::U32>& key) {
  if (len % 16 != 0) {
    return InvalidArgument("quantized axis length must be a multiple of 16");
  }
  if (options.block_rows != 1 && options.block_rows != 16) {
    return InvalidArgument("block_rows must be 1 or 16");
  }
  if (rows % options.block_rows != 0) {
    return InvalidArgument("16x16 blocks need a multiple of 16 rows");
  }
  if (options.stream < 0 || options.stream > 255) {
    return InvalidArgument("stream must be in [0, 255]");
  }
  const int64_t n_amax = amax.element_count();
  if (n_amax < 1 || batch % n_amax != 0) {
    return InvalidArgument("amax size must divide the batch size");
  }
  const int64_t n_key = key.element_count() / 2;
  if (key.element_count() % 2 != 0 || n_key < 1 || batch % n_key != 0) {
    return InvalidArgument("key must be [n, 2] with n dividing the batch size");
  }
  return ffi::Error::Success();
}

// quantize_rows and quantize_cols write codes only.
inline ffi::Error CheckNotDecoded(const QuantizeOptions& options) {
  if (options.decoded) {
    return InvalidArgument(
        "decoded outputs come from quantize_rows_cols only; pass "
        "decoded=False to quantize_rows / quantize_cols");
  }
  return ffi::Error::Success();
}

// The origin operand is int32 [3] and the whole tensor is at least as large
// as this call's input. A global size of 0 means this call's own size: the
// caller quantizes the whole tensor along that axis and may not know the size
// statically (a symbolic dimension under jax.export); it is resolved here.
inline ffi::Error CheckPlace(const MatrixDims& d,
                             const ffi::Buffer<ffi::S32>& origin,
                             GlobalPlace* g) {
  if (origin.element_count() != 3) {
    return InvalidArgument("origin must be int32[3] (batch, m, k offsets)");
  }
  if (g->global_m == 0) g->global_m = d.m;
  if (g->global_k == 0) g->global_k = d.k;
  if (g->global_m < d.m || g->global_k < d.k) {
    return InvalidArgument("global_m/global_k smaller than the input");
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckOutputSizes(int64_t batch, int64_t rows, int64_t len,
                                   ffi::Result<ffi::Buffer<ffi::U8>>& codes,
                                   ffi::Result<ffi::AnyBuffer>& scales) {
  if (static_cast<int64_t>(codes->element_count()) !=
          batch * rows * (len / 2) ||
      static_cast<int64_t>(scales->element_count()) !=
          batch * rows * (len / 16) ||
      scales->element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArgument("output codes/scales have the wrong size or type");
  }
  return ffi::Error::Success();
}

// One side's output of quantize_rows_cols: uint8 codes [batch, rows, len/2],
// or, `decoded`, bfloat16 values [batch, rows, len]; and the scales.
inline ffi::Error CheckDecodableOutput(int64_t batch, int64_t rows, int64_t len,
                                       bool decoded,
                                       ffi::Result<ffi::AnyBuffer>& values,
                                       ffi::Result<ffi::AnyBuffer>& scales) {
  const int64_t n = batch * rows * len;
  if (values->element_type() !=
          (decoded ? ffi::DataType::BF16 : ffi::DataType::U8) ||
      static_cast<int64_t>(values->element_count()) != (decoded ? n : n / 2) ||
      scales->element_type() != ffi::DataType::F8E4M3FN ||
      static_cast<int64_t>(scales->element_count()) != n / kBlock) {
    return InvalidArgument(
        "outputs must be bfloat16 values [b, rows, len] (decoded) or uint8 "
        "codes [b, rows, len/2], and float8_e4m3fn scales [b, rows, len/16]");
  }
  return ffi::Error::Success();
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_CHECKS_H_
