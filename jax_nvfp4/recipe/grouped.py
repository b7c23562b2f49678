"""The grouped product (mixture of experts): ``ragged_dot``'s custom VJP over
the group-aligned token buffer. ``grouped_product`` is its entry.

y = ragged_dot(x [T, K], w [G, K, N], group_sizes [G]) as
``jax.lax.ragged_dot``: the rows of x are sorted by group, group g's rows
multiply w[g], rows past sum(group_sizes) give zeros. Each expert's GEMM is a
linear layer of its own (docs/DESIGN.md, "Grouped GEMM"), with per-group
tensor scales (amaxes):

  FPROP  y_g   = x_g  . w[g]     x_g 1x16 along K, nearest; w[g] 16x16
  DGRAD  dx_g  = dy_g . w[g]^T   dy_g 1x16 along N, stochastic; w[g] along N
  WGRAD  dw[g] = x_g^T . dy_g    along the group's tokens, RHT, dy stochastic

No kernel of its own: the quantize primitives take one amax per batch item.
x and dy are scattered into a token buffer where every group starts at a
multiple of 16 (T + 15 G rows, zeros elsewhere), viewed as items of one
16-token block each and quantized (both ways in one fused pass) with their
group's amaxes; so token blocks and RHT chunks start at each group's first
row and a group's last block is zero-padded (zeros change neither an amax nor
a sum). w [G, K, N] is G items, one amax each.

The GEMMs are the grouped GEMM primitives (``ops.grouped_matmul``): rows
form for FPROP and DGRAD, tokens form for WGRAD. Each sums in float32, then
multiplies by alpha_g = (A_a / 2688) * (A_b / 2688) of the row's (or dw's)
group and rounds once to the output dtype: the 2-D GEMM's epilogue. Which
GEMM runs is chosen when the computation is lowered (``ops.dispatch``); on
the CPU every sum is the CPU handler's in-order sum, so results equal a loop
of ``jax_nvfp4.dot`` over the groups bit for bit, and so do the twins
(``implementation="reference"``).

Stochastic bits: dY's rows follow the element index in the token buffer
(stream 0), its token-axis copy the items' stored layout [items, N, 16]
(stream 1); so they are not a per-group loop's bits (round-to-nearest results
are).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_nvfp4 import reference
from jax_nvfp4.format import BLOCK_SIZE
from jax_nvfp4.ops import dispatch, token_buffer
from jax_nvfp4.quantize import implementation_ops
from jax_nvfp4.recipe.residuals import W_RESIDUAL, X_RESIDUAL
from jax_nvfp4.recipe.steps import (
    MISSING_KEY_MESSAGE,
    TokenAmaxes,
    quantize_tokens,
    quantize_weights,
    undifferentiated,
)

__all__ = ["grouped_product"]


class _Groups(NamedTuple):
    """The token buffer's groups (``ops.token_buffer``) for T ``tokens``:
    ``sizes`` [G] the rows of each group; ``item_group`` [items]: the group
    of each 16-row block of the buffer (G for the unused tail);
    ``padded_sizes`` [G]: the sizes rounded up to 16, the buffer's group
    sizes."""

    sizes: jax.Array
    item_group: jax.Array
    padded_sizes: jax.Array
    buffer_rows: int
    tokens: int


def _groups(group_sizes, tokens: int) -> _Groups:
    sizes = group_sizes.astype(jnp.int32)
    padded = (sizes + 15) // 16 * 16
    buffer_rows = token_buffer.buffer_rows(tokens, sizes.shape[0])
    blocks = jnp.arange(0, buffer_rows, BLOCK_SIZE, dtype=jnp.int32)
    item_group = jnp.searchsorted(jnp.cumsum(padded), blocks, side="right")
    return _Groups(sizes, item_group.astype(jnp.int32), padded, buffer_rows, tokens)


def _to_buffer(a, groups: _Groups):
    """a [T, F] -> [buffer rows, F], each group from a multiple of 16."""
    return token_buffer.to_buffer(a, groups.sizes)


def _from_buffer(buffer, groups: _Groups):
    """The inverse of ``_to_buffer``; rows past the sum get zeros."""
    return token_buffer.from_buffer(buffer, groups.sizes, tokens=groups.tokens)


def _group_max(values, ids, count):
    """max of ``values`` [items] by group id (ids >= count left out); 0 for
    a group without items. A masked reduction over the items, not a
    scatter: with the items sharded it reduces each shard's part, then
    across the shards."""
    mask = ids[:, None] == jnp.arange(count, dtype=ids.dtype)
    return jnp.max(jnp.where(mask, values[:, None], 0), axis=0, initial=0)


def _per_item(group_values, ids):
    return group_values.at[ids].get(mode="fill", fill_value=0)


class _Operand(NamedTuple):
    """A quantized GEMM operand in the primitives' rank-3 layout: ``values``
    packed codes (uint8) or decoded bfloat16 values, ``scales``, and one
    amax per group [G]."""

    values: jax.Array
    scales: jax.Array
    amax: jax.Array


_NO_KEY = np.zeros((1, 2), np.uint32)


@dataclasses.dataclass(frozen=True)
class _Tokens:
    """The grouped product's token layout (``steps.TokenLayout``): a [T, F]
    scattered into the token buffer, viewed as items of one 16-token block
    each, every item quantized with its group's amaxes."""

    groups: _Groups

    def items(self, a):
        return _to_buffer(a, self.groups).reshape(-1, BLOCK_SIZE, a.shape[1])

    def item_abs_max(self, a, items, impl):
        return jax.vmap(reference.abs_max)(items.reshape(items.shape[0], -1))

    def reduce(self, plain, transformed):
        ids, count = self.groups.item_group, self.groups.sizes.shape[0]
        plain = _group_max(plain, ids, count)
        transformed = _group_max(transformed, ids, count)
        return TokenAmaxes(
            _per_item(plain, ids), _per_item(transformed, ids), plain, transformed
        )

    def placement(self, a):
        return None, None

    def elements(self, a):
        return self.groups.buffer_rows * a.shape[1]

    def operand(self, values, scales, amax, *, along_tokens, spec):
        """Along the tokens: [items, F, 8 or 16] as written; along F: the
        buffer's rows, [1, buffer rows, F/2 or F]."""
        if not along_tokens:
            values = values.reshape(1, -1, values.shape[-1])
            scales = scales.reshape(1, -1, scales.shape[-1])
        return _Operand(values, scales, amax)


