"""``calibrate``: the input amaxes of a model's NVFP4 layers over sample
batches, for export."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4.quantize import global_amax

__all__ = ["calibrate"]


def calibrate(
    forward_fn: Callable[[Any, Callable[[str, jax.Array], jax.Array]], Any],
    batches: Iterable[Any],
    *,
    jit: bool = True,
) -> dict[str, float]:
    """Activation amaxes for ``export_nvfp4``'s ``input_amax``.

    ``forward_fn(batch, record)`` runs the model on one batch and passes each
    linear layer's input through ``record(name, x)`` (which returns ``x``),
    e.g. ``y = record("model.layers.0.mlp.up_proj", h) @ w_up.T``. The result
    is ``{name: max over batches of jax_nvfp4.global_amax(x)}`` (NaN and inf
    left out, as the quantizer does). With ``jit`` each batch runs as one
    jitted computation; ``record`` must then be called in ``forward_fn``'s own
    trace, not inside a ``lax.scan`` or an inner ``jax.jit`` (record those
    layers' amaxes as outputs of the scan and take their max instead).
    Pass the model's weights in each batch (e.g. ``batches = [(params, b)
    for b in data]``) rather than closing over them: arrays a jitted
    function closes over become constants of its compiled computation, which
    for a large model is slow to compile.
    """

    def run(batch):
        seen: dict[str, jax.Array] = {}

        def record(name: str, x: jax.Array) -> jax.Array:
            amax = global_amax(x)
            seen[name] = jnp.maximum(seen[name], amax) if name in seen else amax
            return x

        forward_fn(batch, record)
        return seen

    step = jax.jit(run) if jit else run
    out: dict[str, np.float32] = {}
    for batch in batches:
        for name, amax in step(batch).items():
            amax = np.float32(amax)
            out[name] = max(out[name], amax) if name in out else amax
    if not out:
        raise ValueError(
            "calibrate saw no activations: forward_fn must call record(name, x) "
            "on each linear layer's input (and batches must not be empty)"
        )
    return {name: float(amax) for name, amax in out.items()}
