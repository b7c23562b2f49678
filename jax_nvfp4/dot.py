"""Dense projections of any shape: ``dot`` and ``dot_general`` map their
operands onto the 2-D recipe of ``jax_nvfp4.recipe`` (docs/DESIGN.md,
"Dense projections of any shape").

A weight-like rhs (no batch dims) is the recipe's 2-D problem: K = the
contracting dims flattened in rhs's order, N = rhs's free dims flattened,
tokens = lhs's free dims. The weight is read in its stored orientation
([K, N] or [N, K]); products with batch dims run as ``lax.dot_general``.
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp

from jax_nvfp4.format import NVFP4Tensor
from jax_nvfp4.recipe import MISSING_KEY_MESSAGE, NVFP4, Recipe
from jax_nvfp4.recipe.dense import dot2d
from jax_nvfp4.recipe.steps import check_recipe, recipe_words

__all__ = ["dot", "dot_general"]


def dot(
    x: jax.Array,
    w: jax.Array,
    *,
    key: jax.Array | None = None,
    recipe: Recipe = NVFP4,
    preferred_element_type=None,
    axis_name: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """y = x . w with the NVFP4 training recipe in its forward and backward pass.

    Args:
      x: [..., K] activations (bfloat16, float16 or float32).
      w: [K, N] weight, the same dtype as x (cast master weights first). For
        other weight shapes and orientations (e.g. [N, K]) use ``dot_general``.
      key: PRNG key for stochastic rounding of dY in the backward pass; pass a
        new key each step (required when ``recipe.stochastic_rounding``).
      recipe: a ``Recipe``; presets NVFP4, NVFP4_NO_RHT, NVFP4_NO_SR, BF16.
      preferred_element_type: output dtype (default: x's dtype).
      axis_name: inside ``shard_map``, the mesh axis (or axes, major first)
        over which x's tokens (its leading axes, flattened) are sharded, in
        equal shards of a multiple of 16 tokens. The amaxes of x and dY are
        then reduced over those axes and stochastic rounding follows the
        global token index, so every shard quantizes exactly as one device
        would; dw is this shard's partial sum (reduce it, e.g. by gathering
        w with ``all_gather``, whose transpose reduce-scatters). Under plain
        ``jit`` with shardings leave it None: the primitives partition
        themselves.

    Returns:
      [..., N]; gradients flow to x and w (float32 accumulation).
    """
    x, w = _as_array(x, "x", "dot"), _as_array(w, "w", "dot")
    if x.ndim < 1 or w.ndim != 2:
        raise ValueError(
            f"dot takes x [..., K] and w [K, N]; got shapes {x.shape} and {w.shape}"
        )
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"x has K={x.shape[-1]} features but w has {w.shape[0]} rows")
    check_recipe(recipe)
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    out = dot2d(
        x2,
        w,
        False,
        words=recipe_words(key, recipe),
        recipe=recipe,
        preferred_element_type=preferred_element_type,
        axis_name=axis_name,
    )
    return out.reshape(*x.shape[:-1], w.shape[1])


def _as_array(a, name: str, fn: str) -> jax.Array:
    """An operand as an array: array-likes (lists, NumPy arrays, scalars)
    convert as in ``jnp.dot``."""
    if isinstance(a, NVFP4Tensor):
        raise TypeError(
            f"{fn} takes unquantized arrays (it quantizes them itself); {name} is "
            "an NVFP4Tensor: multiply quantized operands with jax_nvfp4.matmul"
        )
    if isinstance(a, jax.Array):
        return a
    try:
        return jnp.asarray(a)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{fn} takes arrays (or array-likes such as nested lists of numbers); "
            f"{name} is a {type(a).__name__}: {e}"
        ) from None


def _dims(dims, ndim: int, what: str) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise TypeError(
            f"{what} must be a sequence of ints (dimension_numbers = "
            "((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)))"
        ) from None
    for d in dims:
        if not -ndim <= d < ndim:
            raise ValueError(f"{what} has dimension {d}, out of range for rank {ndim}")
    dims = tuple(d % ndim for d in dims)
    if len(set(dims)) != len(dims):
        raise ValueError(f"{what} repeats a dimension: {dims}")
    return dims


def _parse_dimension_numbers(dimension_numbers, lhs, rhs):
    """((lhs contracting, rhs contracting), (lhs batch, rhs batch)), each a
    tuple of non-negative ints, checked against the shapes."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
    except (TypeError, ValueError):
        raise ValueError(
            "dimension_numbers must be ((lhs_contracting, rhs_contracting), "
            f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}"
        ) from None
    lc = _dims(lc, lhs.ndim, "lhs_contracting")
    rc = _dims(rc, rhs.ndim, "rhs_contracting")
    lb = _dims(lb, lhs.ndim, "lhs_batch")
    rb = _dims(rb, rhs.ndim, "rhs_batch")
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(
            "lhs and rhs must list as many contracting dims, and as many batch "
            f"dims, as each other; got dimension_numbers={dimension_numbers}"
        )
    if set(lc) & set(lb) or set(rc) & set(rb):
        raise ValueError(
            f"a dimension is both contracting and batch: {dimension_numbers}"
        )
    for what, lhs_dims, rhs_dims in (("contracting", lc, rc), ("batch", lb, rb)):
        for i, j in zip(lhs_dims, rhs_dims, strict=True):
            if lhs.shape[i] != rhs.shape[j]:
                raise ValueError(
                    f"{what} dims differ in size: lhs dim {i} has "
                    f"{lhs.shape[i]}, rhs dim {j} has {rhs.shape[j]}"
                )
    return lc, rc, lb, rb


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    recipe: Recipe = NVFP4,
    key: jax.Array | None = None,
    axis_name: str | tuple[str, ...] | None = None,
    out_sharding=None,
    **kwargs,
) -> jax.Array:
    """A drop-in for ``lax.dot_general`` (Flax's ``dot_general=``,
    ``jnp.einsum(..., _dot_general=...)``) running the NVFP4 recipe.

    A weight-like rhs (no batch dims) maps onto the recipe's 2-D problem:
    K = the contracting dims flattened in rhs's order, N = rhs's free dims
    flattened, tokens = lhs's free dims; K and N must be multiples of 16. The
    weight may be stored either way round: contracting dims first ([K, N],
    Flax) or last ([N, K], Equinox and PyTorch) is read as stored; other
    orders are transposed first. With batch dims (attention's activation x
    activation products) the product runs as ``lax.dot_general`` in the
    input precision: the reference recipe defines no NVFP4 form for them.

    ``precision`` is accepted and ignored (the GEMMs are NVFP4);
    ``preferred_element_type`` sets the output dtype; ``out_sharding`` is
    applied as a sharding constraint. Bind ``recipe``, ``key`` (and
    ``axis_name`` inside shard_map; see ``dot``) with functools.partial.
    Returns lax.dot_general's shape: lhs's free dims, then rhs's.
    """
    if kwargs:
        raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
    check_recipe(recipe)
    return product_general(
        lhs,
        rhs,
        dimension_numbers,
        precision,
        preferred_element_type,
        recipe=recipe,
        words=recipe_words(key, recipe),
        axis_name=axis_name,
        out_sharding=out_sharding,
    )


