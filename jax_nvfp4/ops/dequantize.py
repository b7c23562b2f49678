"""The dequantize primitive: codes [b, r, l/2], scales [b, r, l/16] and
amax [1 or b] -> values [b, r, l] of a float dtype."""

from __future__ import annotations

import jax
import numpy as np

from jax_nvfp4 import reference
from jax_nvfp4.ops import batching, primitive
from jax_nvfp4.ops.sharding import BATCH, Dim, Layout, per_item

__all__ = ["dequantize", "dequantize_p"]


def _abstract(codes, scales, amax, *, dtype):
    b, r, half = codes.shape
    return jax.core.ShapedArray((b, r, 2 * half), dtype)


def _layout(shapes, **_):
    (batch, rows, half), _, (n_amax,) = shapes
    return Layout(
        operands=(
            (Dim(BATCH), Dim("r"), Dim("l", 8)),
            (Dim(BATCH), Dim("r"), Dim("l")),
            (per_item(n_amax, batch),),
        ),
        results=((Dim(BATCH), Dim("r"), Dim("l", 16)),),
        sizes={BATCH: batch, "r": rows, "l": half // 8},
        granule={"l": 16},
        names={BATCH: "batch", "r": "row", "l": "quantized"},
    )


def _batch(args, dims, *, dtype):
    codes, scales, amax = args
    size = batching.batch_size(args, dims)
    codes = batching.fold(codes, dims[0], size)
    out = dequantize_p.bind(
        codes,
        batching.fold(scales, dims[1], size),
        batching.per_batch_item(amax, dims[2], size, codes.shape[0]),
        dtype=dtype,
    )
    return out.reshape(size, -1, *out.shape[1:]), 0


dequantize_p = primitive.define(
    "nvfp4_dequantize",
    "jax_nvfp4_dequantize",
    _abstract,
    reference.dequantize,
    _batch,
    _layout,
    multiple=False,
    drop=("dtype",),
)


def dequantize(codes, scales, amax, *, dtype):
    return dequantize_p.bind(codes, scales, amax, dtype=np.dtype(dtype))
