"""Pure-JAX twin of the FFI handlers: the oracle of the tests and the fallback.

Every function here has the signature of the primitive of the same name in
``jax_nvfp4.ops`` and follows ``ffi/numerics/nvfp4.h`` step by step, in
float32, so that the results are bit-identical to the CPU and CUDA handlers.
Inputs use the handlers' rank-3 layout ``[batch, m, k]``.
"""

# ruff: noqa: F401 (the modules' public names are this module's)
# Modules: numerics (the float32 arithmetic, rounding, RHT, Philox), quantize
# (quantize, amax, dequantize, the bf16 decode), gemm (the GEMMs).
from jax_nvfp4.reference.gemm import (
    grouped_matmul_rows,
    grouped_matmul_tokens,
    matmul,
    matmul_dequantize_bf16,
    operand_bf16,
    ragged_w4a16_matmul,
    w4a16_matmul,
)
from jax_nvfp4.reference.numerics import (
    FLT_MAX,
    INV_SCALE_RANGE,
    NON_FINITE_CODE,
    NON_FINITE_SCALE_BYTE,
    ONE_SIXTH,
    RHT_SIGNS,
    abs_max,
    divide,
    e2m1_round_nearest,
    e2m1_round_stochastic,
    e4m3_decode,
    e4m3_encode,
    e4m3_round_satfinite,
    global_scale,
    philox4x32,
    random_bytes,
    random_hadamard16,
    rht_matrix,
)
from jax_nvfp4.reference.quantize import (
    amax,
    decode_bf16,
    dequantize,
    quantize_cols,
    quantize_rows,
    quantize_rows_cols,
)

__all__ = [
    "abs_max",
    "amax",
    "decode_bf16",
    "dequantize",
    "divide",
    "global_scale",
    "grouped_matmul_rows",
    "grouped_matmul_tokens",
    "matmul",
    "matmul_dequantize_bf16",
    "philox4x32",
    "quantize_cols",
    "quantize_rows",
    "quantize_rows_cols",
    "random_bytes",
    "ragged_w4a16_matmul",
    "random_hadamard16",
    "rht_matrix",
    "w4a16_matmul",
]
