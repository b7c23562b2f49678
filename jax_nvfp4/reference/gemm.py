"""The GEMM twins: the dense matmul (in-order sums and the bf16-decode form),
the grouped GEMM's two forms and the W4A16 GEMM, dense and grouped."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_nvfp4.format import BLOCK_SIZE, SCALE_RANGE
from jax_nvfp4.reference.numerics import (
    _F32,
    divide,
)
from jax_nvfp4.reference.quantize import decode_bf16


def _gemm_alpha(a_amax, b_amax):
    """alpha [b or 1, 1, 1] = (amax_a / 2688) * (amax_b / 2688), float32."""
    r = _F32(SCALE_RANGE)
    return (divide(a_amax, r) * divide(b_amax, r)).reshape(-1, 1, 1)


def is_decoded(operand) -> bool:
    """Whether a GEMM operand array (or its aval) holds the bfloat16 values
    e2m1 * block scale that the fused quantize writes for the bf16 GEMMs,
    rather than packed uint8 codes: the GEMM primitives take either form."""
    return getattr(operand, "dtype", None) == jnp.bfloat16


def operand_bf16(codes, scales):
    """A GEMM operand as bfloat16 e2m1 * s_b [b, r, l]: decoded from its
    codes, or ``codes`` itself where it already holds those values."""
    return codes if is_decoded(codes) else decode_bf16(codes, scales)


def matmul(
    a_codes,
    a_scales,
    a_amax,
    b_codes,
    b_scales,
    b_amax,
    *,
    dtype,
):
    """out [b, m, n] = alpha * sum_k a[b, m, k] b[b', n, k] (float32 products).
    An operand's codes may be its bfloat16 values (``operand_bf16``)."""
    a = operand_bf16(a_codes, a_scales).astype(jnp.float32)
    b = operand_bf16(b_codes, b_scales).astype(jnp.float32)
    b = jnp.broadcast_to(b, (a.shape[0], *b.shape[1:]))
    acc = jnp.einsum("bmk,bnk->bmn", a, b, precision=lax.Precision.HIGHEST)
    return (acc * _gemm_alpha(a_amax, b_amax)).astype(dtype)


def matmul_dequantize_bf16(
    a_codes,
    a_scales,
    a_amax,
    b_codes,
    b_scales,
    b_amax,
    *,
    dtype,
):
    """The GPU path without FP4 tensor cores (Hopper): e2m1 * s_b is exact in
    bfloat16, so a bf16 GEMM with float32 accumulation and alpha applied after
    computes the format's exact products."""
    a = operand_bf16(a_codes, a_scales)
    b = operand_bf16(b_codes, b_scales)
    if b.shape[0] == 1 and b_amax.size == 1:
        acc = lax.dot_general(
            a, b[0], (((2,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
    else:
        b = jnp.broadcast_to(b, (a.shape[0], *b.shape[1:]))
        acc = lax.dot_general(
            a, b, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32
        )
    return (acc * _gemm_alpha(a_amax, b_amax)).astype(dtype)


def _group_of(sizes, positions):
    """The group of each position of a buffer whose groups hold ``sizes``
    [G] consecutive positions, in order (G past the groups), int32."""
    ends = jnp.cumsum(sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, positions, side="right").astype(jnp.int32)


def _buffer_start(origin):
    return jnp.int32(0) if origin is None else origin.reshape(-1)[0]


def _in_order_sums(a, b):
    """sum_k a[m, k] * b[n, k] for float32 a [m, L], b [n, L] (exact
    products), added in order k = 0, 1, ... from +0 in one float32
    accumulator: the CPU handler's sums, where an XLA dot may add in another
    order. One fused pass over the accumulator per 16 k."""
    m, length = a.shape
    blocks = (length // BLOCK_SIZE, BLOCK_SIZE)
    a = jnp.moveaxis(a.reshape(m, *blocks), 1, 0)
    b = jnp.moveaxis(b.reshape(b.shape[0], *blocks), 1, 0)

    def add_block(acc, block):
        a16, b16 = block
        for j in range(BLOCK_SIZE):
            acc = acc + a16[:, j, None] * b16[None, :, j]
        return acc, None

    # The first block outside the scan: its accumulator then carries the
    # operands' shard_map variance (a constant zero carry would not).
    acc = add_block(jnp.zeros((m, b.shape[1]), jnp.float32), (a[0], b[0]))[0]
    return lax.scan(add_block, acc, (a[1:], b[1:]))[0]


def grouped_matmul_rows(
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin=None, *, dtype
):
    """The rows form of the grouped GEMM (FPROP, DGRAD): out [R, n], row r of
    a [1, R, L] (codes [1, R, L/2] or values) in group g times b[g] (stored
    [G, n, L]): alpha_g * sum_k in order, alpha_g = (A_a[g] / 2688) *
    (A_b[g] / 2688), one rounding. ``sizes`` [G]: the groups' rows of the
    buffer, in order; ``origin`` [1]: the buffer row of a's first row (a
    shard's). Rows outside every group are zeros."""
    rows = a_codes.shape[1]
    count = sizes.shape[0]
    positions = _buffer_start(origin) + jnp.arange(rows, dtype=jnp.int32)
    row_group = _group_of(sizes, positions)
    a = operand_bf16(a_codes, a_scales)[0].astype(jnp.float32)

    def one_group(g, acc):
        b = operand_bf16(
            lax.dynamic_index_in_dim(b_codes, g), lax.dynamic_index_in_dim(b_scales, g)
        )
        sums = _in_order_sums(a, b[0].astype(jnp.float32))
        return jnp.where((row_group == g)[:, None], sums, acc)

    # Group 0 outside the loop: the carry then has the operands' variance
    # inside shard_map (a constant zero carry would not).
    acc = one_group(0, jnp.zeros((rows, b_codes.shape[1]), jnp.float32))
    acc = lax.fori_loop(1, count, one_group, acc)
    alpha = _gemm_alpha(a_amax, b_amax).reshape(-1)
    row_alpha = alpha.at[row_group].get(mode="fill", fill_value=0)
    return (acc * row_alpha[:, None]).astype(dtype)


def grouped_matmul_tokens(
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin=None, *, dtype
):
    """The tokens form of the grouped GEMM (WGRAD): out [G, m, n] = alpha_g *
    sum over group g's tokens of a^T b, in token order. a [items, m, 16]
    and b [items, n, 16] hold 16 tokens per item along their last axis
    (codes [items, rows, 8], scales [items, rows, 1], or values); ``sizes``
    [G]: the groups' tokens of the buffer (multiples of 16), in order;
    ``origin`` [1]: the buffer item of the first item (a shard's). An empty
    group gives zeros."""
    items = a_codes.shape[0]
    positions = _buffer_start(origin) + jnp.arange(items, dtype=jnp.int32)
    item_group = _group_of(sizes // BLOCK_SIZE, positions)

    def stored(codes, scales):  # [items, F, 16] -> [F, items * 16]: tokens last
        values = operand_bf16(codes, scales).astype(jnp.float32)
        return jnp.swapaxes(values, 0, 1).reshape(values.shape[1], -1)

    a = stored(a_codes, a_scales)
    b = stored(b_codes, b_scales)
    token_group = jnp.repeat(item_group, BLOCK_SIZE)

    def one_group(g):
        # Other groups' tokens become zeros in both operands, so that their
        # NaN blocks add nothing; zeros leave an in-order sum from +0
        # unchanged.
        keep = (token_group == g)[None, :]
        return _in_order_sums(jnp.where(keep, a, 0.0), jnp.where(keep, b, 0.0))

    acc = lax.map(one_group, jnp.arange(sizes.shape[0], dtype=jnp.int32))
    alpha = _gemm_alpha(a_amax, b_amax).reshape(-1)
    return (acc * alpha[:, None, None]).astype(dtype)


def w4a16_matmul(x, codes, scales, amax, *, dtype):
    """The weight-only GEMM of serving (W4A16): x bfloat16 [b, m, k] times a
    weight stored quantized along k (codes uint8 [b', n, k/2], scales
    float8_e4m3fn [b', n, k/16], amax float32 [b'], b' 1 or b) -> [b, m, n]
    of dtype: (amax / 2688) * sum_k x * e2m1(code) * s_b.

    The products are exact (``decode_bf16``) and summed in float32 by XLA's
    dot, in XLA's order, then scaled and rounded once: within the float32
    summation bound of the CUDA handler's sums (and equal to them wherever
    every partial sum is exact), not bit-equal in general."""
    w = decode_bf16(codes, scales)
    alpha = divide(amax.reshape(-1), _F32(SCALE_RANGE))
    batch, m, k = x.shape
    if w.shape[0] == 1:  # one weight: the batch is more rows
        acc = jnp.dot(x.reshape(batch * m, k), w[0].T, preferred_element_type=_F32)
        return (acc * alpha).astype(dtype).reshape(batch, m, -1)
    acc = lax.dot_general(
        x, w, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32
    )
    return (acc * alpha[:, None, None]).astype(dtype)


def ragged_w4a16_matmul(x, codes, scales, amax, group_sizes, *, dtype):
    """The grouped weight-only GEMM of serving (W4A16, ``ragged_dot`` of
    mixture-of-experts layers): x bfloat16 [T, k], its rows in groups of
    ``group_sizes`` int32 [G], group g's rows times weight g (codes uint8
    [G, n, k/2], scales float8_e4m3fn [G, n, k/16], amax float32 [G]) ->
    [T, n] of dtype: (amax[g] / 2688) * sum_k x * e2m1(code) * s. Rows past
    the sizes' sum are zeros.

    The products are exact and summed in float32 by XLA's ``ragged_dot``,
    in its order, then scaled and rounded once, as ``w4a16_matmul``."""
    w = jnp.swapaxes(decode_bf16(codes, scales), 1, 2)  # [G, k, n]
    acc = lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
    alpha = divide(amax.reshape(-1), _F32(SCALE_RANGE))
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)
    row_alpha = alpha.at[_group_of(group_sizes, rows)].get(mode="fill", fill_value=0)
    return (acc * row_alpha[:, None]).astype(dtype)
