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

from jax_nvfp4.flax.conversion import convert, nvfp4_layers
from jax_nvfp4.flax.experts import Experts, NNXRaggedDot
from jax_nvfp4.flax.linen_layers import LinenDotGeneral, LinenEinsum
from jax_nvfp4.flax.nnx_layers import NNXDotGeneral, NNXEinsumOp, NVFP4Enabled
from jax_nvfp4.flax.products import DEFAULT_RNG_COLLECTION

__all__ = [
    "DEFAULT_RNG_COLLECTION",
    "Experts",
    "LinenDotGeneral",
    "LinenEinsum",
    "NNXDotGeneral",
    "NNXEinsumOp",
    "NNXRaggedDot",
    "NVFP4Enabled",
    "convert",
    "nvfp4_layers",
]
