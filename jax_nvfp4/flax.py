"""Flax integration: NVFP4 dense layers in Flax linen and Flax NNX.

``jax_nvfp4.dot_general`` is the dense-layer drop-in for ``lax.dot_general``;
this module wraps it as a module that draws its stochastic-rounding key from a
Flax RNG stream (default name ``"nvfp4"``), so that a training step is
reproducible from its inputs and each step draws new bits:

- linen: ``LinenDotGeneral``, used as
  ``nn.Dense(features, dot_general_cls=functools.partial(LinenDotGeneral,
  recipe=NVFP4))`` (or ``dot_general=LinenDotGeneral(recipe)``). Each call
  takes ``self.make_rng("nvfp4")``: pass ``rngs={"nvfp4": step_key}`` to
  ``apply`` with a new key each step. Flax folds the module path and a
  per-call counter into it, so every layer and every call gets its own key.
- NNX: ``NNXDotGeneral``, used as ``nnx.Linear(..., dot_general=
  NNXDotGeneral(recipe, rngs=rngs))``. It holds its own ``nnx.RngStream``
  (forked from ``rngs``); each call takes the next key (``fold_in(key,
  count)``) and advances the count, which is module state: it flows through
  ``nnx.jit`` and ``nnx.split``/``nnx.merge`` like any other state, so two
  steps draw different bits and re-running from a saved state reproduces them.
- ``convert(model, policy, rngs)`` sets such a ``dot_general`` on every
  ``nnx.Linear`` of an NNX model that the ``Policy`` puts in NVFP4.

Keys and inference. Only the backward pass uses the key (stochastic rounding
of dY); the forward pass is the same with or without one. So a layer without
its RNG stream — linen ``init`` or ``apply`` without ``rngs={"nvfp4": ...}``,
or an NNX layer built with ``rngs=None`` — still computes the forward pass,
and raises a ``ValueError`` naming the missing stream only if it is
differentiated with a recipe that uses stochastic rounding. Recipes without
stochastic rounding (``NVFP4_NO_SR``) never need a key.

Dtypes: the layers cast inputs, kernel and bias to the layer's ``dtype`` as
usual (``promote_dtype``); keep fp32 master weights (``param_dtype``) and set
``dtype=jnp.bfloat16`` for bf16 compute. K and N must be multiples of 16.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx

from jax_nvfp4 import recipe as _recipe
from jax_nvfp4.policy import Policy, path_string
from jax_nvfp4.recipe import NVFP4, Recipe

__all__ = [
    "DEFAULT_RNG_COLLECTION",
    "LinenDotGeneral",
    "NNXDotGeneral",
    "convert",
    "nvfp4_layers",
]

DEFAULT_RNG_COLLECTION = "nvfp4"


def _missing_key_message(rng_collection: str) -> str:
    return (
        "this NVFP4 layer was differentiated without a key for stochastic "
        f"rounding: it has no {rng_collection!r} RNG stream. In linen pass "
        f"rngs={{{rng_collection!r}: step_key}} to apply (a new key each "
        "step); in NNX build the layer (or call jax_nvfp4.flax.convert) with "
        f"rngs=nnx.Rngs({rng_collection}=seed). Or use a recipe without "
        "stochastic rounding (jax_nvfp4.NVFP4_NO_SR)."
    )


def _dot_general(
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
    return _recipe.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision,
        preferred_element_type,
        recipe=recipe,
        key=key,
        out_sharding=out_sharding,
        _missing_key_message=_missing_key_message(rng_collection),
    )


def _check_recipe(recipe: Any) -> None:
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"recipe must be a jax_nvfp4.Recipe (e.g. jax_nvfp4.NVFP4), got {recipe!r}"
        )


class LinenDotGeneral(linen.Module):
    """A Flax linen ``dot_general`` running the NVFP4 training recipe.

    Use it in ``nn.Dense``, or in ``nn.DenseGeneral`` without ``batch_dims``
    (several contracted axes fold into one K and several feature axes into one
    N; both must be multiples of 16)::

        dense = nn.Dense(
            1024,
            dtype=jnp.bfloat16,
            dot_general_cls=functools.partial(LinenDotGeneral, recipe=NVFP4),
        )
        y = model.apply(variables, x, rngs={"nvfp4": step_key})

    Each call draws ``self.make_rng(rng_collection)`` when the recipe uses
    stochastic rounding. Without that stream (``init``, or ``apply`` for
    inference) the forward pass still runs; differentiating it raises a
    ``ValueError``. The stream is never replaced by the ``"params"`` stream
    (which would repeat the same bits every step).

    Attributes:
      recipe: the NVFP4 recipe (``jax_nvfp4.NVFP4`` and its variants).
      rng_collection: the name of the RNG stream that supplies the keys.
    """

    recipe: Recipe = NVFP4
    rng_collection: str = DEFAULT_RNG_COLLECTION

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
        _check_recipe(self.recipe)
        key = None
        if self.recipe.needs_key and self.has_rng(self.rng_collection):
            key = self.make_rng(self.rng_collection)
        return _dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            out_sharding,
            recipe=self.recipe,
            key=key,
            rng_collection=self.rng_collection,
        )


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


class NNXDotGeneral(nnx.Module):
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
    """

    def __init__(
        self,
        recipe: Recipe = NVFP4,
        *,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | int | None = None,
        rng_collection: str = DEFAULT_RNG_COLLECTION,
    ):
        _check_recipe(recipe)
        self.recipe = recipe
        self.rng_collection = rng_collection
        stream = None
        if rngs is not None and recipe.needs_key:
            stream = _fork_stream(rngs, rng_collection)
        # Mark as data so the attribute holds a stream or None either way.
        self.rngs = _as_data(stream)

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
        key = None
        if self.rngs is not None and self.recipe.needs_key:
            key = self.rngs()
        return _dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            out_sharding,
            recipe=self.recipe,
            key=key,
            rng_collection=self.rng_collection,
        )


