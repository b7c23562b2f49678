"""``Linear``: the NVFP4 stand-in for ``eqx.nn.Linear`` (the same weight
and bias; ``jax_nvfp4.dot`` folded over the enclosing ``vmap``s)."""

from __future__ import annotations

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from jax_nvfp4.equinox.fold import folded_dot
from jax_nvfp4.equinox.key_source import _key_words, forward_only
from jax_nvfp4.recipe import NVFP4, Recipe

__all__ = ["Linear"]


class Linear(eqx.Module):
    """A stand-in for ``eqx.nn.Linear`` that runs the NVFP4 training recipe.

    ``y = x @ weight.T + bias`` through ``jax_nvfp4.dot`` (x quantized along
    ``in``, the weight in 16x16 blocks, the backward GEMMs as the recipe says).
    The weight is cast to x's dtype first, so fp32 master weights work with
    bf16 activations; the output has x's dtype.

    A stack of layers (``eqx.filter_vmap``-built, run by ``lax.scan``) is one
    ``Linear`` whose arrays have leading layer axes: weight [L, out, in]. It
    is called per layer (each scan step, or after indexing its arrays).

    Attributes:
      weight: (out_features, in_features), as in ``eqx.nn.Linear``; a stack
        has leading layer axes.
      bias: (out_features,) or None (a stack: with the same leading axes).
      in_features, out_features: multiples of 16 (NVFP4 blocks).
      use_bias: whether ``bias`` is used.
      recipe: the ``jax_nvfp4.Recipe`` of the three GEMMs.
      inference: when True and no key is given, stochastic rounding uses a
        fixed key (set by ``eqx.nn.inference_mode``; for evaluation only).
      nvfp4: None (every layer runs ``recipe``), or a bool array with the
        weight's leading axes: per layer of a stack, True runs ``recipe`` and
        False the bf16 product of ``eqx.nn.Linear`` (see the module docstring).
    """

    weight: jax.Array
    bias: jax.Array | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    recipe: Recipe = eqx.field(static=True)
    inference: bool = False
    nvfp4: jax.Array | None = None

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
        _check_shape(in_features, out_features, recipe, None)
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
        self.nvfp4 = None

    @classmethod
    def from_linear(
        cls,
        linear: eqx.nn.Linear | Linear,
        recipe: Recipe = NVFP4,
        *,
        path: str = "",
        nvfp4: Any = None,
    ) -> Linear:
        """A ``Linear`` holding ``linear``'s own weight and bias arrays.

        ``linear`` may be a stack (weight [L, out, in]); ``nvfp4`` is then
        None or a bool per layer (see the class docstring). A ``Linear``
        given here keeps its ``inference`` flag and gets the new recipe.
        """
        if not isinstance(linear.in_features, int) or not isinstance(
            linear.out_features, int
        ):
            raise TypeError(
                f"{path or 'the layer'}: eqx.nn.Linear with 'scalar' features "
                "cannot run in NVFP4; keep it in bf16 with a policy rule "
                f"({path!r}, None)"
            )
        _check_shape(linear.in_features, linear.out_features, recipe, path)
        lead = linear.weight.shape[:-2]
        if nvfp4 is not None:
            nvfp4 = jnp.asarray(nvfp4, bool)
            if nvfp4.shape != lead:
                raise ValueError(
                    f"{path or 'Linear'}: nvfp4 has shape {nvfp4.shape}; the "
                    f"stack's layer axes are {lead}"
                )
        # Build the module abstractly (no random initialisation), then put the
        # layer's own arrays in.
        template = eqx.filter_eval_shape(
            cls,
            linear.in_features,
            linear.out_features,
            linear.use_bias,
            linear.weight.dtype,
            recipe=recipe,
            inference=bool(getattr(linear, "inference", False)),
            key=jax.random.key(0),
        )
        return _fill(template, linear.weight, linear.bias, nvfp4)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """x [..., in_features] -> [..., out_features] (x's dtype).

        Args:
          x: one example's features (the usual Equinox call under ``vmap``) or
            any leading dimensions of tokens.
          key: PRNG key for stochastic rounding in the backward pass (see the
            module docstring); unused when the recipe has no stochastic
            rounding. Without one (nor a ``keys`` block, nor inference mode)
            the forward pass runs, as ``jax_nvfp4.dot``'s does without a
            key, and differentiating it raises a ValueError.
        """
        if self.weight.ndim != 2:
            raise ValueError(
                f"this Linear is a stack of layers (weight {self.weight.shape}): "
                "call it per layer, inside a lax.scan over its arrays or after "
                "indexing them"
            )
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(
                f"x has shape {x.shape}; this Linear takes [..., {self.in_features}]"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"x must be floating point, got {x.dtype}")
        kd = _key_words(key, self.recipe, self.inference)
        if kd is None:  # as jax_nvfp4.dot without a key: forward only
            nvfp4 = forward_only(_nvfp4_product, self.recipe, "Linear")
            kd = jnp.zeros((2,), jnp.uint32)
        else:
            nvfp4 = functools.partial(_nvfp4_product, self.recipe)
        operands = (x, self.weight, self.bias, kd)
        flag = self.nvfp4
        if flag is None:
            return nvfp4(*operands)
        if not isinstance(flag, jax.core.Tracer):  # known now: no cond
            return nvfp4(*operands) if bool(flag) else _bf16_product(*operands)
        return jax.lax.cond(flag, nvfp4, _bf16_product, *operands)


def _nvfp4_product(recipe: Recipe, x, weight, bias, kd):
    y = folded_dot(recipe, x, weight.astype(x.dtype), kd)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y


def _bf16_product(x, weight, bias, kd):
    """``eqx.nn.Linear``'s computation, in x's dtype like ``_nvfp4_product``."""
    del kd  # no stochastic rounding
    y = weight @ x if x.ndim == 1 else x @ weight.T
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype)


def _fill(template, weight, bias, nvfp4=None):
    """``template`` (a Linear or an eqx.nn.Linear) holding these arrays."""
    module = eqx.tree_at(lambda m: m.weight, template, weight)
    if bias is not None:
        module = eqx.tree_at(lambda m: m.bias, module, bias)
    if nvfp4 is not None:
        module = eqx.tree_at(
            lambda m: m.nvfp4, module, nvfp4, is_leaf=lambda n: n is None
        )
    return module


def _to_eqx_linear(layer: Linear) -> eqx.nn.Linear:
    """The ``eqx.nn.Linear`` holding a ``Linear``'s arrays (bf16 again)."""
    template = eqx.filter_eval_shape(
        eqx.nn.Linear,
        layer.in_features,
        layer.out_features,
        layer.use_bias,
        layer.weight.dtype,
        key=jax.random.key(0),
    )
    return _fill(template, layer.weight, layer.bias)


def _check_shape(k: int, n: int, recipe: Recipe, path: str | None) -> None:
    """``path``: the layer's path in a model being converted, None for a
    Linear built directly."""
    if (recipe.fprop or recipe.dgrad or recipe.wgrad) and (k % 16 or n % 16):
        keep = (
            "use eqx.nn.Linear (bf16) for this layer, or recipe=jax_nvfp4.BF16"
            if path is None
            else f"keep this layer in bf16 (a policy rule ({path!r}, None))"
        )
        raise ValueError(
            f"{path or 'Linear'}: in_features={k}, out_features={n}; NVFP4 "
            f"needs multiples of 16 -- {keep}, or pad it"
        )
