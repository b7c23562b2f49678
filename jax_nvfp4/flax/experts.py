"""Flax NNX expert projections: ``Experts``, a layer of G weight matrices
applied to tokens sorted by expert (``jax.lax.ragged_dot``), and
``NNXRaggedDot``, the op that runs its product by the NVFP4 recipe
(``jax_nvfp4.ragged_dot``) once ``convert`` selects it.

A mixture-of-experts block routes each token to a few experts, sorts the
(token, expert) rows by expert and runs each expert's projection on its rows;
``Experts`` is that projection, for any of an expert MLP's matrices::

    class MoE(nnx.Module):
        def __init__(self, d, ffn, experts, rngs):
            self.router = nnx.Linear(d, experts, rngs=rngs)
            self.gate = Experts(experts, d, ffn, rngs=rngs)
            ...
        def __call__(self, x):
            ...  # route, sort rows by expert, group_sizes [experts]
            h = jax.nn.silu(self.gate(rows, group_sizes)) * self.up(rows, group_sizes)

``convert(model, policy, rngs)`` treats an ``Experts`` like a dense layer:
its path (e.g. ``"layers.3.moe.gate"``) goes to the policy, and a selected
layer gets an ``NNXRaggedDot`` with its own RNG stream. Stacked (scanned)
experts get stacked RNG state, as stacked dense layers do.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_nvfp4.flax.nnx_layers import RecipeOp, _as_data
from jax_nvfp4.ragged_dot import ragged_dot

__all__ = ["Experts", "NNXRaggedDot"]

default_kernel_init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1)


class NNXRaggedDot(RecipeOp):
    """``jax.lax.ragged_dot``'s signature running the NVFP4 recipe per
    expert (``jax_nvfp4.ragged_dot``), with its own RNG stream forked from
    ``rngs[rng_collection]`` (one key per call; the count is module state, as
    in ``NNXDotGeneral``). With ``rngs=None`` it is forward-only.
    """

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        group_sizes: jax.Array,
        precision=None,
        preferred_element_type=None,
    ) -> jax.Array:
        del precision  # the recipe fixes the arithmetic
        return ragged_dot(
            lhs,
            rhs,
            group_sizes,
            key=self.next_key(),
            recipe=self.recipe,
            preferred_element_type=preferred_element_type,
        )


class Experts(nnx.Module):
    """``num_experts`` projections ``in_features -> out_features`` applied to
    rows sorted by expert: ``y = jax.lax.ragged_dot(x, kernel, group_sizes)``.

    Args:
      num_experts, in_features, out_features: the kernel is
        [num_experts, in_features, out_features].
      dtype: the computation dtype (inputs and kernel are cast to it), e.g.
        bfloat16 with float32 ``param_dtype`` master weights.
      param_dtype: the kernel's dtype.
      kernel_init: initializer of the [G, K, N] kernel.
      ragged_dot: the op (``lax.ragged_dot``'s signature); None runs
        ``jax.lax.ragged_dot``. ``convert`` sets an ``NNXRaggedDot``.
      rngs: for the kernel's initialization.
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init=default_kernel_init,
        precision=None,
        ragged_dot: NNXRaggedDot | None = None,
        rngs: nnx.Rngs,
    ):
        shape = (num_experts, in_features, out_features)
        self.kernel = nnx.Param(kernel_init(rngs.params(), shape, param_dtype))
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.precision = precision
        self.ragged_dot = _as_data(ragged_dot)

    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """x [T, in_features] sorted by expert, group_sizes int32 [G] -> [T,
        out_features] (rows past sum(group_sizes) are zeros)."""
        kernel = self.kernel[...]
        dtype = self.dtype or jnp.result_type(x, kernel)
        x, kernel = x.astype(dtype), kernel.astype(dtype)
        if self.ragged_dot is None:
            return jax.lax.ragged_dot(x, kernel, group_sizes, precision=self.precision)
        return self.ragged_dot(x, kernel, group_sizes)