def _as_data(value: Any) -> Any:
    """``nnx.data(value)`` where Flax has it (>= 0.12), else the value."""
    data = getattr(nnx, "data", None)
    return value if data is None else data(value)


def _iter_graph(node: Any):
    iter_graph = getattr(nnx, "iter_graph", None) or nnx.graph.iter_graph
    return iter_graph(node)


def convert(
    model: nnx.Module,
    policy: Policy,
    rngs: nnx.Rngs | nnx.RngStream | jax.Array | int | None = None,
    *,
    rng_collection: str = DEFAULT_RNG_COLLECTION,
    strict: bool = True,
) -> nnx.Module:
    """Puts the ``nnx.Linear`` layers that ``policy`` selects in NVFP4, in place.

    For each ``nnx.Linear`` reached from ``model`` (``nnx.iter_graph`` order,
    a shared layer once), ``path`` is its normalised path
    (``policy.path_string``, e.g. ``"layers.3.mlp.up_proj"``) and
    ``policy.recipe_for(path)`` decides:

    - ``None``: the layer is left untouched (bit-identical to the original).
    - a ``Recipe``: the layer's ``dot_general`` becomes
      ``NNXDotGeneral(recipe, rngs=...)`` with its own RNG stream forked from
      ``rngs[rng_collection]`` (so keys do not depend on call order). A layer
      converted before gets the new recipe and a new stream.

    A selected layer whose ``in_features`` or ``out_features`` is not a
    multiple of 16 (NVFP4's block size) raises a ``ValueError`` naming every
    such layer, before any layer is changed, like ``jax_nvfp4.equinox.convert``:
    exclude them with rules ``(path, None)``, or pass ``strict=False`` to
    leave them in bf16 with a ``UserWarning``. A selected layer that already
    has another custom ``dot_general`` raises a ``ValueError`` too.

    NNX modules are mutable, so the model is modified in place, like other
    NNX surgery; it is also returned for chaining. Parameters are unchanged
    (an optimizer state built before stays valid); each converted layer adds
    RNG state (``nnx.RngKey``/``nnx.RngCount``) to the model's state.

    Args:
      model: an NNX module.
      policy: which layers run in NVFP4 (``jax_nvfp4.policy``).
      rngs: ``nnx.Rngs`` with a ``rng_collection`` (or default) stream, an
        ``nnx.RngStream``, a key or an int seed; None converts for inference
        only (the forward pass works, gradients raise).
      rng_collection: the stream name.
      strict: raise on selected layers whose features are not multiples of
        16 (default); False leaves them in bf16 with a warning.

    Returns:
      ``model``.
    """
    if not isinstance(policy, Policy):
        raise TypeError(
            f"policy must be a jax_nvfp4.policy.Policy, got {type(policy).__name__}"
        )
    if isinstance(rngs, (int, jax.Array)) and not isinstance(rngs, bool):
        rngs = nnx.Rngs(**{rng_collection: rngs})
    selected, skipped = [], []
    for parts, layer in list(_iter_graph(model)):
        if not isinstance(layer, nnx.Linear):
            continue
        path = path_string(parts)
        recipe = policy.recipe_for(path)
        if recipe is None:
            continue
        k, n = layer.in_features, layer.out_features
        if k % 16 or n % 16:
            skipped.append(f"{path} [{k}, {n}]")
            continue
        current = layer.dot_general
        if current is not jax.lax.dot_general and not isinstance(
            current, NNXDotGeneral
        ):
            raise ValueError(
                f"{path} already has a custom dot_general ({current!r}); "
                f"exclude it from the policy with a rule ({path!r}, None)"
            )
        selected.append((layer, recipe))
    if skipped:
        message = (
            "NVFP4 needs in_features and out_features multiples of 16; the "
            f"policy selects {', '.join(skipped)}"
        )
        if strict:
            raise ValueError(
                f"{message}. Exclude them with policy rules (path, None), pad "
                "them, or pass strict=False to leave them in bf16"
            )
        warnings.warn(f"{message}: they stay in bf16", UserWarning, stacklevel=2)
    # Only now change the model: an error above leaves it as it was.
    for layer, recipe in selected:
        layer.dot_general = _as_data(
            NNXDotGeneral(recipe, rngs=rngs, rng_collection=rng_collection)
        )
    return model


def nvfp4_layers(model: nnx.Module) -> dict[str, Recipe]:
    """``{path: recipe}`` of the ``nnx.Linear`` layers of ``model`` in NVFP4."""
    return {
        path_string(parts): node.dot_general.recipe
        for parts, node in _iter_graph(model)
        if isinstance(node, nnx.Linear) and isinstance(node.dot_general, NNXDotGeneral)
    }
