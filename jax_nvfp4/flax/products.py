"""The products the Flax layers run: ``jax_nvfp4.dot_general`` with a key
from the layer's RNG stream (and its message when there is none), and the
per-layer switch of stacked layers. One module, so that every layer type
calls them through one place."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_nvfp4.dot import product_general
from jax_nvfp4.recipe import Recipe
from jax_nvfp4.recipe.steps import check_recipe as check_recipe
from jax_nvfp4.recipe.steps import recipe_words

DEFAULT_RNG_COLLECTION = "nvfp4"


def missing_key_message(rng_collection: str) -> str:
    return (
        "this NVFP4 layer was differentiated without a key for stochastic "
        f"rounding: it has no {rng_collection!r} RNG stream. In linen pass "
        f"rngs={{{rng_collection!r}: step_key}} to apply (a new key each "
        "step); in NNX build the layer (or call jax_nvfp4.flax.convert) with "
        f"rngs=nnx.Rngs({rng_collection}=seed). Or use a recipe without "
        "stochastic rounding (jax_nvfp4.NVFP4_NO_SR)."
    )


def layer_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision,
    preferred_element_type,
    out_sharding,
    *,
    recipe: Recipe,
    key: jax.Array | None,
    rng_collection: str,
) -> jax.Array:
    """``jax_nvfp4.dot_general``; without a key where the recipe needs one, a
    forward-only product whose gradient says how to give the layer a key."""
    if preferred_element_type is not None:
        preferred_element_type = jnp.dtype(preferred_element_type)
    check_recipe(recipe)
    return product_general(
        lhs,
        rhs,
        dimension_numbers,
        precision,
        preferred_element_type,
        recipe=recipe,
        words=recipe_words(key, recipe),
        out_sharding=out_sharding,
        missing_key_message=missing_key_message(rng_collection),
    )


def switched_dot_general(
    lhs,
    rhs,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
    *,
    recipe: Recipe,
    key: jax.Array | None,
    enabled: jax.Array | None,
    rng_collection: str,
) -> jax.Array:
    """The NVFP4 product, or, where a stacked layer's switch is off, the plain
    one: inside a scan the switch is a traced per-layer bool, so the choice is
    a ``lax.cond`` (one branch runs; gradients follow the branch taken)."""
    if preferred_element_type is not None:
        preferred_element_type = jnp.dtype(preferred_element_type)

    def nvfp4(lhs, rhs):
        return layer_dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            None,
            recipe=recipe,
            key=key,
            rng_collection=rng_collection,
        )

    def plain(lhs, rhs):
        return jax.lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type=preferred_element_type,
        )

    out = (
        nvfp4(lhs, rhs)
        if enabled is None
        else jax.lax.cond(enabled, nvfp4, plain, lhs, rhs)
    )
    if out_sharding is not None:
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out
