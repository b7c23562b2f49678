"""Equinox integration: an NVFP4 stand-in for ``eqx.nn.Linear`` and ``convert``.

``Linear`` holds the same ``weight`` (out, in) and ``bias`` (out,) as
``eqx.nn.Linear`` and computes ``y = x @ weight.T + bias`` with
``jax_nvfp4.dot`` (the FPROP / DGRAD / WGRAD recipe). ``convert(model,
policy)`` swaps every ``eqx.nn.Linear`` that the policy puts in NVFP4 for a
``Linear`` holding the same arrays, with ``eqx.tree_at``; the other layers are
left untouched (bit-identical to the original model).

Batching. Equinox layers are written per example and run under ``jax.vmap``.
Run literally, that would quantize and multiply each example on its own: one
token padded to a block of 16 for the token-axis quantization, a per-example
amax, and a per-example weight gradient [batch, in, out] that is then summed.
``Linear`` instead folds every enclosing ``vmap`` into the token axis: under
``vmap`` it calls a ``jax.custom_batching.custom_vmap`` function whose rule
reshapes x [batch, ..., in] to [batch * ..., in] and calls itself again, so
nested maps (batch x sequence positions) fold into one ``dot`` over all tokens
-- three GEMMs in all, with the weight gradient reduced inside WGRAD -- exactly
the computation of ``dot`` on the folded tokens, forward and backward.

custom_vmap has no reverse-mode rule, so it is only ever called where the
innermost transformation is a ``vmap`` that maps one of the layer's operands:
its rule then runs at once, and what it hands on is a plain ``dot`` (a
``custom_vjp``) that ``grad``, ``jit`` and shardings handle as usual. Whether
the innermost transformation is such a ``vmap`` is read from JAX's trace
state (``_mapped_by_innermost_vmap``; tested with jax 0.10.2, and the names
it reads are unchanged in JAX's current sources). Where
it is not -- ``jit`` or ``grad`` innermost, a ``vmap`` of a per-example
``grad``, or a ``lax.scan`` / ``jax.checkpoint`` body traced inside a
``vmap`` -- the layer calls ``dot`` directly and JAX batches it per example:
correct, but without the fold. To fold there, vmap inside the scan or
checkpoint, or call the layer on [tokens, in] (``Linear`` accepts any leading
dimensions).

Keys. Stochastic rounding of the backward pass needs a key:
``layer(x, key=key)``, a new key each step, required when the recipe uses
stochastic rounding (``Recipe.needs_key``) -- unless the layer is in inference
mode (``eqx.nn.inference_mode(model)``), where no gradient is expected and a
fixed key is used. Under ``vmap`` pass one key for the whole batch
(``in_axes=None``, as usual for a model's key) or a key per example: the fold
makes one ``dot`` over the whole batch, so a batch of keys is reduced to the
first one. Either way every element of the folded tensor draws its own random
bits (they are indexed by the element's position in the folded tensor).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from jax_nvfp4.policy import Policy, path_string
from jax_nvfp4.recipe import NVFP4, Recipe, dot_general

__all__ = ["Linear", "convert", "linear_paths", "plan"]


# ------------------------------------------------------------------ folding


def _mapped_by_innermost_vmap(*operands: Any) -> bool:
    """True when the innermost active transformation is a ``jax.vmap`` that maps
    one of ``operands``.

    Only then is a ``custom_vmap`` function safe to call: that ``vmap``
    processes it at once, calling the rule. Reads JAX internals (the current
    trace and its tracer type); if they are not there, returns False and the
    layer falls back to plain per-example batching.
    """
    try:
        from jax._src import core
        from jax._src.interpreters import batching

        trace = core.trace_ctx.trace
        batch_trace, batch_tracer = batching.BatchTrace, batching.BatchTracer
    except (ImportError, AttributeError):  # pragma: no cover - other JAX versions
        return False
    if not isinstance(trace, batch_trace):
        return False
    return any(
        isinstance(a, batch_tracer)
        and a._trace is trace
        and getattr(a, "batch_dim", None) is not None
        for a in operands
    )


def _plain_dot(recipe: Recipe, x: jax.Array, w: jax.Array, kd: jax.Array):
    """x [..., K] . w [N, K]^T: the weight read as stored (no transpose)."""
    return dot_general(
        x,
        w,
        (((x.ndim - 1,), (1,)), ((), ())),
        key=kd if recipe.needs_key else None,
        recipe=recipe,
    )


def _folded_dot(recipe: Recipe, x: jax.Array, w: jax.Array, kd: jax.Array):
    """``dot(x, w)`` with every enclosing ``vmap`` folded into x's token axis.

    x [..., K], w [N, K] (same dtype), kd uint32[2] key words.
    """
    if _mapped_by_innermost_vmap(x, w, kd):
        return _folding_call(recipe)(x, w, kd)
    return _plain_dot(recipe, x, w, kd)


@functools.cache
def _folding_call(recipe: Recipe) -> Callable[..., jax.Array]:
    """The custom_vmap function of one recipe (cached: one per recipe)."""

    @jax.custom_batching.custom_vmap
    def folding(x, w, kd):
        return _plain_dot(recipe, x, w, kd)

    @folding.def_vmap
    def rule(axis_size: int, in_batched, x, w, kd):
        x_mapped, w_mapped, kd_mapped = in_batched
        if w_mapped:
            # A weight per example (an ensemble): nothing to fold; batch the
            # GEMMs per example as JAX does for dot.
            in_axes = (0 if x_mapped else None, 0, 0 if kd_mapped else None)
            return jax.vmap(functools.partial(_plain_dot, recipe), in_axes)(
                x, w, kd
            ), True
        if kd_mapped:
            kd = kd[0]  # one dot over the batch: one key (see module docstring)
        if not x_mapped:
            return _folded_dot(recipe, x, w, kd), False
        # x [axis_size, ..., K] -> [axis_size * ..., K]; _folded_dot folds the
        # next enclosing vmap the same way, if there is one.
        y = _folded_dot(recipe, x.reshape(-1, x.shape[-1]), w, kd)
        return y.reshape(*x.shape[:-1], y.shape[-1]), True

    return folding


def _key_words(key: jax.Array | None, recipe: Recipe, inference: bool) -> jax.Array:
    """uint32[2] words of ``key`` (typed or raw); a fixed key when unused."""
    if not recipe.needs_key:
        return jnp.zeros((2,), jnp.uint32)
    if key is None:
        if inference:
            return jnp.zeros((2,), jnp.uint32)
        raise ValueError(
            "this jax_nvfp4.equinox.Linear's recipe uses stochastic rounding in "
            "the backward pass: call it with key=... (a new key each step), put "
            "the model in inference mode (eqx.nn.inference_mode(model)) when no "
            "gradient is taken, or convert with a recipe without stochastic "
            "rounding (jax_nvfp4.NVFP4_NO_SR)"
        )
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(key)
        if data.shape[-1:] == (2,) and data.dtype == jnp.uint32:
            return data
        return jax.random.bits(key, (2,), jnp.uint32)
    if key.shape[-1:] != (2,) or key.dtype != jnp.uint32:
        raise ValueError(
            "key must be a jax.random.key(...) or a uint32[2] PRNGKey, got "
            f"{key.dtype}{list(key.shape)}"
        )
    return key


# ------------------------------------------------------------------- module


class Linear(eqx.Module):
    """A stand-in for ``eqx.nn.Linear`` that runs the NVFP4 training recipe.

    ``y = x @ weight.T + bias`` through ``jax_nvfp4.dot`` (x quantized along
    ``in``, the weight in 16x16 blocks, the backward GEMMs as the recipe says).
    The weight is cast to x's dtype first, so fp32 master weights work with
    bf16 activations; the output has x's dtype.

    Attributes:
      weight: (out_features, in_features), as in ``eqx.nn.Linear``.
      bias: (out_features,) or None.
      in_features, out_features: multiples of 16 (NVFP4 blocks).
      use_bias: whether ``bias`` is used.
      recipe: the ``jax_nvfp4.Recipe`` of the three GEMMs.
      inference: when True and no key is given, stochastic rounding uses a
        fixed key (set by ``eqx.nn.inference_mode``; for evaluation only).
    """

    weight: jax.Array
    bias: jax.Array | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    recipe: Recipe = eqx.field(static=True)
    inference: bool = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        use_bias: bool = True,
        dtype: Any = None,
        *,
        recipe: Recipe = NVFP4,
        inference: bool = False,
        key: jax.Array,
    ):
        """Initialises like ``eqx.nn.Linear`` (uniform in +-1/sqrt(in))."""
        for name, n in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(n, int) or isinstance(n, bool):
                raise TypeError(
                    f"{name} must be an int (the 'scalar' features of "
                    f"eqx.nn.Linear are not supported), got {n!r}"
                )
        _check_shape(in_features, out_features, recipe, "Linear")
        linear = eqx.nn.Linear(
            in_features, out_features, use_bias=use_bias, dtype=dtype, key=key
        )
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.recipe = recipe
        self.inference = inference

    @classmethod
    def from_linear(
        cls, linear: eqx.nn.Linear, recipe: Recipe = NVFP4, *, path: str = ""
    ) -> Linear:
        """A ``Linear`` holding ``linear``'s own weight and bias arrays."""
        if not isinstance(linear.in_features, int) or not isinstance(
            linear.out_features, int
        ):
            raise TypeError(
                f"{path or 'the layer'}: eqx.nn.Linear with 'scalar' features "
                "cannot run in NVFP4; keep it in bf16 with a policy rule "
                f"({path!r}, None)"
            )
        _check_shape(linear.in_features, linear.out_features, recipe, path)
        # Build the module abstractly (no random initialisation), then put the
        # layer's own arrays in.
        template = eqx.filter_eval_shape(
            cls,
            linear.in_features,
            linear.out_features,
            linear.use_bias,
            linear.weight.dtype,
            recipe=recipe,
            key=jax.random.key(0),
        )
        if linear.bias is None:
            return eqx.tree_at(lambda m: m.weight, template, linear.weight)
        return eqx.tree_at(
            lambda m: (m.weight, m.bias), template, (linear.weight, linear.bias)
        )

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """x [..., in_features] -> [..., out_features] (x's dtype).

        Args:
          x: one example's features (the usual Equinox call under ``vmap``) or
            any leading dimensions of tokens.
          key: PRNG key for stochastic rounding in the backward pass (see the
            module docstring); unused when the recipe has no stochastic
            rounding.
        """
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(
                f"x has shape {x.shape}; this Linear takes [..., {self.in_features}]"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"x must be floating point, got {x.dtype}")
        w = self.weight.astype(x.dtype)
        kd = _key_words(key, self.recipe, self.inference)
        y = _folded_dot(self.recipe, x, w, kd)
        if self.bias is not None:
            y = y + self.bias.astype(y.dtype)
        return y