def _weights(w, recipe):
    """w [G, K, N], one amax per expert: (along K, stored [G, N, K], for
    FPROP; along N, stored [G, K, N], for DGRAD), None where not asked."""
    along_k, along_n = quantize_weights(w, recipe)
    return (
        None if along_k is None else _Operand(*along_k),
        None if along_n is None else _Operand(*along_n),
    )


def _rows_gemm(a: _Operand, b: _Operand, groups, recipe, out_dtype):
    """Row-grouped: a's buffer rows [1, buffer rows, k] of group g times b[g]
    (stored [G, n, k]) -> [T, n] of ``out_dtype`` in x's row order."""
    impl = implementation_ops(recipe.implementation)
    out = impl.grouped_matmul_rows(
        a.values,
        a.scales,
        a.amax,
        b.values,
        b.scales,
        b.amax,
        groups.padded_sizes,
        dtype=out_dtype,
    )
    return _from_buffer(out, groups)


def _tokens_gemm(a: _Operand, b: _Operand, groups, recipe, out_dtype):
    """Token-grouped (WGRAD): dw[g] = sum over group g's tokens of a's
    column-wise copy [items, k, 16] times b's [items, n, 16] -> [G, k, n]."""
    impl = implementation_ops(recipe.implementation)
    return impl.grouped_matmul_tokens(
        a.values,
        a.scales,
        a.amax,
        b.values,
        b.scales,
        b.amax,
        groups.padded_sizes,
        dtype=out_dtype,
    )


