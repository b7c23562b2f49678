"""``convert``: swaps the layers of an Equinox model that a ``Policy``
selects for their NVFP4 forms (``Linear``, ``Experts`` with a recipe), and
``plan`` / ``linear_paths``, which show what it would do."""

from __future__ import annotations

import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from jax_nvfp4.equinox.experts import Experts
from jax_nvfp4.equinox.linear import Linear, _to_eqx_linear
from jax_nvfp4.policy import Policy, path_string, warn_unmatched_rules
from jax_nvfp4.recipe import Recipe

__all__ = ["convert", "linear_paths", "plan"]


def _is_linear(node: Any) -> bool:
    return isinstance(node, (eqx.nn.Linear, Linear))


def _is_layer(node: Any) -> bool:
    """A layer ``convert`` decides on: a linear layer or ``Experts``."""
    return _is_linear(node) or isinstance(node, Experts)


def _stack_size(layer: eqx.nn.Linear | Linear | Experts) -> int | None:
    """L for a stack (weight [L, ..., out, in], Experts [L, ..., G, in,
    out]); None for one layer."""
    own = 3 if isinstance(layer, Experts) else 2
    return layer.weight.shape[0] if layer.weight.ndim > own else None


def linear_paths(model: Any) -> dict[str, eqx.nn.Linear | Linear]:
    """``{path: layer}`` for every ``eqx.nn.Linear`` and ``Linear`` in ``model``.

    Paths are ``policy.path_string`` of the pytree path: field names and list
    indices joined by "." (e.g. ``"layers.3.mlp.up_proj"``). A stack of layers
    (weight [L, out, in]) is one entry, at the stack's path.
    """
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)[0]
    return {path_string(p): leaf for p, leaf in leaves if _is_linear(leaf)}


def _decide(policy: Policy, path: str, layer) -> Recipe | None | tuple:
    """The policy's recipe for a layer, or a stack's tuple of them."""
    size = _stack_size(layer)
    if size is None:
        return policy.recipe_for(path)
    return policy.stack_recipes(path, size)


def plan(model: Any, policy: Policy) -> dict[str, Recipe | None | tuple]:
    """What ``convert`` would do: ``{path: recipe or None}`` for every linear
    layer of ``model`` (None: bf16, an ``eqx.nn.Linear``), and for a stack a
    tuple with each layer's."""
    return {path: _decide(policy, path, layer) for path, layer in _layers(model)}


