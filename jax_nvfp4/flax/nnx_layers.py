"""Flax NNX layers running the NVFP4 recipe: ``NNXDotGeneral`` (the
``dot_general`` of ``nnx.Linear`` / ``nnx.LinearGeneral``), ``NNXEinsumOp``
(``nnx.Einsum``'s ``einsum_op``) and ``NVFP4Enabled``, the per-layer switch
of a stack. Each holds its own RNG stream, whose count is module state."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_nvfp4.flax import products
from jax_nvfp4.flax.products import DEFAULT_RNG_COLLECTION
from jax_nvfp4.recipe import NVFP4, Recipe

__all__ = ["NNXDotGeneral", "NNXEinsumOp", "NVFP4Enabled", "RecipeOp"]


def _fork_stream(
    rngs: nnx.Rngs | nnx.RngStream | jax.Array | int, rng_collection: str
) -> nnx.RngStream:
    """A new stream forked from ``rngs[rng_collection]`` (or seeded by a key)."""
    if isinstance(rngs, nnx.RngStream):
        return rngs.fork()
    if isinstance(rngs, nnx.Rngs):
        try:
            return rngs[rng_collection].fork()
        except KeyError:
            raise ValueError(
                f"rngs has no {rng_collection!r} stream (and no default "
                f"stream); pass nnx.Rngs({rng_collection}=seed, ...)"
            ) from None
    if isinstance(rngs, (int, jax.Array)) and not isinstance(rngs, bool):
        return nnx.RngStream(rngs, tag=rng_collection)
    raise TypeError(
        "rngs must be an nnx.Rngs, an nnx.RngStream, a jax.random.key or an "
        f"int seed (or None for inference only); got {type(rngs).__name__}"
    )


class RecipeOp(nnx.Module):
    """What every NNX op of the recipe holds: the recipe, and its own RNG
    stream forked from ``rngs[rng_collection]`` (None where the recipe needs
    no key, or with ``rngs=None``: forward-only). ``next_key`` draws one key
    per call; the stream's count is module state."""

    def __init__(
        self,
        recipe: Recipe = NVFP4,
        *,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | int | None = None,
        rng_collection: str = DEFAULT_RNG_COLLECTION,
    ):
        products.check_recipe(recipe)
        self.recipe = recipe
        self.rng_collection = rng_collection
        stream = None
        if rngs is not None and recipe.needs_key:
            stream = _fork_stream(rngs, rng_collection)
        # Mark as data so the attribute holds a stream or None either way.
        self.rngs = _as_data(stream)

    def next_key(self) -> jax.Array | None:
        """The next key of the stream (advancing it), or None without one."""
        if self.rngs is None or not self.recipe.needs_key:
            return None
        return self.rngs()


class NNXDotGeneral(RecipeOp):
    """A Flax NNX ``dot_general`` running the NVFP4 training recipe.

    Use it as ``nnx.Linear(k, n, dot_general=NNXDotGeneral(NVFP4,
    rngs=rngs), rngs=rngs)`` or through ``convert``. The module owns an
    ``nnx.RngStream`` forked from ``rngs[rng_collection]``; each call with a
    recipe that uses stochastic rounding takes its next key, and the stream's
    count is module state (advance it under ``nnx.jit``, or carry it through
    ``nnx.split``/``nnx.merge`` under ``jax.jit``; like any NNX RNG state it
    cannot be advanced inside a plain ``jax.jit`` that closes over the
    module). With ``rngs=None`` the layer is forward-only (inference): its
    gradient raises a ``ValueError``.

    Args:
      recipe: the NVFP4 recipe (``jax_nvfp4.NVFP4`` and its variants).
      rngs: ``nnx.Rngs`` (the stream ``rng_collection``, else ``default``),
        an ``nnx.RngStream``, a key or an int seed; None for inference only.
        Not needed (and not kept) for recipes without stochastic rounding.
      rng_collection: the stream name to fork from ``rngs``.
      enabled: None (always NVFP4), or a bool (array) switch: False runs the
        plain ``lax.dot_general``. ``convert`` sets it per layer of a stack
        whose last layers the policy keeps in bf16.
    """

    def __init__(
        self,
        recipe: Recipe = NVFP4,
        *,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | int | None = None,
        rng_collection: str = DEFAULT_RNG_COLLECTION,
        enabled: jax.Array | bool | None = None,
    ):
        super().__init__(recipe, rngs=rngs, rng_collection=rng_collection)
        self.enabled = _as_data(None if enabled is None else NVFP4Enabled(enabled))

    def bind(self) -> functools.partial:
        """``lax.dot_general``'s signature as a pure function for one call: the
        key is drawn (the stream advanced) now, so the function can be handed
        to code that traces it again (``jnp.einsum``'s ``_dot_general``)."""
        enabled = None if self.enabled is None else self.enabled[...]
        return functools.partial(
            products.switched_dot_general,
            recipe=self.recipe,
            key=self.next_key(),
            enabled=enabled,
            rng_collection=self.rng_collection,
        )

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ) -> jax.Array:
        """``lax.dot_general``'s signature; see ``jax_nvfp4.dot_general``."""
        return self.bind()(
            lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding
        )


class NVFP4Enabled(nnx.Variable):
    """The per-layer switch of a stacked layer: True runs the layer's NVFP4
    recipe, False the plain ``lax.dot_general`` (``Policy.stack_recipes``).
    Not a parameter: optimizers built with ``wrt=nnx.Param`` leave it alone."""


class NNXEinsumOp(nnx.Module):
    """``nnx.Einsum``'s ``einsum_op`` running the NVFP4 recipe: ``jnp.einsum``
    with ``_dot_general`` = this layer's ``NNXDotGeneral`` (one key per call).

    Weight-like einsums (no index shared by input, kernel and output) run the
    recipe; an einsum with such batch indices runs in the input precision,
    as ``jax_nvfp4.dot_general`` does.
    """

    def __init__(self, dot_general: NNXDotGeneral):
        self.dot_general = dot_general

    @property
    def recipe(self) -> Recipe:
        return self.dot_general.recipe

    def __call__(self, spec, *operands, precision=None, **kwargs) -> jax.Array:
        return jnp.einsum(
            spec,
            *operands,
            precision=precision,
            _dot_general=self.dot_general.bind(),
            **kwargs,
        )


def _as_data(value: Any) -> Any:
    """``nnx.data(value)`` where Flax has it (>= 0.12), else the value."""
    data = getattr(nnx, "data", None)
    return value if data is None else data(value)
