"""Host-side pieces of the Blackwell (sm_100+) block-scaled FP4 GEMM.

cuBLASLt's VEC16_UE4M3 block scaling wants each operand's [rows, K/16] E4M3
scales padded to multiples of 128 rows and 4 columns and stored in 128x4 tiles
with the four 32-row bands interleaved (``ffi/scale_layout.h`` is the C++
twin). The GEMM handler that uses it is not written yet; nothing here has run
on Blackwell hardware.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["swizzle_scales"]


def swizzle_scales(scales: jax.Array) -> jax.Array:
    """[rows, cols] float8_e4m3fn scales -> the flat swizzled layout (uint8).

    Padding rows/columns are zero. Output length: round_up(rows, 128) *
    round_up(cols, 4).
    """
    if scales.ndim != 2:
        raise ValueError(f"scales must be [rows, K/16], got shape {scales.shape}")
    rows, cols = scales.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    raw = jax.lax.bitcast_convert_type(scales, jnp.uint8)
    raw = jnp.pad(raw, ((0, padded_rows - rows), (0, padded_cols - cols)))
    # [row tile, i (32-row band), j, col tile, c] -> [row tile, col tile, j, i, c]
    tiles = raw.reshape(padded_rows // 128, 4, 32, padded_cols // 4, 4)
    return tiles.transpose(0, 3, 2, 1, 4).reshape(-1)
