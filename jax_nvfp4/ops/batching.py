"""vmap helpers: the handlers take a leading batch axis [batch, ...], so a
vmapped axis is folded into it and unfolded from the results."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = [
    "batch_size",
    "fold",
    "fold_per_item",
    "per_batch_item",
    "per_item_amax",
    "to_front",
    "unfold",
]


def batch_size(args, dims) -> int:
    return next(a.shape[d] for a, d in zip(args, dims, strict=False) if d is not None)


def to_front(a, d, size):
    """Moves the vmapped axis d of a to the front (broadcasting if unmapped)."""
    if d is None:  # batching.not_mapped
        return jnp.broadcast_to(a, (size, *a.shape))
    return jnp.moveaxis(a, d, 0)


def fold(a, d, size):
    """[size, b, ...] -> [size * b, ...]."""
    a = to_front(a, d, size)
    return a.reshape(size * a.shape[1], *a.shape[2:])


def fold_per_item(a, d, size, width=1):
    """Per-batch-item arrays (amax [n], key [n, 2]) -> [size * n, ...]."""
    a = to_front(a, d, size)
    return a.reshape(-1, width) if width > 1 else a.reshape(-1)


def per_batch_item(a, d, size, batch, width=1):
    """Folds a per-item operand and repeats it to one entry per item of the
    folded batch, so that a sharded batch axis carries its amaxes and keys
    along (a [n] operand with 1 < n < batch could not follow the batch's
    sharding)."""
    a = fold_per_item(a, d, size, width)
    return jnp.repeat(a, batch // a.shape[0], axis=0) if a.shape[0] != batch else a


def per_item_amax(amax, d, size, count):
    """amax with 1 or ``count`` values per vmapped item -> [size * count]."""
    amax = to_front(amax, d, size).reshape(size, -1)
    if amax.shape[1] == 1:
        amax = jnp.repeat(amax, count, axis=1)
    return amax.reshape(-1)


def unfold(outs, size):
    outs = [o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outs]
    return outs, [0] * len(outs)