def _ragged_numbers(lhs_contracting: int, rhs_contracting: int, rhs_group):
    """``lax.ragged_dot_general``'s dimension numbers: x's rows ragged, no
    batch axes; ``rhs_group`` [0] for a group axis of the rhs, [] when the
    contraction is the ragged axis."""
    return lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((lhs_contracting,), (rhs_contracting,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=rhs_group,
    )


def _plain_rows(a, w, group_sizes, out_dtype=None, *, transpose_w=False):
    """a . w[g] (or w[g]^T) per group in the input dtype (a GEMM kept out of
    NVFP4)."""
    return lax.ragged_dot_general(
        a,
        w,
        group_sizes,
        _ragged_numbers(1, 2 if transpose_w else 1, [0]),
        preferred_element_type=out_dtype,
    )


def _named(t, name):
    return jax.tree.map(lambda a: checkpoint_name(a, name), t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ragged(x, w, group_sizes, words, recipe, static):
    forward = undifferentiated(recipe, decoded=static[2])
    out, _ = _ragged_fwd(x, w, group_sizes, words, forward, static)
    return out


def _ragged_fwd(x, w, group_sizes, words, recipe, static):
    """static: (input dtype, output dtype, whether the GEMM-only
    quantizations write decoded operands)."""
    _, out_dtype, decoded = static
    groups = _groups(group_sizes, x.shape[0])
    x_rows, x_cols = None, None
    if recipe.fprop or recipe.wgrad:
        x_rows, x_cols = quantize_tokens(
            x,
            recipe,
            _Tokens(groups),
            rows=recipe.fprop,
            cols=recipe.wgrad,
            decoded=decoded,
            decoded_cols=False,  # x's column-wise copy is the residual
        )
    w_along_k, w_along_n = _weights(w, recipe)
    if recipe.fprop:
        out = _rows_gemm(x_rows, w_along_k, groups, recipe, out_dtype)
    else:
        out = _plain_rows(
            x, w, group_sizes, None if out_dtype == x.dtype else out_dtype
        )
    residuals = (
        _named(x_cols, X_RESIDUAL) if recipe.wgrad else x,
        _named(w_along_n, W_RESIDUAL) if recipe.dgrad else w,
        group_sizes,
        # The sizes x's residual was laid out with, kept (or recomputed)
        # exactly when it is: see _ragged_bwd.
        _named(group_sizes, X_RESIDUAL) if recipe.wgrad else group_sizes,
        words,
    )
    return out, residuals


def _ragged_bwd(recipe, static, residuals, dy):
    in_dtype, _, decoded = static
    x_saved, w_saved, group_sizes, x_sizes, words = residuals
    groups = _groups(group_sizes, dy.shape[0])
    dy_rows, dy_cols = quantize_tokens(
        dy,
        recipe,
        _Tokens(groups),
        rows=recipe.dgrad,
        cols=recipe.wgrad,
        stochastic=recipe.stochastic_rounding,
        words=words,
        decoded=decoded,
        decoded_cols=True,  # dY's column-wise copy feeds WGRAD only
    )
    if recipe.dgrad:
        dx = _rows_gemm(dy_rows, w_saved, groups, recipe, in_dtype)
    else:
        dx = _plain_rows(
            dy.astype(w_saved.dtype), w_saved, group_sizes, transpose_w=True
        )
    if recipe.wgrad:
        dw = _tokens_gemm(x_saved, dy_cols, groups, recipe, in_dtype)
        # A remat policy may keep x's residual from the forward pass while
        # the routing, and so dY's row order, is recomputed; if the
        # recomputation routed differently (a token near a tie), x's rows no
        # longer meet their own tokens' dY rows. Different group sizes show
        # it: dw is then NaN, never silently wrong. (Keeping the routing,
        # jax_nvfp4.ROUTING, prevents it.)
        dw = jnp.where(jnp.all(x_sizes == group_sizes), dw, jnp.nan)
    else:
        dw = lax.ragged_dot_general(
            x_saved,
            dy.astype(x_saved.dtype),
            group_sizes,
            _ragged_numbers(0, 0, []),
        )
    return dx.astype(in_dtype), dw.astype(in_dtype), None, None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _forward_only(x, w, group_sizes, recipe, static):
    """The forward pass, which never reads the key (stochastic rounding is
    for dY only); differentiating it raises MISSING_KEY_MESSAGE."""
    no_sr = dataclasses.replace(recipe, stochastic_rounding=False)
    return _ragged(x, w, group_sizes, jnp.asarray(_NO_KEY), no_sr, static)


def _forward_only_fwd(x, w, group_sizes, recipe, static):
    return _forward_only(x, w, group_sizes, recipe, static), None


def _forward_only_bwd(recipe, static, residuals, dy):
    raise ValueError(MISSING_KEY_MESSAGE)


_forward_only.defvjp(_forward_only_fwd, _forward_only_bwd)


def grouped_product(x, w, group_sizes, *, words, recipe, out_dtype):
    """x [T, K] rows sorted by group . w [G, K, N] by the recipe (checked
    operands, at least one GEMM in NVFP4). ``words``: the product's
    stochastic-rounding words; None where the recipe needs a key and there
    is none: the forward pass runs and differentiating it raises."""
    decoded = dispatch.grouped_decoded_operands()
    static = (jnp.dtype(x.dtype), jnp.dtype(out_dtype), decoded)
    if words is None:
        return _forward_only(x, w, group_sizes, recipe, static)
    return _ragged(x, w, group_sizes, words, recipe, static)
