"""The token buffer with its groups moved onto coarser boundaries, for the
grouped GEMMs whose kernels need each group to start on a whole tile:
the native Blackwell GEMM (groups at multiples of 128 rows,
``fp4_grouped_gemm``) and the Hopper engine's tokens form (groups at whole
64-token lines, ``bf16_grouped_gemm.token_lines``).

``realigned_rows`` says where each row of the realigned buffer comes from;
``take`` moves the rows (zeros where a row comes from nowhere).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_nvfp4.backends.operands import round_up

__all__ = ["realigned_rows", "take"]


def _starts(sizes: jax.Array) -> jax.Array:
    return jnp.cumsum(sizes) - sizes


def realigned_rows(
    padded_sizes: jax.Array, rows: int, *, granule: int, alignment: int
) -> tuple[jax.Array, int]:
    """Where each row of the realigned buffer comes from.

    ``padded_sizes`` [G]: the groups' rows in a buffer of ``rows`` rows
    (multiples of ``granule``, in order: 16 in ``ragged_dot``'s buffer, 1
    for a shard of it or for items). Returns (src [rows out], rows out): row
    j of a buffer whose groups start at multiples of ``alignment`` holds row
    src[j] of the input buffer, or zeros where src is out of range.
    """
    count = padded_sizes.shape[0]
    out_rows = round_up(rows + (alignment - granule) * count, alignment)
    sizes = padded_sizes.astype(jnp.int32)
    aligned = (sizes + alignment - 1) // alignment * alignment
    j = jnp.arange(out_rows, dtype=jnp.int32)
    group = jnp.searchsorted(jnp.cumsum(aligned), j, side="right")
    g = jnp.minimum(group, count - 1)
    offset = j - _starts(aligned)[g]
    valid = (group < count) & (offset < sizes[g])
    src = jnp.where(valid, _starts(sizes)[g] + offset, rows)
    return src, out_rows


def take(t: jax.Array, src: jax.Array) -> jax.Array:
    """t[src] along the first axis, zeros where src is out of range (the
    move ``realigned_rows`` describes)."""
    return t.at[src].get(mode="fill", fill_value=0)
