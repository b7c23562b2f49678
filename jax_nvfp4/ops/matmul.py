"""The matmul primitive: out [b, m, n] = alpha * sum_k a[b, m, k] b[b', n, k]
over two NVFP4 operands (codes, scales, amax each), alpha = (A_a / 2688) *
(A_b / 2688), float32 accumulation.

Lowerings: the CPU handler (exact products, summed over k in order); on CUDA
the GEMM that ``ops.dispatch`` chooses when the computation is lowered.
An operand's codes may instead hold its bfloat16 values e2m1 * scale
[b, rows, K] (``reference.gemm.is_decoded``): a ``DecodedOperand``'s, what
the fused quantize writes for operands that only feed a GEMM on the Hopper
path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import reference
from jax_nvfp4.ops import batching, dispatch, primitive
from jax_nvfp4.ops.sharding import BATCH, Dim, Layout, per_item
from jax_nvfp4.reference.gemm import is_decoded

__all__ = ["matmul", "matmul_p"]


def _abstract(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, *, dtype):
    return jax.core.ShapedArray((*a_codes.shape[:2], b_codes.shape[1]), dtype)


def _layout(shapes, **_):
    """Codes hold 8 bytes per 16-element block of k, decoded operands (their
    bfloat16 values) 16; the contraction reduces across shards."""
    (batch, m, a_len), (_, _, blocks), (n_a,), (batch_b, n, b_len), _, (n_b,) = shapes
    a_decoded = a_len == 16 * blocks != 0
    b_decoded = b_len == 16 * blocks != 0
    b_batch = Dim(BATCH) if batch_b == batch and batch > 1 else Dim(None)
    return Layout(
        operands=(
            (Dim(BATCH), Dim("m"), Dim("k", 16 if a_decoded else 8)),
            (Dim(BATCH), Dim("m"), Dim("k")),
            (per_item(n_a, batch),),
            (b_batch, Dim("n"), Dim("k", 16 if b_decoded else 8)),
            (b_batch, Dim("n"), Dim("k")),
            (per_item(n_b, batch) if n_b == batch_b else Dim(None),),
        ),
        results=((Dim(BATCH), Dim("m"), Dim("n")),),
        sizes={BATCH: batch, "m": m, "n": n, "k": blocks},
        granule={"k": 16},
        reduce={"k": "sum"},
        names={
            BATCH: "batch",
            "m": "row (m)",
            "n": "column (n)",
            "k": "contraction (k)",
        },
    )


def _batch(args, dims, *, dtype):
    """Folds the vmapped axis into the GEMM batch; amaxes become per item."""
    size = batching.batch_size(args, dims)
    (a_codes, a_scales, a_amax, b_codes, b_scales, b_amax) = args
    per_a = batching.to_front(a_codes, dims[0], size).shape[1]
    a_codes = batching.fold(a_codes, dims[0], size)
    a_scales = batching.fold(a_scales, dims[1], size)
    a_amax = batching.per_item_amax(a_amax, dims[2], size, per_a)
    if not (all(d is None for d in dims[3:]) and b_codes.shape[0] == 1):
        per_b = batching.to_front(b_codes, dims[3], size).shape[1]
        b_codes = batching.fold(b_codes, dims[3], size)
        b_scales = batching.fold(b_scales, dims[4], size)
        b_amax = batching.per_item_amax(b_amax, dims[5], size, per_b)
        if per_b != per_a:  # one b matrix per item, shared by a's batch
            b_codes = jnp.repeat(b_codes, per_a, axis=0)
            b_scales = jnp.repeat(b_scales, per_a, axis=0)
            b_amax = jnp.repeat(b_amax, per_a)
    out = matmul_p.bind(
        a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, dtype=dtype
    )
    return out.reshape(size, -1, *out.shape[1:]), 0


def _choose_cuda(ctx, *, dtype):
    """The CUDA lowering body: the dispatcher's GEMM for the devices the
    computation is compiled for."""
    path = dispatch.dense_path(ctx)
    return functools.partial(dispatch.matmul_cuda, dtype=dtype, path=path)


matmul_p = primitive.define(
    "nvfp4_matmul",
    "jax_nvfp4_matmul",
    _abstract,
    reference.matmul,
    _batch,
    _layout,
    multiple=False,
    drop=("dtype",),
    lowerings={"cuda": primitive.ChosenAtLowering(_choose_cuda)},
    # The CPU handler multiplies codes; decoded operands take the twin there.
    handler_applies=lambda avals: not (is_decoded(avals[0]) or is_decoded(avals[3])),
)


def matmul(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, *, dtype):
    """An operand's codes may be its bfloat16 values e2m1 * scale [batch,
    rows, K] (a ``DecodedOperand``'s)."""
    return matmul_p.bind(
        a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, dtype=np.dtype(dtype)
    )
