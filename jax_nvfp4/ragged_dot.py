"""Grouped GEMM (mixture of experts): ``ragged_dot`` with the NVFP4 recipe.

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

Every GEMM sums without scale (alpha = 1) in float32, then multiplies by
alpha_g = (A_a / 2688) * (A_b / 2688) of the row's (or dw's) group in float32
and rounds once to the output dtype: the 2-D GEMM's epilogue. On GPUs that sum
is one grouped launch on the decoded bfloat16 operands (exact products,
float32 accumulation; ``backends/bf16_grouped_gemm.py``); on Blackwell, one native FP4
GEMM per group on the codes (``backends/fp4_grouped_gemm.py``, the groups
moved to multiples of 128 rows after quantization). On the CPU it is the matmul
primitive once per group over all rows (other groups' tokens masked), so that
every sum is the CPU handler's in-order sum and results equal a loop of
``jax_nvfp4.dot`` over the groups bit for bit -- G times the work, which the
CPU, the exact reference, can afford. The pure-JAX implementation adds in the
same order (not with an XLA dot), so it gives the handlers' bits.

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
from jax.sharding import PartitionSpec as P

from jax_nvfp4 import ops, reference
from jax_nvfp4.backends import bf16_grouped_gemm, fp4_grouped_gemm
from jax_nvfp4.format import BLOCK_SIZE, SCALE_RANGE, is_supported_input_dtype
from jax_nvfp4.ops import dispatch, sharding
from jax_nvfp4.quantize import implementation_ops, key_words
from jax_nvfp4.recipe import (
    MISSING_KEY_MESSAGE,
    NVFP4,
    OUTPUT,
    W_RESIDUAL,
    X_RESIDUAL,
    Recipe,
    _refuse_forward_mode,
)

__all__ = ["ragged_dot"]

# Tests set this to run the GPUs' grouped GEMM on the CPU (its pure-JAX
# twin, ragged_dot_general on the decoded operands).
_FORCE_RAGGED_GEMM = False

# How the GEMMs run: once per group with the CPU handler's in-order sums
# (exact reference); as one grouped launch on the decoded operands: the
# CUDA handler, or its twin (backends/bf16_grouped_gemm.py); or, on Blackwell, one
# native FP4 GEMM per group on the codes (backends/fp4_grouped_gemm.py).
PER_GROUP, RAGGED_TWIN, GROUPED_HANDLER = "per_group", "xla_ragged", "bf16_handler"
NATIVE_FP4 = "native_fp4"


def _gemm_form() -> str:
    return dispatch.grouped_path(on_gpu=True if _FORCE_RAGGED_GEMM else None)


def _decoded_gemm(gemm: str) -> bool:
    """Whether the GEMMs read decoded bfloat16 operands (so the fused
    quantize may write them decoded)."""
    return dispatch.grouped_decoded_operands(gemm)


class _Groups(NamedTuple):
    """Where each row goes. ``row_group`` [T]: the row's group, G past the
    sum; ``dest`` [T]: its row in the token buffer (out of range past the
    sum); ``item_group`` [items]: the group of each 16-row block of the
    buffer (G for the unused tail); ``padded_sizes`` [G]: the sizes rounded
    up to 16, the buffer's group sizes."""

    row_group: jax.Array
    dest: jax.Array
    item_group: jax.Array
    padded_sizes: jax.Array
    buffer_rows: int


