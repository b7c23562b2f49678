// Block-scale layout of cuBLASLt's block-scaled FP4 GEMM on Blackwell
// (CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3): the [rows, k/16] E4M3 scales of
// an operand, padded to multiples of 128 rows and 4 columns, are stored in
// 128x4 tiles of 512 bytes, tiles in row-major order. Inside a tile, row
// r = 32 * i + j (i in 0..3, j in 0..31) and column c go to byte
// j * 16 + i * 4 + c: the four 32-row bands are interleaved.
#ifndef JAX_NVFP4_FFI_NUMERICS_SCALE_LAYOUT_H_
#define JAX_NVFP4_FFI_NUMERICS_SCALE_LAYOUT_H_

#include <cstdint>

#include "numerics/nvfp4.h"

namespace jax_nvfp4 {

NVFP4_HD int64_t RoundUp(int64_t v, int64_t multiple) {
  return (v + multiple - 1) / multiple * multiple;
}

// Byte offset of scale (row, col) in the swizzled layout of a scale matrix
// with `cols` columns (before padding).
NVFP4_HD int64_t SwizzledScaleOffset(int64_t row, int64_t col, int64_t cols) {
  const int64_t col_tiles = RoundUp(cols, 4) / 4;
  const int64_t tile = (row / 128) * col_tiles + col / 4;
  const int64_t r = row % 128;
  return tile * 512 + (r % 32) * 16 + (r / 32) * 4 + col % 4;
}

// Bytes of the padded, swizzled scale matrix.
NVFP4_HD int64_t SwizzledScaleBytes(int64_t rows, int64_t cols) {
  return RoundUp(rows, 128) * RoundUp(cols, 4);
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_NUMERICS_SCALE_LAYOUT_H_
