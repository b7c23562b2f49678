// The dictionary attributes of the quantize targets, shared by the CPU and
// CUDA handlers: QuantizeOptions (attributes `rows` / `cols`) and GlobalPlace
// (attribute `place`), decoded by XLA from MLIR dictionaries whose members are
// looked up by name (every member must be present, and no other).
#ifndef JAX_NVFP4_FFI_OPTIONS_H_
#define JAX_NVFP4_FFI_OPTIONS_H_

#include <cstdint>

#include "numerics/nvfp4.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {

// How one quantized output is produced.
struct QuantizeOptions {
  int64_t block_rows;  // 1: 1x16 blocks; 16: 16x16 blocks (scale per row)
  bool stochastic;     // stochastic rounding of the elements
  bool rht;            // Random Hadamard Transform along the quantized axis
  int64_t stream;      // stochastic-rounding stream id, 0..255
  // The output holds bfloat16 e2m1(code) * scale [batch, rows, len] in place
  // of the codes (quantize_rows_cols only).
  bool decoded;
};

// Where a call's [batch, m, k] input sits in the whole logical tensor: the
// origin operand (b0, m0, k0) and the whole tensor's m and k. A partitioned
// call quantizes one shard; stochastic-rounding bits depend on an element's
// flat index in the whole quantized tensor, so each shard draws the bits that
// one device quantizing everything would. Unpartitioned: origin 0, global =
// local.
struct GlobalPlace {
  int64_t global_m;
  int64_t global_k;
  // > 0: the batch folds vmap examples of this many matrices each, and every
  // example's index starts at 0 (as a loop over the examples would draw).
  int64_t example_batch;
};

// Dimensions of the [batch, m, k] input of a quantize call.
struct MatrixDims {
  int64_t batch;
  int64_t m;
  int64_t k;
};

// Flat index in the whole quantized tensor [batch, rows, len] of local
// element (b, r, l) of an output quantized along k (rows = m) or, `cols`,
// transposed along m (rows = k). `origin` is (b0, m0, k0).
NVFP4_HD uint64_t GlobalRandomIndex(const int32_t* origin, const GlobalPlace& g,
                                    bool cols, int64_t b, int64_t r,
                                    int64_t l) {
  const int64_t rows = cols ? g.global_k : g.global_m;
  const int64_t len = cols ? g.global_m : g.global_k;
  const int64_t r0 = origin[cols ? 2 : 1];
  const int64_t l0 = origin[cols ? 1 : 2];
  int64_t matrix = origin[0] + b;
  if (g.example_batch > 0) matrix %= g.example_batch;
  return static_cast<uint64_t>((matrix * rows + r0 + r) * len + l0 + l);
}

}  // namespace jax_nvfp4

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::jax_nvfp4::QuantizeOptions,
    ::xla::ffi::StructMember<int64_t>("block_rows"),
    ::xla::ffi::StructMember<bool>("stochastic"),
    ::xla::ffi::StructMember<bool>("rht"),
    ::xla::ffi::StructMember<int64_t>("stream"),
    ::xla::ffi::StructMember<bool>("decoded"));

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::jax_nvfp4::GlobalPlace, ::xla::ffi::StructMember<int64_t>("global_m"),
    ::xla::ffi::StructMember<int64_t>("global_k"),
    ::xla::ffi::StructMember<int64_t>("example_batch"));

#endif  // JAX_NVFP4_FFI_OPTIONS_H_