def _check_shape(k: int, n: int, recipe: Recipe, path: str) -> None:
    if (recipe.fprop or recipe.dgrad or recipe.wgrad) and (k % 16 or n % 16):
        raise ValueError(
            f"{path or 'Linear'}: in_features={k}, out_features={n}; NVFP4 "
            "needs multiples of 16 -- keep this layer in bf16 (a policy rule "
            f"({path!r}, None)) or pad it"
        )


# ---------------------------------------------------------------- converter


def _is_linear(node: Any) -> bool:
    return isinstance(node, (eqx.nn.Linear, Linear))


def linear_paths(model: Any) -> dict[str, eqx.nn.Linear | Linear]:
    """``{path: layer}`` for every ``eqx.nn.Linear`` and ``Linear`` in ``model``.

    Paths are ``policy.path_string`` of the pytree path: field names and list
    indices joined by "." (e.g. ``"layers.3.mlp.up_proj"``).
    """
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)[0]
    return {path_string(p): leaf for p, leaf in leaves if _is_linear(leaf)}


def plan(model: Any, policy: Policy) -> dict[str, Recipe | None]:
    """``{path: recipe or None}`` for the ``eqx.nn.Linear`` layers of ``model``:
    what ``convert`` would do (None: left as it is)."""
    return {
        path: policy.recipe_for(path)
        for path, layer in linear_paths(model).items()
        if isinstance(layer, eqx.nn.Linear)
    }


