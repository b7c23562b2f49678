"""``convert``: puts the dense layers of a Flax NNX model that a ``Policy``
selects in NVFP4, in place (stacked layers included), and ``nvfp4_layers``,
which lists them."""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx

from jax_nvfp4.flax.experts import Experts, NNXRaggedDot
from jax_nvfp4.flax.nnx_layers import (
    NNXDotGeneral,
    NNXEinsumOp,
    _as_data,
    _fork_stream,
)
from jax_nvfp4.flax.products import DEFAULT_RNG_COLLECTION
from jax_nvfp4.policy import Policy, path_string, warn_unmatched_rules
from jax_nvfp4.recipe import Recipe

__all__ = ["convert", "nvfp4_layers"]


def _iter_graph(node: Any):
    iter_graph = getattr(nnx, "iter_graph", None) or nnx.graph.iter_graph
    return iter_graph(node)


_LAYER_TYPES = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum, Experts)


def _kernel_shape(layer: nnx.Module) -> tuple[int, ...]:
    kernel = layer.kernel
    value = kernel.get_value() if hasattr(kernel, "get_value") else kernel.value
    return tuple(value.shape)


def _einsum_form(spec: str, kernel_shape: tuple[int, ...]):
    """(K, N, why-not) of an einsum ``input,kernel->output`` over ``kernel_shape``."""
    try:
        inputs, out = spec.split("->")
        lhs, rhs = inputs.split(",")
    except ValueError:
        return None, None, f"einsum {spec!r} is not 'input,kernel->output'"
    if "." in rhs or len(rhs) != len(kernel_shape):
        return None, None, f"einsum {spec!r} does not name each kernel axis"
    batch = [c for c in rhs if c in lhs and c in out]
    if batch:
        return (
            None,
            None,
            (
                f"einsum {spec!r} has batch indices {batch} (a batched product, "
                "not a weight-like projection)"
            ),
        )
    size = dict(zip(rhs, kernel_shape, strict=True))
    k = math.prod(size[c] for c in rhs if c in lhs)
    n = math.prod(size[c] for c in rhs if c not in lhs)
    return k, n, None


def _layer_form(layer: nnx.Module):
    """(per-layer kernel shape, K, N, why it cannot run NVFP4 or None).

    K and N are None where the layer decides them at call time (an
    ``nnx.Einsum`` whose equation is passed to ``__call__``)."""
    if isinstance(layer, Experts):
        shape = (layer.num_experts, layer.in_features, layer.out_features)
        current = layer.ragged_dot
        if current is not None and not isinstance(current, NNXRaggedDot):
            return shape, *shape[1:], f"it has a custom ragged_dot ({current!r})"
        return shape, *shape[1:], None
    if isinstance(layer, nnx.Einsum):
        shape = tuple(layer.kernel_shape)
        if layer.einsum_op is not jnp.einsum and not isinstance(
            layer.einsum_op, NNXEinsumOp
        ):
            return shape, None, None, f"it has a custom einsum_op ({layer.einsum_op!r})"
        if layer.einsum_str is None:
            return shape, None, None, None
        k, n, why = _einsum_form(layer.einsum_str, shape)
        return shape, k, n, why
    if isinstance(layer, nnx.LinearGeneral):
        shape = (
            tuple(layer.batch_axis.values())
            + tuple(layer.in_features)
            + tuple(layer.out_features)
        )
        k, n = math.prod(layer.in_features), math.prod(layer.out_features)
        if layer.batch_axis:
            return shape, k, n, "it has batch_axis (a batched product)"
        if layer.dot_general_cls is not None:
            return shape, k, n, "it has a dot_general_cls"
        current = layer.dot_general
        if current is not None and current is not jax.lax.dot_general:
            if not isinstance(current, NNXDotGeneral):
                return shape, k, n, f"it has a custom dot_general ({current!r})"
        return shape, k, n, None
    shape = (layer.in_features, layer.out_features)
    current = layer.dot_general
    if current is not jax.lax.dot_general and not isinstance(current, NNXDotGeneral):
        return shape, *shape, f"it has a custom dot_general ({current!r})"
    return shape, *shape, None