def _groups(group_sizes, tokens: int) -> _Groups:
    count = group_sizes.shape[0]
    # Every group's padded size is a multiple of 16 and adds at most 15 rows.
    buffer_rows = max(BLOCK_SIZE, (tokens + 15 * count) // 16 * 16)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    padded = (sizes + 15) // 16 * 16
    padded_ends = jnp.cumsum(padded)
    rows = jnp.arange(tokens, dtype=jnp.int32)
    row_group = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    g = jnp.minimum(row_group, count - 1)
    offset = rows - (ends[g] - sizes[g])
    dest = jnp.where(row_group < count, padded_ends[g] - padded[g] + offset, -1)
    dest = jnp.where(dest < 0, buffer_rows, dest)  # dropped by scatters
    blocks = jnp.arange(0, buffer_rows, BLOCK_SIZE, dtype=jnp.int32)
    item_group = jnp.searchsorted(padded_ends, blocks, side="right")
    return _Groups(row_group, dest, item_group.astype(jnp.int32), padded, buffer_rows)


def _to_buffer(a, groups: _Groups):
    """a [T, F] -> [buffer rows, F], each group from a multiple of 16."""
    buffer = jnp.zeros((groups.buffer_rows, a.shape[1]), a.dtype)
    return buffer.at[groups.dest].set(a, mode="drop")


def _from_buffer(buffer, groups: _Groups):
    """The inverse of ``_to_buffer``; rows past the sum get zeros."""
    return buffer.at[groups.dest].get(mode="fill", fill_value=0)


def _group_max(values, ids, count):
    """max of ``values`` by group id (ids >= count dropped); 0 for none."""
    return jnp.zeros(count, jnp.float32).at[ids].max(values, mode="drop")


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


def _quantize_tokens(
    a, groups, recipe, count, *, rows, cols, stochastic, words, ragged, decoded_cols
):
    """a [T, F] (x or dY) in the token buffer, each group with its own amaxes:
    (along F: values [1, buffer rows, F/2 or F], 1x16; along the tokens,
    RHT as the recipe says, stream 1: [items, F, 8 or 16]), None where not
    asked. One fused pass when both. On the ragged path the GEMM-only outputs
    (the rows; the columns if ``decoded_cols``) come decoded where the fused
    kernel writes them."""
    impl = implementation_ops(recipe.implementation)
    features = a.shape[1]
    items = _to_buffer(a, groups).reshape(-1, BLOCK_SIZE, features)
    rht = cols and recipe.rht
    if rht:  # one read: (plain, token-axis RHT) per 16-token block
        both = impl.amax(items, cols=True)
        plain, transformed = both[:, 0], both[:, 1]
    else:
        plain = jax.vmap(reference.abs_max)(items.reshape(items.shape[0], -1))
        transformed = plain
    plain = _group_max(plain, groups.item_group, count)
    transformed = _group_max(transformed, groups.item_group, count) if rht else plain
    row_amax = _per_item(plain, groups.item_group)
    col_amax = _per_item(transformed, groups.item_group)
    row_spec = ops.QuantizeSpec(stochastic=stochastic, stream=0)
    col_spec = ops.QuantizeSpec(stochastic=stochastic, rht=recipe.rht, stream=1)
    along_f = along_t = None
    if rows and cols:
        decoded = (
            ragged
            and recipe.implementation == "ffi"
            and ops.fused_writes_values(a.dtype, row_spec, col_spec)
        )
        if decoded:
            row_spec = dataclasses.replace(row_spec, decoded=True)
            col_spec = dataclasses.replace(col_spec, decoded=decoded_cols)
        rv, rs, cv, cs = impl.quantize_rows_cols(
            items, row_amax, col_amax, words, rows=row_spec, cols=col_spec
        )
        along_f, along_t = (rv, rs), (cv, cs)
    elif rows:
        along_f = impl.quantize_rows(items, row_amax, words, rows=row_spec)
    elif cols:
        along_t = impl.quantize_cols(items, col_amax, words, cols=col_spec)
    if along_f is not None:
        rv, rs = along_f
        along_f = _Operand(
            rv.reshape(1, -1, rv.shape[-1]), rs.reshape(1, -1, rs.shape[-1]), plain
        )
    if along_t is not None:
        along_t = _Operand(*along_t, transformed)
    return along_f, along_t


def _quantize_w(w, recipe):
    """w [G, K, N], one amax per expert: (along K, stored [G, N, K], for FPROP;
    along N, stored [G, K, N], for DGRAD), None where not asked; the same
    values both ways with 16x16 tiles."""
    impl = implementation_ops(recipe.implementation)
    count = w.shape[0]
    amax = jax.vmap(reference.abs_max)(w.reshape(count, -1))
    spec = ops.QuantizeSpec(block_rows=16 if recipe.weight_2d else 1)
    words = jnp.asarray(_NO_KEY)
    along_k = along_n = None
    if recipe.fprop and recipe.dgrad:
        nv, ns, kv, ks = impl.quantize_rows_cols(
            w, amax, amax, words, rows=spec, cols=spec
        )
        along_k, along_n = (kv, ks), (nv, ns)
    elif recipe.fprop:
        along_k = impl.quantize_cols(w, amax, words, cols=spec)
    elif recipe.dgrad:
        along_n = impl.quantize_rows(w, amax, words, rows=spec)
    return (
        None if along_k is None else _Operand(*along_k, amax),
        None if along_n is None else _Operand(*along_n, amax),
    )


def _alpha(a_amax, b_amax):
    """alpha_g = (A_a / 2688) * (A_b / 2688) [G], the GEMM's (IEEE division)."""
    r = jnp.float32(SCALE_RANGE)
    return reference.divide(a_amax, r) * reference.divide(b_amax, r)


# Both amaxes 2688 make the matmul primitive's alpha exactly 1: it returns
# the unscaled float32 sums.
_UNIT_AMAX = np.full((1,), SCALE_RANGE, np.float32)


def _in_order_sums(a, b):
    """sum_k a[m, k] * b[n, k] for float32 a [m, L], b [n, L] (exact
    products), added in order k = 0, 1, ... from +0 in one float32
    accumulator: the CPU handler's sums in pure JAX, where an XLA dot may
    add in another order. One fused pass over the accumulator per 16 k."""
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


def _sums(implementation, a_values, a_scales, b_values, b_scales):
    """Unscaled in-order float32 sums [m, n] of a [1, m, L] and b [1, n, L]
    (stored operands): the CPU handler, or its pure-JAX twin."""
    if implementation == "ffi":
        unit = jnp.asarray(_UNIT_AMAX)
        return ops.matmul(
            a_values, a_scales, unit, b_values, b_scales, unit, dtype=jnp.float32
        )[0]
    a = reference.operand_bf16(a_values, a_scales)[0].astype(jnp.float32)
    b = reference.operand_bf16(b_values, b_scales)[0].astype(jnp.float32)
    return _in_order_sums(a, b)


def _rows_gemm(a: _Operand, b: _Operand, groups, recipe, gemm, out_dtype):
    """Row-grouped: a's buffer rows [1, buffer rows, k] of group g times b[g]
    (stored [G, n, k]) -> [T, n] of ``out_dtype`` in x's row order."""
    count, n = b.values.shape[:2]
    if gemm == NATIVE_FP4:
        # Groups moved to multiples of 128 rows for the native GEMM, and back.
        src, _ = fp4_grouped_gemm.realigned_rows(
            groups.padded_sizes, groups.buffer_rows
        )
        out = fp4_grouped_gemm.rows(
            fp4_grouped_gemm.take(a.values[0], src),
            fp4_grouped_gemm.take(a.scales[0], src),
            a.amax,
            b.values,
            b.scales,
            b.amax,
            fp4_grouped_gemm.aligned_sizes(groups.padded_sizes),
            out_dtype,
        )
        buffer = jnp.zeros((groups.buffer_rows, n), out.dtype)
        return _from_buffer(buffer.at[src].set(out, mode="drop"), groups)
    if gemm != PER_GROUP:
        out = bf16_grouped_gemm.rows(
            reference.operand_bf16(a.values, a.scales)[0],
            reference.operand_bf16(b.values, b.scales),
            groups.padded_sizes,
            _alpha(a.amax, b.amax),
            out_dtype,
            handler=gemm == GROUPED_HANDLER,
        )
        return _from_buffer(out, groups)
    row_group = jnp.repeat(groups.item_group, BLOCK_SIZE)

    def one_group(g, acc):
        sums = _sums(
            recipe.implementation,
            a.values,
            a.scales,
            lax.dynamic_index_in_dim(b.values, g),
            lax.dynamic_index_in_dim(b.scales, g),
        )
        return jnp.where((row_group == g)[:, None], sums, acc)

    # Group 0 outside the loop: the carry then has the operands' variance
    # inside shard_map (a constant zero carry would not).
    acc = one_group(0, jnp.zeros((groups.buffer_rows, n), jnp.float32))
    acc = lax.fori_loop(1, count, one_group, acc)
    alpha = _per_item(_alpha(a.amax, b.amax), groups.row_group)
    return (_from_buffer(acc, groups) * alpha[:, None]).astype(out_dtype)


def _tokens_gemm(a: _Operand, b: _Operand, groups, recipe, gemm, out_dtype):
    """Token-grouped (WGRAD): dw[g] = sum over group g's tokens of a's
    column-wise copy [items, k, 16] times b's [items, n, 16] -> [G, k, n]."""
    count = a.amax.shape[0]
    if gemm == NATIVE_FP4:
        src, _ = fp4_grouped_gemm.realigned_items(
            groups.padded_sizes, a.values.shape[0]
        )
        take = fp4_grouped_gemm.take
        return fp4_grouped_gemm.tokens(
            take(a.values, src),
            take(a.scales, src),
            a.amax,
            take(b.values, src),
            take(b.scales, src),
            b.amax,
            fp4_grouped_gemm.aligned_sizes(groups.padded_sizes),
            out_dtype,
        )
    if gemm != PER_GROUP:
        return bf16_grouped_gemm.tokens(
            reference.operand_bf16(a.values, a.scales),
            reference.operand_bf16(b.values, b.scales),
            groups.padded_sizes,
            _alpha(a.amax, b.amax),
            out_dtype,
            handler=gemm == GROUPED_HANDLER,
        )

    def stored(t):  # [items, F, l] -> [1, F, items * l]: tokens last
        return jnp.swapaxes(t, 0, 1).reshape(1, t.shape[1], -1)

    a_values, a_scales = stored(a.values), stored(a.scales)
    b_values, b_scales = stored(b.values), stored(b.scales)
    code_bytes = a.values.shape[-1]

    def one_group(g):
        # Other groups' blocks become zero codes and scales, in both
        # operands so that their NaN blocks add nothing; zeros leave an
        # in-order sum from +0 unchanged.
        block = groups.item_group == g
        byte = jnp.repeat(block, code_bytes)

        def mask(t, keep):
            return jnp.where(keep, t, jnp.zeros((), t.dtype))

        return _sums(
            recipe.implementation,
            mask(a_values, byte),
            mask(a_scales, block),
            mask(b_values, byte),
            mask(b_scales, block),
        )

    acc = lax.map(one_group, jnp.arange(count, dtype=jnp.int32))
    alpha = _alpha(a.amax, b.amax)
    return (acc * alpha[:, None, None]).astype(out_dtype)


def _plain_rows(a, w, group_sizes, out_dtype=None, *, transpose_w=False):
    """a . w[g] (or w[g]^T) per group in the input dtype (a GEMM kept out of
    NVFP4)."""
    return lax.ragged_dot_general(
        a,
        w,
        group_sizes,
        bf16_grouped_gemm.ragged_numbers(1, 2 if transpose_w else 1, [0]),
        preferred_element_type=out_dtype,
    )


def _named(t, name):
    return jax.tree.map(lambda a: checkpoint_name(a, name), t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ragged(x, w, group_sizes, words, recipe, static):
    out, _ = _ragged_fwd(x, w, group_sizes, words, recipe, static)
    return out


def _ragged_fwd(x, w, group_sizes, words, recipe, static):
    """static: (input dtype, output dtype, the GEMMs' form)."""
    _, out_dtype, gemm = static
    count = w.shape[0]
    groups = _groups(group_sizes, x.shape[0])
    x_rows, x_cols = None, None
    if recipe.fprop or recipe.wgrad:
        x_rows, x_cols = _quantize_tokens(
            x,
            groups,
            recipe,
            count,
            rows=recipe.fprop,
            cols=recipe.wgrad,
            stochastic=False,
            words=jnp.asarray(_NO_KEY),
            ragged=_decoded_gemm(gemm),
            decoded_cols=False,  # x's column-wise copy is the residual
        )
    w_along_k, w_along_n = _quantize_w(w, recipe)
    if recipe.fprop:
        out = _rows_gemm(x_rows, w_along_k, groups, recipe, gemm, out_dtype)
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
    in_dtype, _, gemm = static
    x_saved, w_saved, group_sizes, x_sizes, words = residuals
    count = group_sizes.shape[0]
    groups = _groups(group_sizes, dy.shape[0])
    dy_rows, dy_cols = _quantize_tokens(
        dy,
        groups,
        recipe,
        count,
        rows=recipe.dgrad,
        cols=recipe.wgrad,
        stochastic=recipe.stochastic_rounding,
        words=words,
        ragged=_decoded_gemm(gemm),
        decoded_cols=True,  # dY's column-wise copy feeds WGRAD only
    )
    if recipe.dgrad:
        dx = _rows_gemm(dy_rows, w_saved, groups, recipe, gemm, in_dtype)
    else:
        dx = _plain_rows(
            dy.astype(w_saved.dtype), w_saved, group_sizes, transpose_w=True
        )
    if recipe.wgrad:
        dw = _tokens_gemm(x_saved, dy_cols, groups, recipe, gemm, in_dtype)
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
            bf16_grouped_gemm.ragged_numbers(0, 0, []),
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


def _check_operands(x, w, group_sizes, recipe):
    """The operands as arrays, group_sizes int32; clear errors otherwise."""
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"recipe must be a jax_nvfp4.Recipe (e.g. jax_nvfp4.NVFP4), got {recipe!r}"
        )
    x, w = (a if hasattr(a, "dtype") else jnp.asarray(a) for a in (x, w))
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(
            "ragged_dot takes x [T, K] (rows sorted by group) and w [G, K, N]; got "
            f"shapes {x.shape} and {w.shape} (fold x's leading axes into T first)"
        )
    if w.shape[0] == 0:
        raise ValueError("w [G, K, N] has no group (G = 0); pass at least one")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has K={x.shape[1]} features but w is {w.shape} [G, K, N]")
    if x.dtype != w.dtype:
        raise TypeError(
            f"x is {x.dtype} and w is {w.dtype}; cast both to one dtype "
            "(e.g. w.astype(x.dtype))"
        )
    if not is_supported_input_dtype(x.dtype):
        raise TypeError(
            f"x and w are {x.dtype}; ragged_dot takes float32, bfloat16 or float16"
        )
    k, n = w.shape[1:]
    if (recipe.fprop or recipe.dgrad or recipe.wgrad) and (k % 16 or n % 16):
        raise ValueError(
            f"each expert's weight is K={k} by N={n}; NVFP4 GEMMs need K and N "
            "multiples of 16 — pad the experts or keep them in bf16 "
            "(recipe=jax_nvfp4.BF16)"
        )
    if not hasattr(group_sizes, "dtype"):
        group_sizes = np.asarray(group_sizes)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(
            f"group_sizes must be integers (int32), one row count per group; got "
            f"{group_sizes.dtype}"
        )
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"group_sizes must have shape ({w.shape[0]},), one row count per group "
            f"of w {w.shape}; got shape {group_sizes.shape}"
        )
    try:  # concrete sizes can be checked; traced ones cannot
        sizes = np.asarray(group_sizes).astype(np.int64)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        sizes = None
    if sizes is not None:
        # A sum below T is lax.ragged_dot's padding (e.g. a capacity buffer
        # of expert parallelism): the rows past it give zeros.
        if (sizes < 0).any() or sizes.sum() > x.shape[0]:
            raise ValueError(
                f"group_sizes {sizes.tolist()} must be non-negative and sum to at "
                f"most the {x.shape[0]} rows of x: the rows of x are sorted by "
                "group, group g's rows following group g-1's"
            )
    return x, w, jnp.asarray(group_sizes, jnp.int32)


