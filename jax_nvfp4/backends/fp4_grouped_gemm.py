"""The native Blackwell (sm_100+) grouped FP4 GEMM of ``ragged_dot``: host-side
logic.

On GPUs with FP4 tensor cores ``ragged_dot``'s GEMMs run on the FP4 codes
through the FFI target ``jax_nvfp4_grouped_gemm_fp4_sm100``
(``ffi/gemm/fp4_grouped_gemm.cu``): one handler that reads the group sizes back to
the host and launches one cuBLASLt block-scaled FP4 GEMM per non-empty group
(``ffi/gemm/fp4_grouped_gemm_plan.h``). Its forms are those of
``backends/bf16_grouped_gemm.py``: rows (FPROP, DGRAD) and tokens (WGRAD).

Each launch takes a slice of the token buffer, so every group must start at
a multiple of 128 rows (tokens), a whole tile of cuBLASLt's block-scale
layout. ``ragged_dot`` quantizes in its usual buffer (groups at multiples of
16, so that every backend draws the same stochastic-rounding bits); the
grouped GEMM primitives' native path (``ops.grouped_matmul``) moves the
codes and scales to a buffer with groups at multiples of 128
(``group_alignment.realigned_rows``, ``realigned_items``), and this module
pads them to the handler's tiles and lays out the scales: the rows form's
as one swizzled matrix (a group's 128-row tiles are its own), the tokens
form's group-major (each group's [rows, tokens / 16] block swizzled on its
own, ``group_major_scales``), since there the groups split the contraction.

The handler's contract per group g: out = alpha_g * sum over the
contraction of e2m1(a) s_a e2m1(b) s_b, float32 accumulation, alpha_g =
(amax_a[g] / 2688) * (amax_b[g] / 2688), one rounding to the output dtype;
groups with no rows give zeros (tokens form), rows past the groups give
zeros (rows form).

This path has not run on Blackwell hardware. Tested on CPU: the
realignment, the layouts, the handler's plan (its launches, offsets and
zeroed ranges, through the extension's ``plan_grouped_fp4_gemm``) and a
NumPy emulation of those launches, run as the primitives' native path
against their twins (tests/backends/test_fp4_grouped_gemm.py), which
``handler_replaced_by`` puts in the handler's place.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from jax_nvfp4.backends import fp4_gemm, library
from jax_nvfp4.backends.group_alignment import realigned_rows
from jax_nvfp4.backends.operands import check_dtype, round_up, workspace_bytes

__all__ = [
    "GROUP_ALIGNMENT",
    "TARGET",
    "aligned_sizes",
    "group_major_scales",
    "realigned_items",
    "rows",
    "rows_operands",
    "supported",
    "tokens",
    "tokens_operands",
]

TARGET = "jax_nvfp4_grouped_gemm_fp4_sm100"
GROUP_ALIGNMENT = 128  # a group's rows: whole tiles of the block-scale layout
_BLOCK = 16


def supported(target: Any = None) -> bool:
    """Whether ``ragged_dot`` can use the native grouped FP4 GEMM: the
    handler is compiled in and the native FP4 GEMM is supported for
    ``target`` (``fp4_gemm.native_fp4_supported``)."""
    if TARGET not in library.targets_on("cuda"):
        return False
    return fp4_gemm.native_fp4_supported(target)


def _starts(sizes: jax.Array) -> jax.Array:
    return jnp.cumsum(sizes) - sizes


def aligned_sizes(padded_sizes: jax.Array) -> jax.Array:
    """The group sizes in the aligned buffer (multiples of GROUP_ALIGNMENT)."""
    sizes = padded_sizes.astype(jnp.int32)
    return (sizes + GROUP_ALIGNMENT - 1) // GROUP_ALIGNMENT * GROUP_ALIGNMENT


def realigned_items(padded_sizes: jax.Array, items: int) -> tuple[jax.Array, int]:
    """``realigned_rows`` for 16-token items: (src item [items out], items
    out)."""
    src, out_rows = realigned_rows(
        padded_sizes, items * _BLOCK, granule=_BLOCK, alignment=GROUP_ALIGNMENT
    )
    return src[::_BLOCK] // _BLOCK, out_rows // _BLOCK


def _bytes(scales: jax.Array) -> jax.Array:
    if scales.dtype == jnp.uint8:
        return scales
    return jax.lax.bitcast_convert_type(scales, jnp.uint8)


def group_major_scales(scales: jax.Array, sizes: jax.Array) -> jax.Array:
    """[rows, tokens / 16] block scales (rows a multiple of 128) -> the flat
    group-major layout of the tokens form (uint8 [rows * tokens / 16]).

    ``sizes`` [G]: the groups' tokens, multiples of 128, in order. Group g's
    columns, a [rows, sizes[g] / 16] matrix, are swizzled on their own
    (``fp4_gemm.swizzle_scales``) and placed at byte start_g * rows / 16;
    columns past the groups are dropped.
    """
    rows, cols = scales.shape
    if rows % GROUP_ALIGNMENT:
        raise ValueError(f"scales must have a multiple of 128 rows, got {rows}")
    sizes = sizes.astype(jnp.int32)
    blocks = sizes // _BLOCK  # each group's columns
    c = jnp.arange(cols, dtype=jnp.int32)
    group = jnp.searchsorted(jnp.cumsum(blocks), c, side="right")
    g = jnp.minimum(group, sizes.shape[0] - 1)
    local = c - _starts(blocks)[g]
    base = _starts(sizes)[g] * (rows // _BLOCK)
    r = jnp.arange(rows, dtype=jnp.int32)[:, None]
    tile = (r // 128) * (blocks[g] // 4)[None, :] + (local // 4)[None, :]
    offset = (
        base[None, :]
        + tile * 512
        + (r % 32) * 16
        + ((r % 128) // 32) * 4
        + (local % 4)[None, :]
    )
    offset = jnp.where((group < sizes.shape[0])[None, :], offset, rows * cols)
    flat = jnp.zeros(rows * cols, jnp.uint8)
    return flat.at[offset.reshape(-1)].set(_bytes(scales).reshape(-1), mode="drop")


def rows_operands(a_codes, a_scales, b_codes, b_scales):
    """The rows form's operands: a_codes uint8 [R, K/2] and a_scales [R,
    K/16] of the aligned buffer (R a multiple of 128), b_codes [G, N, K/2] and
    b_scales [G, N, K/16] -> (a codes [R, Kp/2], a scales [R*Kp/16], b codes
    [G, Np, Kp/2], b scales [G*Np*Kp/16]), Kp = K padded to 64 and Np = N to
    128 with zeros, the scales swizzled."""
    r, half = a_codes.shape
    if r % GROUP_ALIGNMENT:
        raise ValueError(f"the buffer must have a multiple of 128 rows, got {r}")
    k = 2 * half
    n = b_codes.shape[1]
    kp, np_ = round_up(k, fp4_gemm.K_TILE), round_up(n, fp4_gemm.ROW_TILE)
    a = jnp.pad(a_codes, ((0, 0), (0, (kp - k) // 2)))
    b = jnp.pad(b_codes, ((0, 0), (0, np_ - n), (0, (kp - k) // 2)))
    b_sw = jax.vmap(fp4_gemm.swizzle_scales)(b_scales)
    return a, fp4_gemm.swizzle_scales(a_scales), b, b_sw.reshape(-1)


def tokens_operands(a_codes, a_scales, b_codes, b_scales, sizes):
    """The tokens form's operands from the aligned buffer's column-wise
    copies: a_codes uint8 [items, M, 8] and a_scales [items, M, 1] (16 tokens
    per item), b likewise with N; ``sizes`` [G] the groups' tokens
    (multiples of 128) -> (a codes [Mp, R/2], a scales [Mp*R/16], b codes
    [Np, R/2], b scales [Np*R/16]): tokens contiguous, rows padded to 128,
    the scales group-major."""

    def one(codes, scales):
        items, rows = codes.shape[:2]
        padded = round_up(rows, fp4_gemm.ROW_TILE)
        flat = jnp.swapaxes(codes, 0, 1).reshape(rows, items * codes.shape[2])
        flat = jnp.pad(flat, ((0, padded - rows), (0, 0)))
        s = jnp.swapaxes(_bytes(scales), 0, 1).reshape(rows, items)
        s = jnp.pad(s, ((0, padded - rows), (0, 0)))
        return flat, group_major_scales(s, sizes)

    return (*one(a_codes, a_scales), *one(b_codes, b_scales))


def handler_call(operands, sizes, a_amax, b_amax, shape, dtype, *, tokens_form):
    """The FFI call of the handler on the padded operands (``rows_operands``
    or ``tokens_operands``): [shape] of dtype."""
    count = sizes.shape[0]
    out, _ = jax.ffi.ffi_call(
        TARGET,
        (
            jax.ShapeDtypeStruct(shape, dtype),
            jax.ShapeDtypeStruct((workspace_bytes(count),), jnp.uint8),
        ),
        vmap_method="sequential",
    )(
        *operands,
        sizes.astype(jnp.int32),
        jnp.asarray(a_amax, jnp.float32).reshape(-1),
        jnp.asarray(b_amax, jnp.float32).reshape(-1),
        tokens=tokens_form,
    )
    return out


# What ``rows`` and ``tokens`` call for the GEMM: the handler, unless a block
# of ``handler_replaced_by`` says otherwise.
_handler_call: contextvars.ContextVar[Callable[..., jax.Array]] = (
    contextvars.ContextVar("fp4_grouped_gemm_handler_call", default=handler_call)
)


@contextlib.contextmanager
def handler_replaced_by(call: Callable[..., jax.Array]) -> Iterator[None]:
    """Within the block, ``rows`` and ``tokens`` (and so the grouped GEMM
    primitives' native path) trace ``call``, with ``handler_call``'s
    signature, in place of the handler: an emulation of it checks the
    host-side logic where no Blackwell GPU is."""
    token = _handler_call.set(call)
    try:
        yield
    finally:
        _handler_call.reset(token)


def rows(
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, dtype: Any
) -> jax.Array:
    """The rows form on the aligned buffer: out[r] = alpha_g * a[r] . b[g]^T
    for group g's rows r (``sizes`` [G], multiples of 128), zeros past the
    groups: [R, N] of dtype (bfloat16 or float32). Operands as
    ``rows_operands`` takes them; amaxes [G]."""
    dtype = check_dtype(dtype)
    n = b_codes.shape[1]
    operands = rows_operands(a_codes, a_scales, b_codes, b_scales)
    shape = (operands[0].shape[0], operands[2].shape[1])
    call = _handler_call.get()
    out = call(operands, sizes, a_amax, b_amax, shape, dtype, tokens_form=False)
    return out[:, :n]


def tokens(
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, dtype: Any
) -> jax.Array:
    """The tokens form on the aligned buffer's column-wise copies: out[g] =
    alpha_g * sum over group g's tokens of a^T b, [G, M, N] of dtype; an
    empty group's is zeros. Operands as ``tokens_operands`` takes them;
    amaxes [G]."""
    dtype = check_dtype(dtype)
    m, n = a_codes.shape[1], b_codes.shape[1]
    operands = tokens_operands(a_codes, a_scales, b_codes, b_scales, sizes)
    shape = (sizes.shape[0], operands[0].shape[0], operands[2].shape[0])
    call = _handler_call.get()
    out = call(operands, sizes, a_amax, b_amax, shape, dtype, tokens_form=True)
    return out[:, :m, :n]
