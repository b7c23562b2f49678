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

Three kernels serve both forms (``KERNELS``, the ``kernel`` argument):

* ``"engine"``: the Hopper engine, ``jax_nvfp4_grouped_gemm_sm90``
  (ffi/gemm/engine/grouped_gemm.cu: wgmma with TMA-fed shared-memory
  stages, warp-specialized, persistent), on compute capability 9.0 for up
  to ``ENGINE_MAX_GROUPS`` groups and even N (``engine_supported``). Its
  tokens form reads lines of 64 tokens (``token_lines``).
* ``"mma"``: ``jax_nvfp4_grouped_gemm_bf16`` (ffi/gemm/mma/bf16_grouped_gemm.cu,
  mma.sync), on any GPU from compute capability 8.0, even N.
* ``"xla"``: the twin, ``lax.ragged_dot_general`` on the same operands: the
  same exact products, float32 sums in another order. XLA expands it into a
  masked dense GEMM on GPUs (G times the work, and a NaN of one group's
  weight reaches the other groups' rows), so it serves only where neither
  handler applies or they are switched off (``JAX_NVFP4_GROUPED_GEMM=0``).

Both handlers run each form as one launch that reads the group sizes on the
device (no host synchronization; safe in CUDA graphs) and never mix groups
in a tile, so a NaN stays in its group.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_nvfp4.backends import devices, library
from jax_nvfp4.backends.group_alignment import realigned_rows, take

__all__ = [
    "ENGINE_MAX_GROUPS",
    "ENGINE_TARGET",
    "KERNELS",
    "LINE_TOKENS",
    "MIN_CAPABILITY",
    "TARGET",
    "engine_supported",
    "handler_supported",
    "ragged_numbers",
    "rows",
    "token_lines",
    "tokens",
    "tokens_on_lines",
]

TARGET = "jax_nvfp4_grouped_gemm_bf16"
MIN_CAPABILITY = (8, 0)  # bf16 mma.sync (Ampere and later)
ENGINE_TARGET = "jax_nvfp4_grouped_gemm_sm90"
ENGINE_MAX_GROUPS = 64  # the engine's CTAs keep per-group tables on chip
LINE_TOKENS = 64  # the engine's tokens form: 128-byte rows of 64 tokens
KERNELS = ("engine", "mma", "xla")


def handler_supported(target: Any = None) -> bool:
    """Whether the CUDA handler serves the grouped GEMM: compiled in,
    every device of compute capability >= 8.0.
    ``target`` as in ``devices.lowering_devices`` (None: this process's CUDA
    devices; without any, the twin runs)."""
    if TARGET not in library.targets_on("cuda"):
        return False
    lowered_for = devices.lowering_devices(target)
    return bool(lowered_for) and devices.all_capable(lowered_for, MIN_CAPABILITY)


def engine_supported(target: Any = None, *, groups: int, n: int) -> bool:
    """Whether the Hopper engine serves a grouped GEMM of ``groups`` groups
    and N ``n``: compiled in, every device of compute capability 9.0
    exactly, 1 to ``ENGINE_MAX_GROUPS`` groups, N even. ``target`` as in
    ``handler_supported``."""
    if ENGINE_TARGET not in library.targets_on("cuda"):
        return False
    if not (1 <= groups <= ENGINE_MAX_GROUPS and n % 2 == 0):
        return False
    return devices.all_engine_capable(devices.lowering_devices(target))


def token_lines(values: jax.Array, sizes: jax.Array) -> jax.Array:
    """[items, F, 16] (group g's sizes[g] / 16 items, in order) -> [lines, F,
    64]: four items to a 64-token line, each group from a new line, zeros
    past its tokens and past the groups. What the engine's tokens form reads
    (128-byte rows, which its copy engine moves at full rate)."""
    per_line = LINE_TOKENS // 16
    src, slots = realigned_rows(
        sizes.astype(jnp.int32) // 16, values.shape[0], granule=1, alignment=per_line
    )
    lines = take(values, src).reshape(slots // per_line, per_line, *values.shape[1:])
    return jnp.swapaxes(lines, 1, 2).reshape(lines.shape[0], values.shape[1], -1)


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


def _call(target, a, b, sizes, alpha, shape, dtype, *, tokens_form):
    return jax.ffi.ffi_call(
        target,
        jax.ShapeDtypeStruct(shape, dtype),
        vmap_method="sequential",
    )(a, b, sizes, alpha, tokens=tokens_form)


def _checked_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel


def rows(
    a: jax.Array,
    b: jax.Array,
    sizes: jax.Array,
    alpha: jax.Array,
    dtype: Any,
    *,
    kernel: str,
) -> jax.Array:
    """out[r] = alpha[g] * a[r] . b[g]^T for group g's rows, rounded to dtype.

    a bfloat16 [R, L], b bfloat16 [G, N, L], sizes int32 [G] (multiples of 16,
    summing to at most R), alpha float32 [G] -> [R, N], by ``kernel`` (one of
    ``KERNELS``). Rows past the groups are zeros in the twin and not written
    by the handlers: read only the groups' rows.
    """
    if _checked_kernel(kernel) != "xla":
        shape = (a.shape[0], b.shape[1])
        target = ENGINE_TARGET if kernel == "engine" else TARGET
        return _call(target, a, b, sizes, alpha, shape, dtype, tokens_form=False)
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
    kernel: str,
) -> jax.Array:
    """out[g] = alpha[g] * (sum over group g's tokens of a[t]^T b[t]),
    rounded to dtype.

    a bfloat16 [items, M, 16], b bfloat16 [items, N, 16] (16 tokens per item),
    sizes int32 [G] (multiples of 16: group g holds items sizes[g] / 16, in
    order), alpha float32 [G] -> [G, M, N], by ``kernel`` (one of
    ``KERNELS``); empty groups give zeros.
    """
    if _checked_kernel(kernel) == "engine":
        a, b = token_lines(a, sizes), token_lines(b, sizes)
        return tokens_on_lines(a, b, sizes, alpha, dtype)
    if kernel == "mma":
        shape = (sizes.shape[0], a.shape[1], b.shape[1])
        return _call(TARGET, a, b, sizes, alpha, shape, dtype, tokens_form=True)
    acc = lax.ragged_dot_general(
        _token_major(a),
        _token_major(b),
        sizes,
        ragged_numbers(0, 0, []),
        preferred_element_type=jnp.float32,
    )
    return (acc * alpha[:, None, None]).astype(dtype)


def tokens_on_lines(
    a: jax.Array, b: jax.Array, sizes: jax.Array, alpha: jax.Array, dtype: Any
) -> jax.Array:
    """``tokens`` by the engine on operands already in lines
    (``token_lines``): a [lines, M, 64], b [lines, N, 64] -> [G, M, N]."""
    shape = (sizes.shape[0], a.shape[1], b.shape[1])
    return _call(ENGINE_TARGET, a, b, sizes, alpha, shape, dtype, tokens_form=True)
