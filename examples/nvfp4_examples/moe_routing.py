"""Top-k routing for the examples' mixture-of-experts blocks (Flax and
Equinox share it): tokens to (token, expert) rows sorted by expert, and back.

The expert projections then run as ``ragged_dot(rows, w [E, K, N],
group_sizes)`` -- ``jax.lax.ragged_dot`` in bf16, ``jax_nvfp4.ragged_dot``
in NVFP4 -- one GEMM per expert over its rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import jax_nvfp4 as nv


def route(tokens: jax.Array, logits: jax.Array, top_k: int):
    """tokens [T, d], router logits [T, E] -> (rows [T * top_k, d] sorted by
    expert, group_sizes int32 [E], order [T * top_k], weights [T, top_k]).

    Each token goes to its top_k experts, weighted by the softmax of the
    logits renormalised over those (float32). ``order[i]`` is the flat
    (token, slot) index of row i, for ``combine``.
    """
    experts = logits.shape[-1]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    # The choice is labelled for remat policies (nv.save_fp4_residuals keeps
    # it): the backward pass must route as the forward pass did, since the
    # experts' FP4 residuals are laid out by that routing; recomputed, a
    # token near a tie may choose another expert.
    chosen = checkpoint_name(jax.lax.top_k(probs, top_k)[1], nv.ROUTING)
    weights = jnp.take_along_axis(probs, chosen, axis=-1)  # [T, top_k]
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = tokens[order // top_k]
    group_sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    return rows, group_sizes, order, weights


def combine(rows: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """Expert outputs rows [T * top_k, d] (in ``route``'s order) -> [T, d]:
    each token's top_k outputs summed with their router weights."""
    tokens, top_k = weights.shape
    unsorted = jnp.zeros_like(rows).at[order].set(rows)
    per_slot = unsorted.reshape(tokens, top_k, -1).astype(jnp.float32)
    return jnp.sum(per_slot * weights[..., None], axis=1).astype(rows.dtype)