def _new_dot_general(
    recipes, rngs, rng_collection: str, op=NNXDotGeneral
) -> NNXDotGeneral | NNXRaggedDot:
    """The ``op`` (``NNXDotGeneral``, or ``NNXRaggedDot`` for experts) of a
    layer, or of a stack of layers whose ``recipes`` are one recipe or None
    (bf16) per layer: its RNG state (and, if some layers stay in bf16, its
    switch) gets the stack's leading axis, so that a scan over the stack
    hands each layer its own keys."""
    recipe = next(r for r in recipes if r is not None)
    if len(recipes) == 1 and not isinstance(recipes, list):
        return op(recipe, rngs=rngs, rng_collection=rng_collection)
    switch = None
    if any(r is None for r in recipes):
        switch = jnp.array([r is not None for r in recipes])
    keys = None
    if rngs is not None and recipe.needs_key:
        keys = jax.random.split(_fork_stream(rngs, rng_collection)(), len(recipes))
    if keys is None and switch is None:
        return op(recipe, rngs=None, rng_collection=rng_collection)

    def make(keys, switch):
        enabled = {} if switch is None else {"enabled": switch}
        return op(recipe, rngs=keys, rng_collection=rng_collection, **enabled)

    in_axes = (None if keys is None else 0, None if switch is None else 0)
    return nnx.vmap(make, in_axes=in_axes, out_axes=0, axis_size=len(recipes))(
        keys, switch
    )