def _layers(model: Any) -> list[tuple[str, Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_layer)[0]
    return [(path_string(p), leaf) for p, leaf in leaves if _is_layer(leaf)]


def _reject_flax(model: Any) -> None:
    """Flax modules (linen or NNX) belong to jax_nvfp4.flax; told apart by
    their classes' module names, so flax need not be installed."""
    for cls in type(model).__mro__:
        module = getattr(cls, "__module__", "") or ""
        if module == "flax" or module.startswith("flax."):
            raise TypeError(
                f"{type(model).__name__} is a Flax module ({cls.__module__}."
                f"{cls.__qualname__}); convert Flax NNX models with "
                "jax_nvfp4.flax.convert (linen: give nn.Dense "
                "dot_general_cls=jax_nvfp4.flax.LinenDotGeneral). "
                "jax_nvfp4.equinox.convert takes Equinox models"
            )


def _experts_replacement(layer: Experts, decided, path: str) -> Experts:
    if isinstance(decided, tuple):  # a stack
        recipes = set(decided)
        if len(recipes) > 1:
            raise ValueError(
                f"{path}: a stack of Experts whose last layers the policy keeps "
                "in bf16 (Experts have no per-layer switch): keep those blocks "
                "in a stack of their own"
            )
        (decided,) = recipes
    k, n = layer.in_features, layer.out_features
    if decided is not None and (k % 16 or n % 16):
        raise ValueError(
            f"{path}: Experts with in_features={k}, out_features={n}; NVFP4 "
            f"needs multiples of 16 -- keep them in bf16 (a policy rule "
            f"({path!r}, None)) or pad them"
        )
    return layer if decided == layer.recipe else layer.with_recipe(decided)


def _replacement(layer, decided, path: str):
    """The layer ``convert`` puts at ``path``."""
    if isinstance(layer, Experts):
        return _experts_replacement(layer, decided, path)
    if isinstance(decided, tuple):  # a stack
        recipes = {r for r in decided if r is not None}
        if len(recipes) > 1:  # pragma: no cover - Policy gives one per stack
            raise ValueError(f"{path}: one recipe per stack, got {recipes}")
        if not recipes:
            decided = None
        else:
            (recipe,) = recipes
            if all(r is not None for r in decided):
                return Linear.from_linear(layer, recipe, path=path)
            per_layer = jnp.asarray([r is not None for r in decided], bool)
            lead = layer.weight.shape[:-2]
            per_layer = jnp.broadcast_to(
                per_layer.reshape(-1, *(1,) * (len(lead) - 1)), lead
            )
            return Linear.from_linear(layer, recipe, path=path, nvfp4=per_layer)
    if decided is None:
        return layer if isinstance(layer, eqx.nn.Linear) else _to_eqx_linear(layer)
    return Linear.from_linear(layer, decided, path=path)


def convert(model: Any, policy: Policy) -> Any:
    """Puts the linear layers of ``model`` that ``policy`` selects in NVFP4.

    Every ``eqx.nn.Linear`` (and every ``Linear``, so that converting again
    applies the new policy) at path ``p`` (see ``linear_paths``) becomes:

    - ``policy.recipe_for(p)`` is a Recipe: a ``Linear`` with that recipe,
      holding the same weight and bias arrays;
    - None: an ``eqx.nn.Linear`` (the same layer if it was one).

    ``Experts`` (mixture-of-experts projections) get the policy's recipe
    (None: bf16); a stack of them is decided as a whole.

    A stack of layers (weight [L, out, in], built by ``eqx.filter_vmap`` and
    run by ``lax.scan``) is decided per layer by ``policy.stack_recipes(p,
    L)``: all in NVFP4, all in bf16, or -- where ``keep_last`` keeps its last
    layers in bf16 -- a stacked ``Linear`` with a per-layer ``nvfp4`` switch
    (see the module docstring).

    Args:
      model: an Equinox model: any pytree (modules, lists, tuples, dicts)
        holding the layers. One without any gets a ``UserWarning`` and is
        returned as it is.
      policy: a ``jax_nvfp4.policy.Policy``. A rule whose glob matches no
        linear layer gets a ``UserWarning`` listing the paths found.

    Returns:
      A new model (built with ``eqx.tree_at``): everything but the converted
      layers is unchanged and holds the same arrays. The model's code passes
      ``key=`` to the layers, or runs inside ``keys(step_key)``, when their
      recipe uses stochastic rounding.
    """
    _reject_flax(model)
    if not isinstance(policy, Policy):
        raise TypeError(
            f"policy must be a jax_nvfp4.policy.Policy, got {type(policy).__name__}"
        )
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_layer)[0]
    found = [(kp, leaf) for kp, leaf in leaves if _is_layer(leaf)]
    if not found:
        _warn_no_layers(model, [leaf for _, leaf in leaves])
        return model
    warn_unmatched_rules(policy, [path_string(kp) for kp, _ in found], stacklevel=3)
    wheres, replacements = [], []
    for key_path, leaf in found:
        path = path_string(key_path)
        new = _replacement(leaf, _decide(policy, path, leaf), path)
        if new is not leaf:
            wheres.append(key_path)
            replacements.append(new)
    if not wheres:
        return model

    def where(m):
        return [_get(m, key_path) for key_path in wheres]

    return eqx.tree_at(where, model, replace=replacements, is_leaf=_is_layer)


def _warn_no_layers(model: Any, leaves: list) -> None:
    """The model has no layer to convert: say what convert looks for."""
    count = len(leaves)
    held = f"{count} {'leaf' if count == 1 else 'leaves'}, none a layer"
    warnings.warn(
        f"jax_nvfp4.equinox.convert found no layer to convert in this "
        f"{type(model).__name__} ({held}); it is returned unchanged. convert "
        "swaps eqx.nn.Linear layers (and jax_nvfp4.equinox.Linear / Experts) "
        "found anywhere in a pytree of Equinox modules, lists, tuples and "
        "dicts; an array is not a layer (wrap weights in eqx.nn.Linear, or "
        "call jax_nvfp4.dot on them)",
        UserWarning,
        stacklevel=3,
    )


def _get(node: Any, key_path) -> Any:
    """The node at a ``jax.tree_util`` key path (attribute, index or dict key)."""
    for entry in key_path:
        if isinstance(entry, jax.tree_util.GetAttrKey):
            node = getattr(node, entry.name)
        elif isinstance(entry, jax.tree_util.SequenceKey):
            node = node[entry.idx]
        elif isinstance(entry, jax.tree_util.DictKey):
            node = node[entry.key]
        else:
            raise TypeError(
                f"cannot follow the tree path entry {entry!r} "
                f"({type(entry).__name__}) to a layer; convert supports modules, "
                "lists, tuples and dicts"
            )
    return node
