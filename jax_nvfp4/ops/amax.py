"""The amax primitive: x [batch, m, k] -> float32 [batch, 2], per batch item
(max |x|, max |bf16(RHT(x))|), the Random Hadamard Transform running along k
(as quantize's ``rows`` transform) or, with ``cols``, along m (as ``cols``).
One read of x gives both amaxes that a transformed column-wise copy and a
plain row-wise copy need.

The abs_max primitive: x [batch, m, k] -> float32 [batch], max |x| per batch
item, the plain amax alone. Its handler is the CPU's (XLA:CPU reduces the
finite-only maximum of ``reference.abs_max`` several times slower than a
plain ``max(abs(x))``); elsewhere it lowers to that twin."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_nvfp4 import reference
from jax_nvfp4.ops import batching, primitive, sharding
from jax_nvfp4.ops.sharding import BATCH, Dim, Layout

__all__ = ["abs_max", "abs_max_p", "amax", "amax_p"]


def _abstract(x, *, cols):
    return jax.core.ShapedArray((x.shape[0], 2), jnp.float32)


def _layout(shapes, *, cols):
    """The transformed axis holds 16-element chunks; both axes reduce."""
    ((batch, m, k),) = shapes
    m_blocked, k_blocked = cols, not cols
    return Layout(
        operands=(
            (
                Dim(BATCH),
                Dim("m", 16 if m_blocked else 1),
                Dim("k", 16 if k_blocked else 1),
            ),
        ),
        results=((Dim(BATCH), Dim(None)),),
        sizes={
            BATCH: batch,
            "m": m // 16 if m_blocked else m,
            "k": k // 16 if k_blocked else k,
        },
        granule={"m": 16 if m_blocked else 1, "k": 16 if k_blocked else 1},
        reduce={"m": "max", "k": "max"},
        names={BATCH: "batch", "m": "row (m)", "k": "column (k)"},
    )


def _batch(args, dims, *, cols):
    (x,), (xd,) = args, dims
    size = batching.batch_size(args, dims)
    out = amax_p.bind(batching.fold(x, xd, size), cols=cols)
    return out.reshape(size, -1, 2), 0


amax_p = primitive.define(
    "nvfp4_amax",
    "jax_nvfp4_amax",
    _abstract,
    reference.amax,
    _batch,
    _layout,
    multiple=False,
)


def amax(x, *, cols: bool):
    """x [b, m, k] -> [b, 2]: (plain amax, RHT amax along m if cols else k)."""
    return amax_p.bind(x, cols=bool(cols))


def _abs_max_abstract(x):
    return jax.core.ShapedArray((x.shape[0],), jnp.float32)


def _abs_max_layout(shapes):
    ((batch, m, k),) = shapes
    return Layout(
        operands=((Dim(BATCH), Dim("m"), Dim("k")),),
        results=((Dim(BATCH),),),
        sizes={BATCH: batch, "m": m, "k": k},
        granule={"m": 1, "k": 1},
        reduce={"m": "max", "k": "max"},
        names={BATCH: "batch", "m": "row (m)", "k": "column (k)"},
    )


def _abs_max_batch(args, dims):
    (x,), (xd,) = args, dims
    size = batching.batch_size(args, dims)
    out = abs_max_p.bind(batching.fold(x, xd, size))
    return out.reshape(size, -1), 0


def _abs_max_reference(x):
    return jax.vmap(reference.abs_max)(x.reshape(x.shape[0], -1))


abs_max_p = primitive.define(
    "nvfp4_abs_max",
    "jax_nvfp4_abs_max",
    _abs_max_abstract,
    _abs_max_reference,
    _abs_max_batch,
    _abs_max_layout,
    multiple=False,
)


def abs_max(x):
    """max |x| over the finite elements of x (any shape), float32: the values
    of ``reference.abs_max``, the same signature."""
    if sharding.explicit_mesh((x,)) is not None:
        # Typed with Explicit mesh axes: the reshape below would need an
        # out_sharding; XLA's own reduce partitions as the type says.
        return reference.abs_max(x)
    if x.ndim < 2 or not x.size:
        return reference.abs_max(x)
    x3 = x.reshape(math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])
    return jnp.max(abs_max_p.bind(x3))
