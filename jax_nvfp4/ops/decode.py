"""The bf16 decode primitive: codes [b, r, l/2] and scales [b, r, l/16] ->
bfloat16 values e2m1(code) * s_b [b, r, l], exact, without the amax.

The operands of the bf16 GEMMs (``reference.decode_bf16``, its twin). On
CUDA the handler ``jax_nvfp4_decode_bf16`` (one kernel at about copy speed);
elsewhere the twin. Rows and the batch partition; the quantized axis in
whole 16-element blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_nvfp4 import reference
from jax_nvfp4.backends import bf16_gemm
from jax_nvfp4.ops import batching, primitive
from jax_nvfp4.ops.sharding import BATCH, Dim, Layout

__all__ = ["decode_bf16", "decode_bf16_p"]


def _abstract(codes, scales):
    batch, rows, half = codes.shape
    return jax.core.ShapedArray((batch, rows, 2 * half), jnp.bfloat16)


def _layout(shapes, **_):
    (batch, rows, half), _ = shapes
    return Layout(
        operands=(
            (Dim(BATCH), Dim("r"), Dim("l", 8)),
            (Dim(BATCH), Dim("r"), Dim("l")),
        ),
        results=((Dim(BATCH), Dim("r"), Dim("l", 16)),),
        sizes={BATCH: batch, "r": rows, "l": half // 8},
        granule={"l": 16},
        names={BATCH: "batch", "r": "row", "l": "quantized"},
    )


def _batch(args, dims):
    codes, scales = args
    size = batching.batch_size(args, dims)
    out = decode_bf16_p.bind(
        batching.fold(codes, dims[0], size), batching.fold(scales, dims[1], size)
    )
    return out.reshape(size, -1, *out.shape[1:]), 0


decode_bf16_p = primitive.define(
    "nvfp4_decode_bf16",
    bf16_gemm.DECODE_TARGET,
    _abstract,
    reference.decode_bf16,
    _batch,
    _layout,
    multiple=False,
)


def decode_bf16(codes, scales):
    """codes uint8 [b, r, l/2], scales float8_e4m3fn [b, r, l/16] -> the
    bfloat16 values [b, r, l] (l a multiple of 16)."""
    if (
        codes.ndim != 3
        or scales.shape != (*codes.shape[:2], codes.shape[2] // 8)
        or codes.shape[2] % 8
    ):
        raise ValueError(
            "decode_bf16 expects codes [b, r, l/2] and scales [b, r, l/16] with "
            f"l a multiple of 16; got {codes.shape} and {scales.shape}"
        )
    return decode_bf16_p.bind(codes, scales)
