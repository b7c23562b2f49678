"""The one place that chooses how each GEMM runs, from the platform, the
devices' compute capability, the registered handlers and the settings in
effect (``jax_nvfp4.config``, read nowhere else).

Dense GEMM (the matmul primitive), chosen when lowered for CUDA
(``dense_path``):

1. ``"native_fp4"``: the block-scaled FP4 cuBLASLt GEMM (``fp4_gemm``), on
   GPUs of compute capability >= 10.0;
2. ``"cublaslt_bf16"``: the exact decode to bfloat16 and one cuBLASLt bf16
   GEMM with alpha in its epilogue (``bf16_gemm``), from 8.0 on;
3. ``"xla_bf16"``: the same decode and XLA's bf16 GEMM, alpha after
   (``reference.matmul_dequantize_bf16``), where neither handler applies.

Grouped GEMM (the ``grouped_matmul`` primitives of ``ragged_dot``), chosen
when lowered for CUDA (``grouped_path``): ``"native_fp4"`` (one FP4 GEMM per
group on the codes, ``fp4_grouped_gemm``), ``"engine"`` (one launch of the
Hopper engine on the decoded operands, ``bf16_grouped_gemm``, compute
capability 9.0), ``"bf16_handler"`` (one launch of the mma.sync kernel on
them, from 8.0) or ``"xla_ragged"`` (XLA's ``ragged_dot_general`` on the same
operands). The CPU lowering is
``"per_group"``: the CPU handler's in-order sums once per group, the exact
reference.

Weight-only GEMM (the W4A16 primitive of serving, ``matmul(x_bf16,
w_nvfp4)``), chosen when lowered for CUDA (``w4a16_path``, from the lowering
context and the shapes): ``"engine"`` (the Hopper engine, the weight decoded
in registers, ``w4a16_gemm``; up to 512 rows, compute capability 9.0, K a
multiple of 256), ``"handler"`` (the mma.sync kernel, the weight decoded in
registers; up to 64 rows, from 8.0, where the engine does not run),
``"cublaslt"`` (the decoded weight, by the decode
handler where it is built, and the cuBLASLt bf16 GEMM) or ``"xla"`` (the
twin). Its grouped form (``ragged_dot(x_bf16, w_nvfp4)``, mixture-of-experts
serving; ``ragged_w4a16_path``): ``"engine"`` (the same kernel, a token tile
per group's rows; compute capability 9.0, K a multiple of 256) or
``"xla"`` (the twin: XLA's ragged_dot on the decoded weights).

Operand form, chosen when traced (``decoded_operands``,
``grouped_decoded_operands``, from the setting ``gemm_operands``): whether
the fused quantize writes the GEMM's bfloat16 operands instead of codes.
Every GEMM path takes either form.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_nvfp4 import config, reference
from jax_nvfp4.backends import (
    bf16_gemm,
    bf16_grouped_gemm,
    devices,
    fp4_gemm,
    fp4_grouped_gemm,
    library,
    w4a16_gemm,
)
from jax_nvfp4.reference.gemm import is_decoded

__all__ = [
    "DENSE",
    "GROUPED",
    "RAGGED_W4A16",
    "W4A16",
    "decoded_operands",
    "dense_path",
    "gemm_graphs",
    "grouped_decoded_operands",
    "grouped_path",
    "matmul_cuda",
    "ragged_w4a16_cuda",
    "ragged_w4a16_path",
    "w4a16_cuda",
    "w4a16_path",
]

DENSE = ("native_fp4", "cublaslt_bf16", "xla_bf16")
GROUPED = ("per_group", "engine", "bf16_handler", "xla_ragged", "native_fp4")
W4A16 = ("engine", "handler", "cublaslt", "xla")
RAGGED_W4A16 = ("engine", "xla")


def dense_path(target: Sequence[Any] | None = None) -> str:
    """The dense GEMM for these devices (``devices.lowering_devices``; None:
    the CUDA backend's): one of ``DENSE``."""
    settings = config.settings()
    lowered_for = devices.lowering_devices(target)
    if settings.native_gemm and fp4_gemm.native_fp4_supported(lowered_for):
        return "native_fp4"
    if settings.cublaslt_gemm and bf16_gemm.cublaslt_gemm_supported(lowered_for):
        return "cublaslt_bf16"
    return "xla_bf16"


def gemm_graphs() -> bool:
    """Whether the cuBLASLt bf16 GEMM runs as the target declared safe for
    XLA's command buffers."""
    return config.settings().gemm_graphs


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _forced_operands() -> bool | None:
    """The setting ``gemm_operands``: True for "decoded", False for "codes",
    None for "auto" (the dispatcher decides)."""
    form = config.settings().gemm_operands
    return None if form == "auto" else form == "decoded"


def decoded_operands(dtype) -> bool:
    """Whether quantizations that only feed a dense GEMM should write its
    bfloat16 operands (decoded) instead of codes it would decode right after:
    on the cuBLASLt bf16 path when the GPU is the default backend, for
    bfloat16 inputs (setting ``gemm_operands="auto"``); always or never where
    the setting forces a form. Same values either way; it saves the codes'
    write, their read and the decode kernel."""
    forced = _forced_operands()
    if forced is not None:
        return forced
    return (
        jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
        and _on_gpu()
        and dense_path() == "cublaslt_bf16"
    )


def grouped_path(
    target: Any = None,
    *,
    decoded: bool = False,
    groups: int | None = None,
    n: int | None = None,
) -> str:
    """The grouped GEMM lowered for CUDA: one of ``GROUPED`` but
    ``"per_group"`` (the CPU's).

    ``target``: a lowering rule's context (the devices it lowers for), a
    device, a sequence of devices, or None for the CUDA backend's devices
    (``devices.lowering_devices``). ``decoded``: an operand holds bfloat16
    values instead of codes; it takes a bf16 path on any GPU. ``groups``
    and ``n``: the GEMM's group count and output columns (N), where known;
    the handlers need N even, the Hopper engine at most
    ``bf16_grouped_gemm.ENGINE_MAX_GROUPS`` groups."""
    settings = config.settings()
    lowered_for = devices.lowering_devices(target)
    if settings.native_gemm and not decoded and fp4_grouped_gemm.supported(lowered_for):
        return "native_fp4"
    if not settings.grouped_gemm or (n is not None and n % 2):
        return "xla_ragged"
    if (
        settings.gemm_engine
        and groups is not None
        and n is not None
        and bf16_grouped_gemm.engine_supported(lowered_for, groups=groups, n=n)
    ):
        return "engine"
    if bf16_grouped_gemm.handler_supported(lowered_for):
        return "bf16_handler"
    return "xla_ragged"


def grouped_decoded_operands() -> bool:
    """Whether ``ragged_dot``'s quantizations that only feed the grouped GEMM
    should write its bfloat16 operands instead of codes: when the GPU is the
    default backend and its grouped GEMM (``grouped_path``) reads bf16
    operands (setting ``gemm_operands="auto"``); always or never where the
    setting forces a form. Asked when traced; the GEMM, chosen when lowered,
    takes either form."""
    forced = _forced_operands()
    if forced is not None:
        return forced
    return _on_gpu() and grouped_path() != "native_fp4"


def w4a16_path(
    rows: int, k: int, n: int, target: Any = None, *, weights: int = 1
) -> str:
    """The weight-only GEMM of bf16 x [rows, k] by an NVFP4 weight [n, k]
    (``weights`` > 1: one weight per batch item, x's rows per item), lowered
    for ``target`` (a lowering context; see ``devices.lowering_devices``):
    one of ``W4A16``."""
    if rows == 0 or n == 0 or k == 0:
        return "xla"  # nothing to multiply
    settings = config.settings()
    lowered_for = devices.lowering_devices(target)
    handler = (
        settings.w4a16_gemm
        and weights == 1
        and rows <= w4a16_gemm.MAX_HANDLER_ROWS
        and w4a16_gemm.handler_supported(k, n, lowered_for)
    )
    engine = (
        settings.w4a16_gemm
        and settings.gemm_engine
        and weights == 1
        and rows <= w4a16_gemm.MAX_ENGINE_ROWS
        and w4a16_gemm.engine_supported(k, lowered_for)
    )
    # The engine first wherever it runs (it decodes fewer instructions per
    # element than the mma.sync handler); the handler where it does not.
    if engine:
        return "engine"
    if handler:
        return "handler"
    if settings.cublaslt_gemm and bf16_gemm.cublaslt_gemm_supported(lowered_for):
        return "cublaslt"
    return "xla"


def w4a16_cuda(x, codes, scales, amax, *, dtype, path):
    """The W4A16 primitive's CUDA lowering body: the GEMM of ``path`` (one
    of ``W4A16``; ``w4a16_path`` chooses it)."""
    return w4a16_gemm.matmul_w4a16(
        x,
        codes,
        scales,
        amax,
        dtype,
        path=path,
        decode_handler=bf16_gemm.DECODE_TARGET in library.targets_on("cuda"),
        graphs=gemm_graphs(),
    )


def ragged_w4a16_path(k: int, n: int, target: Any = None) -> str:
    """The grouped weight-only GEMM of bf16 rows by NVFP4 weights [G, n, k],
    lowered for ``target``: one of ``RAGGED_W4A16``. The engine's grouped
    form where it runs (compute capability 9.0, K a multiple of 256);
    elsewhere XLA's ragged_dot on the decoded weights."""
    settings = config.settings()
    if (
        n > 0
        and settings.w4a16_gemm
        and settings.gemm_engine
        and w4a16_gemm.engine_supported(
            k, devices.lowering_devices(target), grouped=True
        )
    ):
        return "engine"
    return "xla"


def ragged_w4a16_cuda(x, codes, scales, amax, group_sizes, *, dtype, path):
    """The grouped W4A16 primitive's CUDA lowering body: the GEMM of ``path``
    (one of ``RAGGED_W4A16``)."""
    return w4a16_gemm.ragged_w4a16(
        x, codes, scales, amax, group_sizes, dtype, path=path
    )


def matmul_cuda(
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, *, dtype, path=None
):
    """The matmul primitive's CUDA lowering body: the GEMM of ``path`` (one
    of ``DENSE``; None: ``dense_path()``, the CUDA backend's). Decoded
    operands take a bf16 GEMM on any GPU."""
    path = dense_path() if path is None else path
    decoded = is_decoded(a_codes) or is_decoded(b_codes)
    if path == "cublaslt_bf16" or (path == "native_fp4" and decoded):
        fn = functools.partial(
            bf16_gemm.matmul_bf16,
            decode_handler=bf16_gemm.DECODE_TARGET in library.targets_on("cuda"),
            graphs=gemm_graphs(),
        )
    elif path == "native_fp4":
        fn = fp4_gemm.matmul_native
    else:
        fn = reference.matmul_dequantize_bf16
    return fn(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, dtype=dtype)
