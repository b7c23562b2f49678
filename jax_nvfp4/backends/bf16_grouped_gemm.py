"""The grouped GEMM of ``ragged_dot`` on GPUs: decoded bfloat16 operands (exact
e2m1 * scale values), float32 accumulation, each group's alpha and one
rounding to the output dtype in the epilogue.

Two forms on the token buffer of ``jax_nvfp4.ragged_dot`` (every group starts at
a multiple of 16 rows; ``sizes`` [G] are the groups' rows there, multiples of
16 in the tokens form), the CUDA paths of the ``ops.grouped_matmul``
primitives:

* ``rows`` (FPROP, DGRAD): out[r] = alpha[g] * a[r] . b[g]^T for the rows r
  of group g; a [R, L], b [G, N, L] -> [R, N].
* ``tokens`` (WGRAD): out[g] = alpha[g] * sum over group g's tokens of
  a[t]^T b[t]; a [items, M, 16] and b [items, N, 16] hold 16 tokens per item
  along their last axis -> [G, M, N].

The CUDA handler ``jax_nvfp4_grouped_gemm_bf16`` (ffi/gemm/mma/bf16_grouped_gemm.cu)
runs each form as one launch that reads the group sizes on the device (no
host synchronization; safe in CUDA graphs) and never mixes groups in a tile,
so a NaN stays in its group. Its twin here is ``lax.ragged_dot_general`` on
the same operands: the same exact products, float32 sums in another order.
XLA expands that one into a masked dense GEMM on GPUs (G times the work, and
a NaN of one group's weight reaches the other groups' rows), so it serves only
where the handler is missing or switched off (``JAX_NVFP4_GROUPED_GEMM=0``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_nvfp4.backends import devices, library

__all__ = [
    "MIN_CAPABILITY",
    "TARGET",
    "handler_supported",
    "ragged_numbers",
    "rows",
    "tokens",
]

TARGET = "jax_nvfp4_grouped_gemm_bf16"
MIN_CAPABILITY = (8, 0)  # bf16 mma.sync (Ampere and later)


def handler_supported(target: Any = None) -> bool:
    """Whether the CUDA handler serves the grouped GEMM: compiled in,
    every device of compute capability >= 8.0.
    ``target`` as in ``devices.lowering_devices`` (None: this process's CUDA
    devices; without any, the twin runs)."""
    if TARGET not in library.targets_on("cuda"):
        return False
    lowered_for = devices.lowering_devices(target)
    return bool(lowered_for) and devices.all_capable(lowered_for, MIN_CAPABILITY)


def ragged_numbers(lhs_contracting: int, rhs_contracting: int, rhs_group: list[int]):
    """``lax.ragged_dot_general``'s dimension numbers: x's rows ragged, no
    batch axes; ``rhs_group`` [0] for a group axis of the rhs, [] when the
    contraction is the ragged axis."""
    return lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((lhs_contracting,), (rhs_contracting,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=rhs_group,
    )


def _token_major(values: jax.Array) -> jax.Array:
    """[items, F, 16] -> [tokens, F]."""
    return jnp.swapaxes(values, 1, 2).reshape(-1, values.shape[1])


def _call(a, b, sizes, alpha, shape, dtype, *, tokens_form):
    return jax.ffi.ffi_call(
        TARGET,
        jax.ShapeDtypeStruct(shape, dtype),
        vmap_method="sequential",
    )(a, b, sizes, alpha, tokens=tokens_form)


def rows(
    a: jax.Array,
    b: jax.Array,
    sizes: jax.Array,
    alpha: jax.Array,
    dtype: Any,
    *,
    handler: bool,
) -> jax.Array:
    """out[r] = alpha[g] * a[r] . b[g]^T for group g's rows, rounded to dtype.

    a bfloat16 [R, L], b bfloat16 [G, N, L], sizes int32 [G] (multiples of 16,
    summing to at most R), alpha float32 [G] -> [R, N]. Rows past the groups
    are zeros in the twin and not written by the handler: read only the
    groups' rows.
    """
    if handler:
        shape = (a.shape[0], b.shape[1])
        return _call(a, b, sizes, alpha, shape, dtype, tokens_form=False)
    acc = lax.ragged_dot_general(
        a, b, sizes, ragged_numbers(1, 2, [0]), preferred_element_type=jnp.float32
    )
    row_group = jnp.searchsorted(
        jnp.cumsum(sizes), jnp.arange(a.shape[0], dtype=sizes.dtype), side="right"
    )
    row_alpha = alpha.at[row_group].get(mode="fill", fill_value=0)
    return (acc * row_alpha[:, None]).astype(dtype)


def tokens(
    a: jax.Array,
    b: jax.Array,
    sizes: jax.Array,
    alpha: jax.Array,
    dtype: Any,
    *,
    handler: bool,
) -> jax.Array:
    """out[g] = alpha[g] * (sum over group g's tokens of a[t]^T b[t]),
    rounded to dtype.

    a bfloat16 [items, M, 16], b bfloat16 [items, N, 16] (16 tokens per item),
    sizes int32 [G] (multiples of 16: group g holds items sizes[g] / 16, in
    order), alpha float32 [G] -> [G, M, N]; empty groups give zeros.
    """
    if handler:
        shape = (sizes.shape[0], a.shape[1], b.shape[1])
        return _call(a, b, sizes, alpha, shape, dtype, tokens_form=True)
    acc = lax.ragged_dot_general(
        _token_major(a),
        _token_major(b),
        sizes,
        ragged_numbers(0, 0, []),
        preferred_element_type=jnp.float32,
    )
    return (acc * alpha[:, None, None]).astype(dtype)
