"""The steps every NVFP4 product is built from: quantizing the tokens (x, dY)
and the weight, the GEMMs kept in the input dtype, and the checks at the
product's boundary (a missing key, forward-mode differentiation).

The dense and the grouped products quantize with the same two steps and
differ only in how their tokens are laid out for the quantize primitives
(``TokenLayout``): a dense product's tokens are one item [1, T, F] with one
amax; a grouped product's are its token buffer's 16-token items, each with
its group's amaxes. A dense weight is a grouped weight of one expert.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_nvfp4 import ops
from jax_nvfp4.keys import key_words, shard_words
from jax_nvfp4.quantize import implementation_ops
from jax_nvfp4.recipe.presets import Recipe


def pad_tokens(a: jax.Array, tokens: int) -> jax.Array:
    padded = -(-tokens // 16) * 16
    return a if padded == tokens else jnp.pad(a, ((0, padded - tokens), (0, 0)))


def axis_names(axis_name) -> tuple[str, ...]:
    if axis_name is None:
        return ()
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def token_sharding(a2, axis_name):
    """Inside shard_map with tokens sharded over ``axis_name``: where this
    shard's tokens sit, (first token, all tokens); None otherwise."""
    names = axis_names(axis_name)
    if not names:
        return None
    tokens = a2.shape[0]
    if tokens % 16:
        raise ValueError(
            f"with axis_name={axis_name!r} each shard's token count must be a "
            f"multiple of 16 (blocks along the token axis may not span shards); "
            f"this shard has {tokens} tokens"
        )
    index, count = jnp.int32(0), 1
    for name in names:
        size = jax.lax.axis_size(name)
        index = index * size + jax.lax.axis_index(name).astype(jnp.int32)
        count *= size
    return index * tokens, tokens * count


class TokenAmaxes(NamedTuple):
    """The amaxes of a token operand: one per item for the quantize
    primitives (``rows``: plain, for the quantization along the features;
    ``cols``: of the token-axis RHT where the recipe transforms, for the
    quantization along the tokens), and as the quantized operands keep them
    for the GEMMs' alpha (``rows_kept``, ``cols_kept``)."""

    rows: jax.Array
    cols: jax.Array
    rows_kept: jax.Array
    cols_kept: jax.Array


class TokenLayout(Protocol):
    """How a product lays out its tokens a [T, F] (x or dY) for the quantize
    primitives."""

    def items(self, a: jax.Array) -> jax.Array:
        """a as [items, rows, F]; rows a multiple of 16 (zero-padded)."""

    def item_abs_max(self, a, items, impl) -> jax.Array:
        """max |a| over each item's finite values, [items]."""

    def reduce(self, plain, transformed) -> TokenAmaxes:
        """The amaxes from each item's, [items] each: over what shares one
        amax (the whole tensor, across shards; a group's items)."""

    def placement(self, a):
        """(origin, ops.Place) of a shard of a larger tensor, or (None,
        None): stochastic-rounding bits follow the whole tensor's index."""

    def elements(self, a) -> int:
        """Elements of the whole tensor (the stochastic-rounding bound)."""

    def operand(self, values, scales, amax, *, along_tokens: bool, spec):
        """One quantized side as the product's GEMMs take it."""


