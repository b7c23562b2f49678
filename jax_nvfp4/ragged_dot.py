"""Grouped GEMM (mixture of experts): ``ragged_dot`` with the NVFP4 recipe.

y = ragged_dot(x [T, K], w [G, K, N], group_sizes [G]) as
``jax.lax.ragged_dot``: the rows of x are sorted by group, group g's rows
multiply w[g], rows past sum(group_sizes) give zeros. Each expert's GEMM is a
linear layer of its own, with per-group tensor scales (docs/DESIGN.md,
"Expert projections"). This module is the public function: its operand
checks, the key's conversion to words and the result's sharding type; the
recipe's custom VJP over the group-aligned token buffer is
``recipe/grouped.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jax_nvfp4.format import is_supported_input_dtype
from jax_nvfp4.keys import key_words
from jax_nvfp4.ops import sharding, token_buffer
from jax_nvfp4.recipe import NVFP4, OUTPUT, Recipe
from jax_nvfp4.recipe.grouped import grouped_product
from jax_nvfp4.recipe.steps import refuse_forward_mode

__all__ = ["ragged_dot"]


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
    words = None  # no key where the recipe needs one: forward only
    if not recipe.needs_key or key is not None:
        rows = token_buffer.buffer_rows(x.shape[0], w.shape[0])
        words = key_words(key, recipe.needs_key, rows * max(w.shape[1:]))
    return ragged_product(
        x,
        w,
        group_sizes,
        words=words,
        recipe=recipe,
        preferred_element_type=preferred_element_type,
    )


def ragged_product(
    x, w, group_sizes, *, words, recipe: Recipe, preferred_element_type=None
) -> jax.Array:
    """``ragged_dot`` after its key became stochastic-rounding words
    (``quantize.key_words``, [1, 2]; None where the recipe needs a key and
    there is none: forward only): what a layer with its own key source
    calls."""
    x, w, group_sizes = _check_operands(x, w, group_sizes, recipe)
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    if not (recipe.fprop or recipe.dgrad or recipe.wgrad):
        return lax.ragged_dot(
            x, w, group_sizes, preferred_element_type=preferred_element_type
        )
    refuse_forward_mode(x, w)

    def run(x, w, group_sizes, words):
        return grouped_product(
            x, w, group_sizes, words=words, recipe=recipe, out_dtype=out_dtype
        )

    out = sharding.on_auto_axes(
        run, (x, w, group_sizes, words), lambda: _output_spec(x, w)
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
