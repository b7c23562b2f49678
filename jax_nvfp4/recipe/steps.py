"""The steps every NVFP4 product is built from: quantizing the tokens (x, dY)
and the weight, the GEMMs kept in the input dtype, and the checks at the
product's boundary (a missing key, forward-mode differentiation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_nvfp4.keys import key_words
from jax_nvfp4.ops import dispatch
from jax_nvfp4.quantize import (
    global_amax,
    implementation_ops,
    quantize,
    quantize_rowwise_and_columnwise,
    quantize_shard,
    quantize_shard_rows_cols,
)
from jax_nvfp4.recipe.presets import Recipe


def write_gemm_operands(recipe: Recipe, a: jax.Array) -> bool:
    """Whether the fused quantizations of x and dY write the outputs that
    only feed a GEMM -- x's rows, both of dY's -- as ``DecodedOperand``s
    instead of NVFP4Tensors (``dispatch.decoded_operands``)."""
    return recipe.implementation == "ffi" and dispatch.decoded_operands(a.dtype)


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


def shard_amaxes(a2, rht, axis_name, implementation):
    """(plain amax, token-axis RHT amax) of the whole token-sharded tensor;
    one read of a2 and one collective."""
    names = axis_names(axis_name)
    if not names:
        return None, None
    if not rht:
        plain = jax.lax.pmax(global_amax(a2), names)
        return plain, plain
    impl = implementation_ops(implementation)
    both = impl.amax(a2.reshape(1, *a2.shape), cols=True)[0]  # (plain, RHT)
    both = jax.lax.pmax(both, names)
    return both[0], both[1]


def quantize_tokens(
    a2,
    recipe: Recipe,
    *,
    rows,
    cols,
    rounding="nearest",
    words=None,
    axis_name=None,
    decoded_cols=False,
):
    """a [T, F] (x or dY): row-wise along F (1x16) if ``rows``; column-wise
    along T if ``cols`` (the recipe's RHT, stream 1), T zero-padded to a
    multiple of 16; one fused pass when both. With both, the rows (and the
    columns if ``decoded_cols``) come as ``DecodedOperand``s where
    ``write_gemm_operands``."""
    impl = recipe.implementation
    place = token_sharding(a2, axis_name)
    row_amax, col_amax = shard_amaxes(a2, recipe.rht and cols, axis_name, impl)
    padded = pad_tokens(a2, a2.shape[0])
    # The amaxes are maxima over the finite |values|, reduced over the
    # shards: never invalid, so quantize need not check them.
    common = dict(words=words, implementation=impl, place=place, amax_trusted=True)
    if rows and cols:
        operands = write_gemm_operands(recipe, a2)
        return quantize_shard_rows_cols(
            padded,
            row_rounding=rounding,
            col_rounding=rounding,
            col_rht=recipe.rht,
            row_amax=row_amax,
            col_amax=col_amax,
            row_decoded=operands,
            col_decoded=operands and decoded_cols,
            **common,
        )
    along_f = (
        quantize_shard(a2, -1, rounding=rounding, amax=row_amax, **common)
        if rows
        else None
    )
    along_t = (
        quantize_shard(
            padded,
            0,
            rht=recipe.rht,
            rounding=rounding,
            amax=col_amax,
            stream=1,
            **common,
        )
        if cols
        else None
    )
    return along_f, along_t


def quantize_w(w, recipe: Recipe, nk: bool):
    """w [K, N] (or, ``nk``, [N, K]): (along K for FPROP, along N for DGRAD),
    the same values if 2D. Either orientation is read as stored: along its
    last axis row-wise, along its first column-wise; the stored results are
    the same bytes for w and w.T."""
    block = "16x16" if recipe.weight_2d else "1x16"
    impl = recipe.implementation
    k_axis, n_axis = (1, 0) if nk else (0, 1)
    if recipe.fprop and recipe.dgrad:
        # (Along K feeds FPROP only, but stays codes: under FSDP-sharded jit
        # the partitioner gathers it, and codes move 4x fewer bytes than a
        # bf16 operand.)
        rows, cols = quantize_rowwise_and_columnwise(
            w, row_block=block, col_block=block, implementation=impl
        )
        return (rows, cols) if nk else (cols, rows)
    along_k = (
        quantize(w, k_axis, block=block, implementation=impl) if recipe.fprop else None
    )
    along_n = (
        quantize(w, n_axis, block=block, implementation=impl) if recipe.dgrad else None
    )
    return along_k, along_n


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
