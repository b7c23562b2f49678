"""The grouped weight-only GEMM primitive of serving (W4A16 ``ragged_dot``):
bfloat16 rows sorted by group times one NVFP4 weight per group (a
mixture-of-experts layer's experts, as an imported checkpoint holds them).

  out[t, n] = (amax[g] / 2688) * sum_k x[t, k] * e2m1(w[g, n, k]) * s

for row t in group g; x bfloat16 [T, k] with group g's rows after group
g-1's (``group_sizes`` int32 [G]); the weights' codes uint8 [G, n, k/2],
scales float8_e4m3fn [G, n, k/16] and amax float32 [G]. Rows past the
sizes' sum are zeros. Exact products, float32 sums, alpha after them, one
rounding to ``dtype``. Its twin is ``reference.ragged_w4a16_matmul``.

Lowerings: the twin on the CPU; on CUDA the GEMM that
``ops.dispatch.ragged_w4a16_path`` chooses when the computation is lowered
(``path="auto"``), or the one ``path`` names. Under sharded ``jit`` the
weights' rows (n) partition, and a sharded contraction (whole 16-element
blocks of k) is summed across shards in float32 and rounded once; x's rows
and the groups stay whole (a shard of rows would need its own sizes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_nvfp4 import reference
from jax_nvfp4.ops import batching, dispatch, primitive
from jax_nvfp4.ops.sharding import Dim, Layout

__all__ = ["PATHS", "ragged_w4a16_matmul", "ragged_w4a16_matmul_p"]

# "auto": the dispatcher's choice; the others force one CUDA GEMM.
PATHS = ("auto", *dispatch.RAGGED_W4A16)


def _abstract(x, codes, scales, amax, group_sizes, *, dtype, path):
    del scales, amax, group_sizes, path
    return jax.core.ShapedArray((x.shape[0], codes.shape[1]), dtype)


def _layout(shapes, **_):
    """x holds 16 elements per block of k, the codes 8 bytes, the scales
    one; the contraction reduces across shards."""
    (rows, _), (groups, n, _), (_, _, blocks), _, _ = shapes
    whole = (Dim(None),)
    return Layout(
        operands=(
            (Dim(None), Dim("k", 16)),
            (Dim(None), Dim("n"), Dim("k", 8)),
            (Dim(None), Dim("n"), Dim("k")),
            whole,
            whole,
        ),
        results=((Dim(None), Dim("n")),),
        sizes={"n": n, "k": blocks},
        granule={"k": 16},
        reduce={"k": "sum"},
        names={"n": "weight row (n)", "k": "contraction (k)"},
    )


def _batch(args, dims, *, dtype, path):
    """One grouped GEMM per vmapped item, in turn (each item has its own
    groups, so items cannot be folded into one launch's rows)."""
    size = batching.batch_size(args, dims)
    stacked = [batching.to_front(a, d, size) for a, d in zip(args, dims, strict=True)]

    def one(item):
        return ragged_w4a16_matmul_p.bind(*item, dtype=dtype, path=path)

    return lax.map(one, stacked), 0


def _twin(x, codes, scales, amax, group_sizes, *, dtype, path):
    del path  # a CUDA choice
    return reference.ragged_w4a16_matmul(
        x, codes, scales, amax, group_sizes, dtype=dtype
    )


def _choose_cuda(ctx, *, dtype, path):
    """The CUDA lowering body: the GEMM of ``path``, or the dispatcher's for
    these shapes and the devices lowered for."""
    (_, k), (_, n, _) = ctx.avals_in[0].shape, ctx.avals_in[1].shape
    if path == "auto":
        path = dispatch.ragged_w4a16_path(k, n, ctx)
    return functools.partial(dispatch.ragged_w4a16_cuda, dtype=dtype, path=path)


ragged_w4a16_matmul_p = primitive.define(
    "nvfp4_ragged_w4a16_matmul",
    None,  # no handler of its own: the CUDA rule lowers to the chosen GEMM
    _abstract,
    _twin,
    _batch,
    _layout,
    multiple=False,
    lowerings={"cuda": primitive.ChosenAtLowering(_choose_cuda)},
)


def ragged_w4a16_matmul(
    x, codes, scales, amax, group_sizes, *, dtype, path: str = "auto"
):
    """x bfloat16 [T, k] (rows sorted by group) times the weights (codes
    uint8 [G, n, k/2], scales float8_e4m3fn [G, n, k/16], amax float32 [G]),
    group g's rows (``group_sizes`` int32 [G]) by weight g -> [T, n] of
    dtype (bfloat16 or float32); rows past the sizes' sum are zeros.

    path: the CUDA GEMM, one of ``PATHS``: "auto" (the dispatcher's choice
    when lowered), "engine" (the Hopper engine's grouped form; compute
    capability 9.0, K a multiple of 256) or "xla" (the twin). Other
    platforms run the twin whatever the path.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    return ragged_w4a16_matmul_p.bind(
        x,
        codes,
        scales,
        jnp.asarray(amax, jnp.float32).reshape(-1),
        jnp.asarray(group_sizes, jnp.int32),
        dtype=np.dtype(dtype),
        path=path,
    )