def product_general(
    lhs,
    rhs,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    recipe: Recipe,
    words: jax.Array | None,
    axis_name=None,
    out_sharding=None,
    missing_key_message: str = MISSING_KEY_MESSAGE,
) -> jax.Array:
    """``dot_general`` after its key became stochastic-rounding words
    (``recipe.steps.recipe_words``): what the layers call with their own
    key source's words and their own message for a missing key."""
    check_recipe(recipe)
    lhs = _as_array(lhs, "lhs", "dot_general")
    rhs = _as_array(rhs, "rhs", "dot_general")
    lc, rc, lb, rb = _parse_dimension_numbers(dimension_numbers, lhs, rhs)
    if lb:
        out = jax.lax.dot_general(
            lhs,
            rhs,
            ((lc, rc), (lb, rb)),
            precision=precision,
            preferred_element_type=preferred_element_type,
        )
    else:
        out = _weight_like(
            lhs,
            rhs,
            lc,
            rc,
            words=words,
            recipe=recipe,
            preferred_element_type=preferred_element_type,
            axis_name=axis_name,
            missing_key_message=missing_key_message,
        )
    if out_sharding is not None:
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out


def _weight_like(lhs, rhs, lc, rc, **options):
    """lax.dot_general(lhs, rhs, ((lc, rc), ((), ()))) by the 2-D recipe."""
    lhs_free = [d for d in range(lhs.ndim) if d not in lc]
    rhs_free = [d for d in range(rhs.ndim) if d not in rc]
    if not rc or not rhs_free:
        raise ValueError(
            "an NVFP4 dot_general needs at least one contracting dim and one "
            f"free dim on rhs; got rhs shape {rhs.shape} with contracting dims "
            f"{rc}. Keep this product in bf16 (recipe=jax_nvfp4.BF16)."
        )
    # K runs over the contracting dims in rhs's order; lhs's follow the pairing.
    order = sorted(range(len(rc)), key=lambda i: rc[i])
    rc_sorted = [rc[i] for i in order]
    lc_paired = [lc[i] for i in order]
    x_perm = lhs_free + lc_paired
    if x_perm != list(range(lhs.ndim)):
        lhs = jnp.transpose(lhs, x_perm)
    k = math.prod(rhs.shape[d] for d in rc_sorted)
    features = tuple(rhs.shape[d] for d in rhs_free)
    n = math.prod(features)
    free_shape = tuple(lhs.shape[: len(lhs_free)])
    x2 = lhs.reshape(math.prod(free_shape), k)
    contracting_first = rc_sorted + rhs_free == list(range(rhs.ndim))
    contracting_last = rhs_free + rc_sorted == list(range(rhs.ndim))
    if contracting_last and not contracting_first:
        w2, nk = rhs.reshape(n, k), True
    else:
        if not contracting_first:
            rhs = jnp.transpose(rhs, rc_sorted + rhs_free)
        w2, nk = rhs.reshape(k, n), False
    out = dot2d(x2, w2, nk, **options)
    return out.reshape(*free_shape, *features)
