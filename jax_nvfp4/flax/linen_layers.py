"""Flax linen layers running the NVFP4 recipe: ``LinenDotGeneral`` (for
``nn.Dense`` / ``nn.DenseGeneral``) and ``LinenEinsum`` (``nn.Einsum``'s
parameters). Each call draws its key with ``self.make_rng`` from the
layer's RNG stream."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen

from jax_nvfp4.flax import products
from jax_nvfp4.flax.products import DEFAULT_RNG_COLLECTION
from jax_nvfp4.recipe import NVFP4, Recipe

__all__ = ["LinenDotGeneral", "LinenEinsum"]


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
        products.check_recipe(self.recipe)
        key = None
        if self.recipe.needs_key and self.has_rng(self.rng_collection):
            key = self.make_rng(self.rng_collection)
        return products.layer_dot_general(
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


class LinenEinsum(linen.Einsum):
    """``nn.Einsum`` running the NVFP4 recipe (linen's ``Einsum`` takes no
    ``dot_general``): the same parameters, shapes and bias as ``nn.Einsum``,
    with the einsum's products through ``jax_nvfp4.dot_general``::

        proj = LinenEinsum((512, 8, 64), "BTD,DNH->BTNH", recipe=NVFP4)
        y = proj.apply(variables, x, rngs={"nvfp4": step_key})

    Weight-like equations (no index shared by input, kernel and output) run
    the recipe, with K (the contracted kernel axes) and N (the kept ones)
    multiples of 16; an equation with batch indices runs in the input
    precision. Keys come from the ``rng_collection`` stream as in
    ``LinenDotGeneral``.

    Attributes (besides ``nn.Einsum``'s):
      recipe: the NVFP4 recipe.
      rng_collection: the name of the RNG stream that supplies the keys.
    """

    recipe: Recipe = NVFP4
    rng_collection: str = DEFAULT_RNG_COLLECTION

    @linen.compact
    def __call__(self, inputs: jax.Array, einsum_str: str | None = None) -> jax.Array:
        products.check_recipe(self.recipe)
        spec = linen.module.merge_param("einsum_str", self.einsum_str, einsum_str)
        spec = spec.replace(" ", "")
        if "->" not in spec or spec.count(",") != 1:
            raise ValueError(
                f"einsum_str {spec!r} must be explicit ('->') with two operands, "
                "the input and the kernel"
            )
        kernel = self.param("kernel", self.kernel_init, self.shape, self.param_dtype)
        bias, bias_view = None, None
        if self.use_bias:
            bias_shape, bias_view = self._get_bias_shape(spec, inputs, kernel)
            bias = self.param("bias", self.bias_init, bias_shape, self.param_dtype)
        inputs, kernel, bias = self.promote_dtype(
            inputs, kernel, bias, dtype=self.dtype
        )
        key = None
        if self.recipe.needs_key and self.has_rng(self.rng_collection):
            key = self.make_rng(self.rng_collection)
        product = functools.partial(
            products.switched_dot_general,
            recipe=self.recipe,
            key=key,
            enabled=None,
            rng_collection=self.rng_collection,
        )
        y = jnp.einsum(
            spec,
            inputs,
            kernel,
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
            _dot_general=product,
        )
        if bias is not None:
            y += jnp.reshape(bias, bias_view)
        return y
