"""Equinox integration: an NVFP4 stand-in for ``eqx.nn.Linear`` and ``convert``.

``Linear`` holds the same ``weight`` (out, in) and ``bias`` (out,) as
``eqx.nn.Linear`` and computes ``y = x @ weight.T + bias`` with
``jax_nvfp4.dot`` (the FPROP / DGRAD / WGRAD recipe). ``convert(model,
policy)`` swaps every ``eqx.nn.Linear`` that the policy puts in NVFP4 for a
``Linear`` holding the same arrays, with ``eqx.tree_at``; the other layers are
left untouched (bit-identical to the original model).

Batching: what folds where. Equinox layers are written per example and run
under ``jax.vmap``. Run literally, that would quantize and multiply each
example on its own: one sequence (or one token) padded to a block of 16 for
the token-axis quantization, a per-example amax, and a per-example weight
gradient [batch, in, out] that is then summed. ``Linear`` instead folds the
enclosing ``vmap``s into the token axis: it binds a primitive whose batching
rule reshapes x [batch, ..., in] to [batch * ..., in] and calls the layer's
product again, so nested maps (batch x sequence positions) fold into one
``dot`` over all tokens -- three GEMMs in all, with the weight gradient
reduced inside WGRAD -- exactly the computation of ``dot`` on the folded
tokens, forward and backward. The fold reaches through the bodies that JAX
traces into a jaxpr and that a ``vmap`` then batches as a whole: a
``lax.scan`` over stacked layers, ``jax.checkpoint`` (with or without a
policy such as ``save_fp4_residuals``), ``jit``, ``lax.cond``. So
``jax.vmap(model)`` of a model that scans its blocks runs one GEMM per layer
over all of the batch's tokens (batch 3 x 40 positions: one GEMM of 120
tokens, not three of 40 padded to 48), under ``grad`` too.

The primitive is bound only where the innermost transformation is a
``vmap``, or a chain of such traced bodies whose first enclosing
transformation is a ``vmap`` (read from JAX's trace state; where the names
it reads are missing, the layer never folds). Its batching rule folds; if it
is differentiated before any ``vmap`` batched it -- the ``vmap`` mapped none
of the scan's operands and handed the scan on unbatched -- its derivative is
that of the plain ``dot``, and evaluated or compiled unbatched it is the plain
``dot``. Where the innermost transformation is ``grad`` or ``jit`` -- in
particular ``jax.vmap(jax.grad(loss))`` for per-example gradients, or a scan
inside ``grad`` inside ``vmap`` -- the layer calls ``dot`` directly and JAX
batches it per example: correct (a per-example amax and weight gradient, as
such a computation asks for), without the fold. A weight mapped by the
``vmap`` (an ensemble) is not folded either. Explicitly sharded operands
(``jax.sharding.AxisType.Explicit``) are not folded.

Stacked layers. ``eqx.filter_vmap(make_block)(keys)`` builds blocks whose
arrays have a leading layer axis, run by ``lax.scan``; an ``eqx.nn.Linear``
in there has weight [L, out, in]. ``convert`` makes it one stacked
``Linear`` (weight [L, out, in]) so each scan step sees an ordinary
``Linear``. The policy decides per layer with ``Policy.stack_recipes``: the
rules see the stack's path (no block index, e.g. ``"layers.mlp.up_proj"``),
and ``keep_last`` puts the last blocks of a stack of ``num_layers`` blocks
in bf16. Such a mixed stack holds a per-layer switch ``nvfp4`` (bool [L],
sliced by the scan like the weight); each step then picks the NVFP4 product
or the bf16 one (``eqx.nn.Linear``'s own computation) with ``lax.cond``.
Under ``grad`` a ``cond`` keeps the residuals of both branches, so a mixed
stack saves x in bf16 as well as its FP4 copy (``jax.checkpoint`` with
``save_fp4_residuals`` around the scan body keeps only the FP4 ones); to
avoid the cond, keep the last blocks out of the stack.

Keys. Stochastic rounding of the backward pass needs a key, a new one each
step, when the recipe uses it (``Recipe.needs_key``). A layer takes it from,
in this order: ``layer(x, key=key)``; else the innermost active
``with jax_nvfp4.equinox.keys(step_key):``, from which each call draws
``fold_in(step_key, n)`` with n counting the calls made in that block while
JAX traces it (for models such as ``eqx.nn.MLP`` that pass no key to their
layers); else, in inference mode (``eqx.nn.inference_mode(model)``, where no
gradient is expected), a fixed key; else none, and the layer runs as
``jax_nvfp4.dot`` does without a key: the forward pass (the same output as
with any key: stochastic rounding is for dY only), whose gradient raises a
ValueError saying how to pass a key. The count runs at trace
time: a ``lax.scan`` body is traced once, so every layer of a scanned stack
draws the same key from an enclosing ``keys`` block -- pass per-layer keys
through the scan instead (``key=`` or a ``keys(layer_key)`` block inside the
body). Enter ``keys`` inside the jitted step with the step's key as an
argument: a key captured from outside a traced function would be a constant
of the compiled step (the same bits every step), which raises. Under
``vmap`` pass one key for the whole batch (``in_axes=None``, as usual for a
model's key) or a key per example: the fold makes one ``dot`` over the
whole batch, so a batch of keys is reduced to the first one. Either way every
element of the folded tensor draws its own random bits (they are indexed by
the element's position in the folded tensor).
"""

from jax_nvfp4.equinox.conversion import convert, linear_paths, plan
from jax_nvfp4.equinox.experts import Experts
from jax_nvfp4.equinox.key_source import keys
from jax_nvfp4.equinox.linear import Linear

__all__ = ["Experts", "Linear", "convert", "keys", "linear_paths", "plan"]