def quantize_tokens(
    a,
    recipe: Recipe,
    layout: TokenLayout,
    *,
    rows: bool,
    cols: bool,
    stochastic: bool = False,
    words=None,
    decoded: bool = False,
    decoded_cols: bool = False,
):
    """a [T, F] (x or dY) laid out by ``layout``: (along F, 1x16, stream 0;
    along the tokens, the recipe's RHT, stream 1), None where not asked; one
    fused pass when both. ``words``: the product's stochastic-rounding words
    where ``stochastic``. ``decoded``: the dispatcher asks for decoded GEMM
    operands; then the fused pass writes the rows (and the columns if
    ``decoded_cols``) as bfloat16 values where its kernel serves the
    options (``ops.fused_writes_values``)."""
    if not (rows or cols):
        return None, None
    impl = implementation_ops(recipe.implementation)
    items = layout.items(a)
    if cols and recipe.rht:  # one read: (plain, token-axis RHT) per item
        both = impl.amax(items, cols=True)
        plain, transformed = both[:, 0], both[:, 1]
    else:
        plain = transformed = layout.item_abs_max(a, items, impl)
    amax = layout.reduce(plain, transformed)
    row_spec = ops.QuantizeSpec(stochastic=stochastic, stream=0)
    col_spec = ops.QuantizeSpec(stochastic=stochastic, rht=recipe.rht, stream=1)
    words = shard_words(words, stochastic, layout.elements(a))
    origin, place = layout.placement(a)
    along_f = along_t = None
    if rows and cols:
        if (
            decoded
            and recipe.implementation == "ffi"
            and ops.fused_writes_values(a.dtype, row_spec, col_spec)
        ):
            row_spec = dataclasses.replace(row_spec, decoded=True)
            col_spec = dataclasses.replace(col_spec, decoded=decoded_cols)
        rv, rs, cv, cs = impl.quantize_rows_cols(
            items,
            amax.rows,
            amax.cols,
            words,
            origin,
            rows=row_spec,
            cols=col_spec,
            place=place,
        )
        along_f, along_t = (rv, rs), (cv, cs)
    elif rows:
        along_f = impl.quantize_rows(
            items, amax.rows, words, origin, rows=row_spec, place=place
        )
    elif cols:
        along_t = impl.quantize_cols(
            items, amax.cols, words, origin, cols=col_spec, place=place
        )
    if along_f is not None:
        along_f = layout.operand(
            *along_f, amax.rows_kept, along_tokens=False, spec=row_spec
        )
    if along_t is not None:
        along_t = layout.operand(
            *along_t, amax.cols_kept, along_tokens=True, spec=col_spec
        )
    return along_f, along_t


def undifferentiated(recipe, decoded: bool):
    """The recipe of a product that is not differentiated (the same output
    bytes). Where the GEMM reads codes: FPROP's operands alone, x with the
    plain amax (which XLA can compute in the fusion that produces x), no
    transformed amax, no column-wise x, no DGRAD weight. Where it reads
    decoded operands (Hopper): the whole forward pass, whose fused pass
    writes x's decoded rows; counted in the compiled evaluation step, a
    rows-only quantize and a decode pass move more bytes."""
    if decoded:
        return recipe
    # rht only shapes the column-wise copies: off with them (and a recipe
    # left with no NVFP4 GEMM must not name it).
    return dataclasses.replace(
        recipe, dgrad=False, wgrad=False, rht=False, stochastic_rounding=False
    )


def quantize_weights(w3, recipe: Recipe, *, k_last: bool = False):
    """w3 [E, K, N] (or [E, N, K] where ``k_last``), one amax per expert (a
    dense weight is one expert): (along K, for FPROP; along N, for DGRAD),
    each (values, scales, amax [E]) as the quantize primitives write them
    (along the last axis row-wise, along the middle one column-wise,
    stored transposed), None where the recipe keeps that GEMM out of NVFP4.
    With 16x16 tiles both carry the same values."""
    if not (recipe.fprop or recipe.dgrad):
        return None, None
    impl = implementation_ops(recipe.implementation)
    if w3.shape[0] == 1:
        amax = impl.abs_max(w3[0]).reshape(1)
    else:
        amax = jax.vmap(impl.abs_max)(w3)
    spec = ops.QuantizeSpec(block_rows=16 if recipe.weight_2d else 1)
    no_key = jnp.zeros((1, 2), jnp.uint32)
    want_last = recipe.fprop if k_last else recipe.dgrad
    want_middle = recipe.dgrad if k_last else recipe.fprop
    last = middle = None
    if want_last and want_middle:
        lv, ls, mv, ms = impl.quantize_rows_cols(
            w3, amax, amax, no_key, rows=spec, cols=spec
        )
        last, middle = (lv, ls, amax), (mv, ms, amax)
    elif want_last:
        last = (*impl.quantize_rows(w3, amax, no_key, rows=spec), amax)
    elif want_middle:
        middle = (*impl.quantize_cols(w3, amax, no_key, cols=spec), amax)
    return (last, middle) if k_last else (middle, last)