def convert(model: Any, policy: Policy) -> Any:
    """Replaces each ``eqx.nn.Linear`` the policy gives a recipe by ``Linear``.

    Args:
      model: any Equinox model (a pytree of modules).
      policy: a ``jax_nvfp4.policy.Policy``; ``policy.recipe_for(path)`` is asked
        for every ``eqx.nn.Linear`` (see ``linear_paths`` for the paths).

    Returns:
      A new model (built with ``eqx.tree_at``) in which those layers are
      ``Linear``s holding the same weight and bias arrays; everything else --
      including the linears the policy leaves in bf16 -- is unchanged and
      holds the same arrays.
      The model's own code must pass ``key=`` to the converted layers when
      their recipe uses stochastic rounding.
    """
    if not isinstance(policy, Policy):
        raise TypeError(
            f"policy must be a jax_nvfp4.policy.Policy, got {type(policy).__name__}"
        )
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)[0]
    wheres, replacements = [], []
    for key_path, leaf in leaves:
        if not isinstance(leaf, eqx.nn.Linear):
            continue
        path = path_string(key_path)
        recipe = policy.recipe_for(path)
        if recipe is None:
            continue
        wheres.append(key_path)
        replacements.append(Linear.from_linear(leaf, recipe, path=path))
    if not wheres:
        return model

    def where(m):
        return [_get(m, key_path) for key_path in wheres]

    return eqx.tree_at(where, model, replace=replacements, is_leaf=_is_linear)


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
