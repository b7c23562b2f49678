"""The amax primitive: x [batch, m, k] -> float32 [batch, 2], per batch item
(max |x|, max |bf16(RHT(x))|), the Random Hadamard Transform running along k
(as quantize's ``rows`` transform) or, with ``cols``, along m (as ``cols``).
One read of x gives both amaxes that a transformed column-wise copy and a
plain row-wise copy need."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_nvfp4 import reference
from jax_nvfp4.ops import batching, primitive
from jax_nvfp4.ops.sharding import BATCH, Dim, Layout

__all__ = ["amax", "amax_p"]


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