def explicit_sharding(a):
    """a's (mesh, PartitionSpec) if a is sharded over Explicit mesh axes."""
    try:
        sharding = jax.typeof(a).sharding
    except (AttributeError, TypeError):  # older JAX: no sharding in types
        return None
    mesh = getattr(sharding, "mesh", None)
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    if mesh is None or explicit is None:
        return None
    if not any(t == explicit for t in getattr(mesh, "axis_types", ())):
        return None
    return mesh, tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec))


def explicit_specs(x2, w, nk):
    """Shardings of (x2, w, out) under Explicit mesh axes, else None: the
    bf16 fallback GEMMs must name their output sharding there when they
    contract a sharded dimension (JAX's ShardingTypeError otherwise)."""
    xs, ws = explicit_sharding(x2), explicit_sharding(w)
    if xs is None and ws is None:
        return None
    mesh = (xs or ws)[0]
    xspec = xs[1] if xs else (None, None)
    wspec = ws[1] if ws else (None, None)
    out = (xspec[0], wspec[0] if nk else wspec[1])
    return tuple(NamedSharding(mesh, P(*spec)) for spec in (xspec, wspec, out))


def bf16_dot(a, b, out_spec, preferred_element_type=None, *, a_t=False, b_t=False):
    """a . b (a_t: a transposed; b_t: b transposed) for the GEMMs kept in
    high precision; the transposes are the dot's contracting dims, not
    passes over memory."""
    kwargs = {} if out_spec is None else {"out_sharding": out_spec}
    if preferred_element_type is not None:
        kwargs["preferred_element_type"] = preferred_element_type
    dims = (((0 if a_t else 1,), (1 if b_t else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, **kwargs)


def gemm_dtype(dtype):
    """The GEMM's own output type for a result of `dtype`: bfloat16 and
    float32 directly (rounded once from the float32 accumulator, as a cast
    of the float32 result would be), anything else through float32."""
    return dtype if dtype in (jnp.bfloat16, jnp.float32) else jnp.float32


def check_recipe(recipe) -> None:
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"recipe must be a jax_nvfp4.Recipe (e.g. jax_nvfp4.NVFP4), got {recipe!r}"
        )


def recipe_words(key, recipe: Recipe) -> jax.Array | None:
    """The stochastic-rounding words [1, 2] of a product's key: the one place
    a key (typed or raw) becomes words, at the public boundary (plain calls
    and every layer's key source). Zeros when the recipe draws no bits; None
    when it needs a key and there is none (the product then runs forward
    only)."""
    if not recipe.needs_key:
        return key_words(None, False, 0)
    if key is None:
        return None
    return key_words(key, True, 0)


MISSING_KEY_MESSAGE = (
    "this NVFP4 product was differentiated without a key: the recipe rounds "
    "dY stochastically in the backward pass. Pass key=jax.random.key(...) "
    "(a new key each step), or use a recipe without stochastic rounding "
    "(jax_nvfp4.NVFP4_NO_SR)."
)


def refuse_forward_mode(*operands) -> None:
    """Raises a clear TypeError where the recipe is differentiated in forward
    mode (``jax.jvp``, ``jacfwd``): its derivative is defined only as a VJP
    (stochastic rounding and the FP4 backward GEMMs have no JVP). With direct
    linearization (JAX's default) reverse mode runs under a LinearizeTrace,
    so a JVPTrace carrying a tangent for an operand is forward mode; JAX's
    own, less specific error remains where that cannot be told."""
    try:
        from jax._src import core
        from jax._src.interpreters import ad

        if not jax.config.jax_use_direct_linearize:
            return
        trace = core.trace_ctx.trace
        if not isinstance(trace, ad.JVPTrace):
            return
        tangents = [
            a.tangent
            for a in operands
            if isinstance(a, ad.JVPTracer) and a._trace is trace
        ]
    except (ImportError, AttributeError):  # other JAX versions: JAX's error
        return
    if any(not isinstance(t, ad.Zero) for t in tangents):
        raise TypeError(
            "jax_nvfp4's NVFP4 products define their derivative as a VJP (the "
            "recipe's DGRAD and WGRAD GEMMs), not a JVP: forward-mode "
            "differentiation (jax.jvp, jax.jacfwd, jax.hessian) is not "
            "supported. Use jax.grad / jax.vjp / jax.jacrev, or a bf16 model "
            "(recipe=jax_nvfp4.BF16) for forward-mode derivatives."
        )
