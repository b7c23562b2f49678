"""The matmul primitive: out [b, m, n] = alpha * sum_k a[b, m, k] b[b', n, k]
over two NVFP4 operands (codes, scales, amax each), alpha = (A_a / 2688) *
(A_b / 2688), float32 accumulation.

Lowerings: the CPU handler (exact products, summed over k in order); on CUDA,
the GEMM chosen when the computation is lowered (``gemm_path``):

1. ``"native_fp4"``: Blackwell's block-scaled FP4 GEMM
   (``backends.blackwell``), on GPUs of compute capability >= 10.0;
2. ``"cublaslt_bf16"``: the exact decode to bfloat16 and one cuBLASLt bf16
   GEMM with alpha in its epilogue (``backends.hopper``), from 8.0 on;
3. ``"xla_bf16"``: the same decode and XLA's bf16 GEMM, alpha after
   (``reference.matmul_dequantize_bf16``), where neither handler applies.

An operand's codes may instead hold its bfloat16 values e2m1 * scale
[b, rows, K] (``format.holds_values``): what the fused quantize writes for
operands that only feed a GEMM on path 2 (``gemm_takes_values``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import config, reference
from jax_nvfp4.backends import blackwell, devices, hopper, library
from jax_nvfp4.format import holds_values
from jax_nvfp4.ops import batching, primitive
from jax_nvfp4.ops.sharding import BATCH, Dim, Layout, per_item

__all__ = ["gemm_path", "gemm_takes_values", "matmul", "matmul_cuda", "matmul_p"]


def gemm_path(target: Sequence[Any] | None = None) -> str:
    """The GEMM the CUDA lowering uses for these devices (None: the CUDA
    backend's): ``"native_fp4"``, ``"cublaslt_bf16"`` or ``"xla_bf16"``."""
    lowered_for = devices.lowering_devices(target)
    if blackwell.native_fp4_supported(lowered_for):
        return "native_fp4"
    if hopper.cublaslt_gemm_supported(lowered_for):
        return "cublaslt_bf16"
    return "xla_bf16"


def gemm_takes_values(dtype) -> bool:
    """Whether quantizations that only feed a GEMM should write its bfloat16
    operands (decoded NVFP4Tensors) instead of codes it would decode right
    after: on the cuBLASLt bf16 path when the GPU is the default backend, for
    bfloat16 inputs. Same values either way; it saves the codes' write, their
    read and the decode kernel. ``JAX_NVFP4_DECODED_OPERANDS=0`` turns it off
    (read when traced)."""
    return (
        config.enabled("JAX_NVFP4_DECODED_OPERANDS")
        and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
        and jax.default_backend() == "gpu"
        and gemm_path() == "cublaslt_bf16"
    )


def matmul_cuda(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, *, dtype):
    """The CUDA lowering body: the GEMM of ``gemm_path``. Decoded operands
    take a bf16 GEMM on any GPU."""
    path = gemm_path()
    decoded = holds_values(a_codes) or holds_values(b_codes)
    if path == "cublaslt_bf16" or (path == "native_fp4" and decoded):
        fn = functools.partial(
            hopper.matmul_bf16,
            decode_handler=hopper.DECODE_TARGET in library.targets_on("cuda"),
        )
    elif path == "native_fp4":
        fn = blackwell.matmul_native
    else:
        fn = reference.matmul_dequantize_bf16
    return fn(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, dtype=dtype)


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


matmul_p = primitive.define(
    "nvfp4_matmul",
    "jax_nvfp4_matmul",
    _abstract,
    reference.matmul,
    _batch,
    _layout,
    multiple=False,
    drop=("dtype",),
    lowerings={"cuda": matmul_cuda},
    # The CPU handler multiplies codes; decoded operands take the twin there.
    handler_applies=lambda avals: (
        not (holds_values(avals[0]) or holds_values(avals[3]))
    ),
)


def matmul(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, *, dtype):
    """An operand's codes may be its bfloat16 values e2m1 * scale [batch,
    rows, K] (a decoded NVFP4Tensor's)."""
    return matmul_p.bind(
        a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, dtype=np.dtype(dtype)
    )
