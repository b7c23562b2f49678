"""The weight-only GEMM primitive of serving (W4A16): bfloat16 activations
times an NVFP4 weight stored quantized along the contraction k.

  out[b, m, n] = (amax / 2688) * sum_k x[b, m, k] * e2m1(w[b', n, k]) * s

x bfloat16 [b, m, k]; the weight's codes uint8 [b', n, k/2], scales
float8_e4m3fn [b', n, k/16] and amax float32 [b'], with b' = 1 (one weight
for every item) or b. Exact products, float32 sums, alpha after them, one
rounding to ``dtype`` (bfloat16 or float32). Its twin is
``reference.w4a16_matmul``.

Lowerings: the twin on the CPU; on CUDA the GEMM that
``ops.dispatch.w4a16_path`` chooses when the computation is lowered, from
the lowering context and the shapes (``path="auto"``), or the one ``path``
names. Under sharded ``jit`` the batch, x's rows (m) and the weight's rows
(n) partition; a sharded contraction (whole 16-element blocks of k) is
summed across shards in float32 and rounded once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import reference
from jax_nvfp4.ops import batching, dispatch, primitive
from jax_nvfp4.ops.sharding import BATCH, Dim, Layout, per_item

__all__ = ["PATHS", "w4a16_matmul", "w4a16_matmul_p"]

# "auto": the dispatcher's choice; the others force one CUDA GEMM.
PATHS = ("auto", *dispatch.W4A16)


def _abstract(x, codes, scales, amax, *, dtype, path):
    del scales, amax, path
    return jax.core.ShapedArray((*x.shape[:2], codes.shape[1]), dtype)


def _layout(shapes, **_):
    """x holds 16 elements per block of k, the codes 8 bytes, the scales
    one; the contraction reduces across shards."""
    (batch, m, _), (weights, n, _), (_, _, blocks), (n_amax,) = shapes
    w_batch = Dim(BATCH) if weights == batch and batch > 1 else Dim(None)
    return Layout(
        operands=(
            (Dim(BATCH), Dim("m"), Dim("k", 16)),
            (w_batch, Dim("n"), Dim("k", 8)),
            (w_batch, Dim("n"), Dim("k")),
            (per_item(n_amax, batch),),
        ),
        results=((Dim(BATCH), Dim("m"), Dim("n")),),
        sizes={BATCH: batch, "m": m, "n": n, "k": blocks},
        granule={"k": 16},
        reduce={"k": "sum"},
        names={
            BATCH: "batch",
            "m": "row (m)",
            "n": "weight row (n)",
            "k": "contraction (k)",
        },
    )


def _batch(args, dims, *, dtype, path):
    """Folds the vmapped axis into the batch; a vmapped weight becomes one
    weight per item of the folded batch."""
    x, codes, scales, amax = args
    size = batching.batch_size(args, dims)
    batch = batching.to_front(x, dims[0], size).shape[1]
    x = batching.fold(x, dims[0], size)
    if not (all(d is None for d in dims[1:]) and codes.shape[0] == 1):

        def per_item_weight(a, d):
            a = batching.to_front(a, d, size)
            if a.shape[1] != batch:  # one weight shared by the item's batch
                a = jnp.repeat(a, batch, axis=1)
            return a.reshape(size * batch, *a.shape[2:])

        codes = per_item_weight(codes, dims[1])
        scales = per_item_weight(scales, dims[2])
        amax = batching.per_item_amax(amax, dims[3], size, batch)
    out = w4a16_matmul_p.bind(x, codes, scales, amax, dtype=dtype, path=path)
    return out.reshape(size, -1, *out.shape[1:]), 0


def _twin(x, codes, scales, amax, *, dtype, path):
    del path  # a CUDA choice
    return reference.w4a16_matmul(x, codes, scales, amax, dtype=dtype)


def _choose_cuda(ctx, *, dtype, path):
    """The CUDA lowering body: the GEMM of ``path``, or the dispatcher's for
    these shapes and the devices lowered for."""
    (batch, m, k), (weights, n, _) = ctx.avals_in[0].shape, ctx.avals_in[1].shape
    if path == "auto":
        rows = batch * m if weights == 1 else m
        path = dispatch.w4a16_path(rows, k, n, ctx, weights=weights)
    return functools.partial(dispatch.w4a16_cuda, dtype=dtype, path=path)


w4a16_matmul_p = primitive.define(
    "nvfp4_w4a16_matmul",
    None,  # no handler of its own: the CUDA rule lowers to the chosen GEMM
    _abstract,
    _twin,
    _batch,
    _layout,
    multiple=False,
    lowerings={"cuda": primitive.ChosenAtLowering(_choose_cuda)},
)


def w4a16_matmul(x, codes, scales, amax, *, dtype, path: str = "auto"):
    """x bfloat16 [b, m, k] times the weight (codes uint8 [b', n, k/2],
    scales float8_e4m3fn [b', n, k/16], amax float32 [b'], b' 1 or b) ->
    [b, m, n] of dtype (bfloat16 or float32).

    path: the CUDA GEMM, one of ``PATHS``: "auto" (the dispatcher's choice
    when lowered), "engine" (the Hopper engine, the weight decoded in
    registers; b' = 1, compute capability 9.0, K a multiple of 256),
    "handler" (the mma.sync kernel, the weight decoded in registers; b' = 1),
    "cublaslt" (the decoded weight and the cuBLASLt bf16 GEMM) or "xla" (the
    twin). A named path is lowered as asked, where its handler is built.
    Other platforms run the twin whatever the path.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    return w4a16_matmul_p.bind(x, codes, scales, amax, dtype=np.dtype(dtype), path=path)
