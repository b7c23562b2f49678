// Which options the fused CUDA quantize kernel (QuantizePrivateTileKernel,
// cuda/quantize_private_tile.cu) serves, and so for which the CUDA handler
// of jax_nvfp4_quantize_rows_cols can write decoded (bfloat16) operands.
// Plain C++: used by the CUDA handler and exported by the Python extension
// (module.cc: fused_quantize_writes_values) in every build, so that Python
// asks for decoded outputs exactly where the kernel writes them.
#ifndef JAX_NVFP4_FFI_CUDA_FUSED_QUANTIZE_RULE_H_
#define JAX_NVFP4_FFI_CUDA_FUSED_QUANTIZE_RULE_H_

#include <cstdint>

namespace jax_nvfp4 {

// A bfloat16 x, no RHT on the rows, the same block shape both ways, and
// 16x16 blocks only without RHT on the columns (one amax per 16x16 block
// both ways needs the same values both ways). The handler also needs m and k
// multiples of 16 and 16-byte aligned buffers, checked at run time.
constexpr bool FusedQuantizeWritesValues(bool bf16_input,
                                         int64_t row_block_rows, bool row_rht,
                                         int64_t col_block_rows, bool col_rht) {
  return bf16_input && !row_rht && row_block_rows == col_block_rows &&
         !(col_block_rows == 16 && col_rht);
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_CUDA_FUSED_QUANTIZE_RULE_H_
