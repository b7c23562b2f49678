"""``Experts``: G weight matrices applied to rows sorted by expert, the
expert projections of a mixture-of-experts block, in bf16
(``jax.lax.ragged_dot``) or, with a recipe, by ``jax_nvfp4.ragged_dot``.

A block routes its tokens, sorts the (token, expert) rows by expert and
calls ``experts(rows, group_sizes, key=...)`` for each of its projections;
``convert`` gives the ``Experts`` that the policy selects their recipe, as it
does for ``eqx.nn.Linear``. Under ``vmap`` (the usual per-example Equinox
model, routing each example's tokens) the enclosing maps fold, as
``Linear``'s do: all examples' rows of an expert form one group, with one
amax and one GEMM per expert over the whole batch (``fold.folded_ragged_dot``;
``jax.lax.ragged_dot`` itself has no vmap rule for per-example group sizes).
"""

from __future__ import annotations

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from jax_nvfp4.equinox.fold import folded_ragged_dot
from jax_nvfp4.equinox.key_source import _key_words, forward_only
from jax_nvfp4.recipe import Recipe

__all__ = ["Experts"]


class Experts(eqx.Module):
    """``num_experts`` projections ``in_features -> out_features``:
    ``y = ragged_dot(x, weight, group_sizes)``.

    Attributes:
      weight: [num_experts, in_features, out_features] (``lax.ragged_dot``'s
        layout); a stack (``eqx.filter_vmap``-built, run by ``lax.scan``) has
        leading layer axes.
      recipe: None (bf16: ``jax.lax.ragged_dot``) or the ``jax_nvfp4.Recipe``
        of the expert GEMMs; ``convert`` sets it.
      inference: when True and no key is given, stochastic rounding uses a
        fixed key (set by ``eqx.nn.inference_mode``; for evaluation only).
    """

    weight: jax.Array
    num_experts: int = eqx.field(static=True)
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    recipe: Recipe | None = eqx.field(static=True)
    inference: bool = False

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        dtype: Any = jnp.float32,
        recipe: Recipe | None = None,
        key: jax.Array,
    ):
        """Initialises each expert like ``eqx.nn.Linear`` (uniform in
        +-1/sqrt(in_features))."""
        bound = in_features**-0.5
        shape = (num_experts, in_features, out_features)
        self.weight = jax.random.uniform(key, shape, dtype, -bound, bound)
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.recipe = recipe
        self.inference = False

    def with_recipe(self, recipe: Recipe | None) -> Experts:
        """The same arrays with another recipe (None: bf16)."""
        template = eqx.filter_eval_shape(
            Experts,
            self.num_experts,
            self.in_features,
            self.out_features,
            dtype=self.weight.dtype,
            recipe=recipe,
            key=jax.random.key(0),
        )
        module = eqx.tree_at(lambda m: m.weight, template, self.weight)
        return eqx.tree_at(lambda m: m.inference, module, self.inference)

    def __call__(
        self, x: jax.Array, group_sizes: jax.Array, *, key: jax.Array | None = None
    ) -> jax.Array:
        """x [T, in_features] sorted by expert, group_sizes int [num_experts]
        -> [T, out_features] in x's dtype (rows past sum(group_sizes) are
        zeros). ``key``: for stochastic rounding in the backward pass (or a
        ``jax_nvfp4.equinox.keys`` block), as for ``Linear``; without one
        the forward pass runs and its gradient raises."""
        if self.weight.ndim != 3:
            raise ValueError(
                f"these Experts are a stack (weight {self.weight.shape}): call "
                "them per layer, inside a lax.scan over their arrays"
            )
        weight = self.weight.astype(x.dtype)
        product = functools.partial(folded_ragged_dot, self.recipe)
        words = None
        if self.recipe is not None:
            words = _key_words(key, self.recipe, self.inference)
            if words is None:  # as jax_nvfp4.ragged_dot without a key
                product = forward_only(folded_ragged_dot, self.recipe, "Experts")
        if words is None:
            words = jnp.zeros((2,), jnp.uint32)
        return product(x, weight, group_sizes, words)