def convert(
    model: nnx.Module,
    policy: Policy,
    rngs: nnx.Rngs | nnx.RngStream | jax.Array | int | None = None,
    *,
    rng_collection: str = DEFAULT_RNG_COLLECTION,
    strict: bool = True,
) -> nnx.Module:
    """Puts the dense layers of an NNX model that ``policy`` selects in NVFP4,
    in place.

    Layers: ``nnx.Linear``, ``nnx.LinearGeneral`` (several input or feature
    axes fold into one K and one N), ``nnx.Einsum`` whose equation is
    weight-like (no index shared by input, kernel and output: e.g.
    ``"BTD,DNH->BTNH"``, ``"BTNH,NHD->BTD"``) and ``Experts`` (expert
    projections: ``jax_nvfp4.ragged_dot``, through ``NNXRaggedDot``). For
    each one reached from ``model`` (``nnx.iter_graph`` order, a shared layer
    once), ``path`` is its normalised path (``policy.path_string``, e.g.
    ``"layers.3.mlp.up_proj"``) and the policy decides:

    - ``None``: the layer is left untouched (bit-identical to the original).
    - a ``Recipe``: the layer's ``dot_general`` (an Einsum's ``einsum_op``)
      runs the recipe through ``NNXDotGeneral``, with its own RNG stream
      forked from ``rngs[rng_collection]`` (so keys do not depend on call
      order). A layer converted before gets the new recipe and a new stream.

    Stacked layers: a layer whose kernel has one more leading axis than its
    features say (``nnx.vmap``-built blocks run by ``nnx.scan``) is a stack.
    Its RNG state gets the same leading axis, so each layer of the stack and
    each step draws its own stochastic-rounding bits (scan the stack with
    ``in_axes=0`` for all its state, as usual). The policy decides per layer
    with ``Policy.stack_recipes``: where it keeps the last blocks in bf16, a
    per-layer switch (``NVFP4Enabled``, stacked likewise) selects the bf16
    product for them inside the scan (``lax.cond``). Under ``jax.grad`` a
    ``cond`` keeps the residuals of both branches, so such a stack saves the
    bf16 operands as well as the FP4 ones: to save memory, split the stack
    (the last blocks outside it, with an index in their path).

    Layers the policy selects but that cannot run NVFP4 -- K or N (the
    flattened contracted and free kernel dims) not multiples of 16, an einsum
    with batch indices, ``batch_axis``, another custom ``dot_general`` --
    raise a ``ValueError`` naming each of them before anything is changed;
    ``strict=False`` leaves them as they are with a ``UserWarning``. A rule of
    the policy that matches no layer gets a ``UserWarning`` listing the paths
    found (most often a typo in a glob).

    NNX modules are mutable, so the model is modified in place, like other
    NNX surgery; it is also returned for chaining. Parameters are unchanged
    (an optimizer state built before stays valid); each converted layer adds
    RNG state (``nnx.RngKey``/``nnx.RngCount``) to the model's state.

    Args:
      model: an NNX module. (linen modules are immutable: give ``nn.Dense``
        and ``nn.DenseGeneral`` ``LinenDotGeneral``, and use ``LinenEinsum``
        for ``nn.Einsum``; Equinox models: ``jax_nvfp4.equinox.convert``.)
      policy: which layers run in NVFP4 (``jax_nvfp4.policy``).
      rngs: ``nnx.Rngs`` with a ``rng_collection`` (or default) stream, an
        ``nnx.RngStream``, a key or an int seed; None converts for inference
        only (the forward pass works, gradients raise).
      rng_collection: the stream name.
      strict: raise on selected layers that cannot run NVFP4 (default);
        False leaves them as they are, with a warning.

    Returns:
      ``model``.
    """
    if not isinstance(model, nnx.Module):
        hint = "jax_nvfp4.flax.convert takes a Flax NNX module"
        if type(model).__module__.split(".")[0] == "equinox" or _is_equinox(model):
            hint += "; for an Equinox model use jax_nvfp4.equinox.convert"
        elif isinstance(model, linen.Module):
            hint += (
                "; linen modules are immutable: pass dot_general_cls="
                "functools.partial(jax_nvfp4.flax.LinenDotGeneral, recipe=...) "
                "to nn.Dense / nn.DenseGeneral and use jax_nvfp4.flax.LinenEinsum"
            )
        raise TypeError(f"{hint}; got {type(model).__name__}")
    if not isinstance(policy, Policy):
        raise TypeError(
            f"policy must be a jax_nvfp4.policy.Policy, got {type(policy).__name__}"
        )
    if isinstance(rngs, (int, jax.Array)) and not isinstance(rngs, bool):
        rngs = nnx.Rngs(**{rng_collection: rngs})
    paths, selected, problems = [], [], []
    for parts, layer in list(_iter_graph(model)):
        if not isinstance(layer, _LAYER_TYPES):
            continue
        path = path_string(parts)
        paths.append(path)
        shape, k, n, why = _layer_form(layer)
        full = _kernel_shape(layer)
        stack = full[: len(full) - len(shape)]
        if full[len(stack) :] != shape or len(stack) > 1:
            why = why or (
                f"its kernel {list(full)} is not [{', '.join(map(str, shape))}] "
                "or a stack of it along one leading axis"
            )
            recipes = (policy.recipe_for(path),)
        elif stack:
            recipes = policy.stack_recipes(path, stack[0])
        else:
            recipes = (policy.recipe_for(path),)
        if all(r is None for r in recipes):
            continue
        if why is None and k is not None and (k % 16 or n % 16):
            why = f"K={k}, N={n} are not multiples of 16 (NVFP4 blocks)"
        if why is None and isinstance(layer, Experts) and None in recipes:
            why = (
                "a stack of experts whose last layers the policy keeps in bf16 "
                "(no per-layer switch for experts): split the stack"
            )
        if why is not None:
            problems.append(f"{path} ({type(layer).__name__}: {why})")
            continue
        selected.append((layer, list(recipes) if stack else recipes))
    if not paths:
        warnings.warn(
            f"jax_nvfp4.flax.convert found no layer to convert in this "
            f"{type(model).__name__}; it is returned unchanged. convert swaps the "
            "products of nnx.Linear, nnx.LinearGeneral, weight-like nnx.Einsum "
            "and jax_nvfp4.flax.Experts layers of an NNX model (linen models: "
            "jax_nvfp4.flax.LinenDotGeneral or qwix; Equinox: "
            "jax_nvfp4.equinox.convert)",
            UserWarning,
            stacklevel=2,
        )
    else:
        warn_unmatched_rules(policy, paths)
    if problems:
        message = "the policy selects layers that cannot run NVFP4: " + "; ".join(
            problems
        )
        if strict:
            raise ValueError(
                f"{message}. Exclude them with policy rules (path, None), change "
                "them, or pass strict=False to leave them as they are"
            )
        warnings.warn(f"{message}: they stay as they are", UserWarning, stacklevel=2)
    # Only now change the model: an error above leaves it as it was.
    for layer, recipes in selected:
        if isinstance(layer, Experts):
            op = _new_dot_general(recipes, rngs, rng_collection, NNXRaggedDot)
            layer.ragged_dot = _as_data(op)
            continue
        dot_general = _new_dot_general(recipes, rngs, rng_collection)
        if isinstance(layer, nnx.Einsum):
            layer.einsum_op = _as_data(NNXEinsumOp(dot_general))
        else:
            layer.dot_general = _as_data(dot_general)
    return model


def _is_equinox(model: Any) -> bool:
    return any(c.__module__.split(".")[0] == "equinox" for c in type(model).__mro__)


def nvfp4_layers(model: nnx.Module) -> dict[str, Recipe]:
    """``{path: recipe}`` of the dense layers of ``model`` in NVFP4 (a stack
    whose last layers stay in bf16 is listed with its recipe)."""
    found = {}
    for parts, node in _iter_graph(model):
        op = None
        if isinstance(node, (nnx.Linear, nnx.LinearGeneral)):
            op = node.dot_general
        elif isinstance(node, nnx.Einsum):
            op = node.einsum_op
        elif isinstance(node, Experts):
            op = node.ragged_dot
        if isinstance(op, (NNXDotGeneral, NNXEinsumOp, NNXRaggedDot)):
            found[path_string(parts)] = op.recipe
    return found