def ragged_dot(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    precision=None,
    preferred_element_type=None,
    group_offset=None,
    *,
    key: jax.Array | None = None,
    recipe: Recipe = NVFP4,
) -> jax.Array:
    """A drop-in for ``jax.lax.ragged_dot`` running the NVFP4 recipe per group
    (mixture-of-experts layers: each expert's GEMM is a linear layer of its
    own, with its own tensor scales).

    Args:
      x: [T, K] rows sorted by group (float32, bfloat16 or float16).
      w: [G, K, N] one weight per group, x's dtype; K and N multiples of 16.
      group_sizes: int [G], the rows of each group, non-negative, summing to
        at most T: rows past their sum give zeros in y and dx and add nothing
        to dw (as in ``lax.ragged_dot``). Concrete sizes are checked; traced
        ones (under ``jit``) cannot be, and negative sizes or a sum past T
        then give unspecified values.
      precision: accepted and ignored (the GEMMs are NVFP4).
      preferred_element_type: the output dtype (default: x's dtype).
      group_offset: not supported (must be None).
      key: PRNG key for stochastic rounding of dY in the backward pass; pass
        a new key each step (required when ``recipe.stochastic_rounding``
        to differentiate; the forward pass runs without one).
      recipe: a ``Recipe``; a GEMM switched off runs as ``lax.ragged_dot``
        in the input dtype, and ``BF16`` is exactly ``lax.ragged_dot``.

    Returns:
      [T, N]; gradients flow to x and w (float32 accumulation).
    """
    if group_offset is not None:
        raise NotImplementedError(
            "ragged_dot's group_offset (a shard of the groups) is not supported; "
            "pass all groups"
        )
    x, w, group_sizes = _check_operands(x, w, group_sizes, recipe)
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    if not (recipe.fprop or recipe.dgrad or recipe.wgrad):
        return lax.ragged_dot(
            x, w, group_sizes, preferred_element_type=preferred_element_type
        )
    _refuse_forward_mode(x, w)
    static = (jnp.dtype(x.dtype), out_dtype, _gemm_form())

    def run(x, w, group_sizes, key):
        if recipe.needs_key and key is None:
            return _forward_only(x, w, group_sizes, recipe, static)
        buffer_rows = x.shape[0] + 15 * w.shape[0]
        words = key_words(key, recipe.needs_key, buffer_rows * max(w.shape[1:]))
        return _ragged(x, w, group_sizes, words, recipe, static)

    out = sharding.on_auto_axes(
        run, (x, w, group_sizes, key), lambda: _output_spec(x, w)
    )
    return checkpoint_name(out, OUTPUT)


def _spec_entry(a, dim: int):
    """The mesh axes that ``a``'s type shards dimension ``dim`` over."""
    spec = getattr(getattr(jax.typeof(a), "sharding", None), "spec", None)
    return spec[dim] if spec is not None and dim < len(spec) else None


def _output_spec(x, w):
    """y [T, N] is sharded as x's rows and w's N, as ``lax.ragged_dot``'s
    result is on Explicit axes (rows only where both use one axis)."""
    rows, n = _spec_entry(x, 0), _spec_entry(w, 2)

    def names(entry):
        return set(entry if isinstance(entry, tuple) else (entry,)) - {None}

    return P(rows, None if names(rows) & names(n) else n)
