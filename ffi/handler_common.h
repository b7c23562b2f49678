// Shape checks and options shared by the CPU and CUDA FFI handlers. The Python
// layer validates user input first and says what to change; these checks keep
// a malformed custom call from reading or writing out of bounds.
#ifndef JAX_NVFP4_FFI_HANDLER_COMMON_H_
#define JAX_NVFP4_FFI_HANDLER_COMMON_H_

#include <cstdint>
#include <string>

#include "nvfp4_numerics.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {

namespace ffi = xla::ffi;

// How one quantized output is produced (the attributes of a quantize call).
struct QuantizeOptions {
  int64_t
      tile_rows;    // 1: 1x16 blocks; 16: 16x16 tiles (scale repeated per row)
  bool stochastic;  // stochastic rounding of the elements
  bool rht;         // Random Hadamard Transform along the quantized axis
  int64_t stream;   // stochastic-rounding stream id, 0..255
};

// Dimensions of the [batch, m, k] input of a quantize call.
struct MatrixDims {
  int64_t batch;
  int64_t m;
  int64_t k;
};

// Where a call's [batch, m, k] input sits in the whole logical tensor: its
// origin (b0, m0, k0) and the whole tensor's m and k. A partitioned call
// quantizes one shard; stochastic-rounding bits depend on an element's flat
// index in the whole quantized tensor, so each shard draws the bits that one
// device quantizing everything would. Unpartitioned: origin 0, global = local.
struct GlobalPlace {
  int64_t global_m;
  int64_t global_k;
  // > 0: the batch folds vmap examples of this many matrices each, and every
  // example's index starts at 0 (as a loop over the examples would draw).
  int64_t example_batch;
};

// Flat index in the whole quantized tensor [batch, rows, len] of local
// element (b, r, l) of an output quantized along k (rows = m) or, transposed,
// along m (rows = k). `origin` is (b0, m0, k0).
NVFP4_HD uint64_t GlobalRandomIndex(const int32_t* origin, const GlobalPlace& g,
                                    bool transposed, int64_t b, int64_t r,
                                    int64_t l) {
  const int64_t rows = transposed ? g.global_k : g.global_m;
  const int64_t len = transposed ? g.global_m : g.global_k;
  const int64_t r0 = origin[transposed ? 2 : 1];
  const int64_t l0 = origin[transposed ? 1 : 2];
  int64_t matrix = origin[0] + b;
  if (g.example_batch > 0) matrix %= g.example_batch;
  return static_cast<uint64_t>((matrix * rows + r0 + r) * len + l0 + l);
}

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
  if (options.tile_rows != 1 && options.tile_rows != 16) {
    return InvalidArgument("tile_rows must be 1 or 16");
  }
  if (rows % options.tile_rows != 0) {
    return InvalidArgument("16x16 tiles need a multiple of 16 rows");
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

// The origin operand is int32 [3] and the whole tensor is at least as large
// as this call's input.
inline ffi::Error CheckPlace(const MatrixDims& d,
                             const ffi::Buffer<ffi::S32>& origin,
                             const GlobalPlace& g) {
  if (origin.element_count() != 3) {
    return InvalidArgument("origin must be int32[3] (batch, m, k offsets)");
  }
  if (g.global_m < d.m || g.global_k < d.k) {
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

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_HANDLER_COMMON_H_
