"""The primitive layer: one module per primitive family (``quantize``,
``amax``, ``dequantize``, ``decode``, ``matmul``, ``grouped_matmul``,
``w4a16_matmul``, ``ragged_w4a16_matmul``) on the handlers' rank-3 layout
``[batch, m, k]`` (the grouped ones on rows [T, k]), built by
``primitive.define`` with shared ``batching`` and ``sharding`` helpers.
``jax_nvfp4.reference`` has functions of the same names and signatures (the
pure-JAX twins)."""

from jax_nvfp4.ops.amax import abs_max, abs_max_p, amax, amax_p
from jax_nvfp4.ops.decode import decode_bf16, decode_bf16_p
from jax_nvfp4.ops.dequantize import dequantize, dequantize_p
from jax_nvfp4.ops.grouped_matmul import (
    grouped_matmul_rows,
    grouped_matmul_rows_p,
    grouped_matmul_tokens,
    grouped_matmul_tokens_p,
)
from jax_nvfp4.ops.matmul import matmul, matmul_p
from jax_nvfp4.ops.quantize import (
    Place,
    QuantizeSpec,
    fused_writes_values,
    quantize_cols,
    quantize_cols_p,
    quantize_rows,
    quantize_rows_cols,
    quantize_rows_cols_p,
    quantize_rows_p,
)
from jax_nvfp4.ops.ragged_w4a16_matmul import (
    ragged_w4a16_matmul,
    ragged_w4a16_matmul_p,
)
from jax_nvfp4.ops.w4a16_matmul import w4a16_matmul, w4a16_matmul_p

__all__ = [
    "Place",
    "QuantizeSpec",
    "abs_max",
    "abs_max_p",
    "amax",
    "amax_p",
    "decode_bf16",
    "decode_bf16_p",
    "dequantize",
    "dequantize_p",
    "fused_writes_values",
    "grouped_matmul_rows",
    "grouped_matmul_rows_p",
    "grouped_matmul_tokens",
    "grouped_matmul_tokens_p",
    "matmul",
    "matmul_p",
    "quantize_cols",
    "quantize_cols_p",
    "quantize_rows",
    "quantize_rows_cols",
    "quantize_rows_cols_p",
    "quantize_rows_p",
    "ragged_w4a16_matmul",
    "ragged_w4a16_matmul_p",
    "w4a16_matmul",
    "w4a16_matmul_p",
]
