"""Which GEMM the matmul primitive runs on CUDA, chosen when a computation is
lowered (``gemm_path``):

1. ``"native_fp4"``: Blackwell's block-scaled FP4 GEMM (``blackwell``), on
   GPUs of compute capability >= 10.0;
2. ``"cublaslt_bf16"``: the exact decode to bfloat16 and one cuBLASLt bf16
   GEMM with alpha in its epilogue (``hopper``), from 8.0 on;
3. ``"xla_bf16"``: the same decode and XLA's bf16 GEMM, alpha after
   (``reference.matmul_dequantize_bf16``), where neither handler applies.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_nvfp4 import config, reference
from jax_nvfp4.backends import blackwell, devices, hopper, library
from jax_nvfp4.format import holds_values

__all__ = ["gemm_path", "matmul_cuda", "takes_values"]


def gemm_path(target: Sequence[Any] | None = None) -> str:
    """The GEMM the CUDA lowering uses for these devices (None: the CUDA
    backend's): ``"native_fp4"``, ``"cublaslt_bf16"`` or ``"xla_bf16"``."""
    lowered_for = devices.lowering_devices(target)
    if blackwell.native_fp4_supported(lowered_for):
        return "native_fp4"
    if hopper.cublaslt_gemm_supported(lowered_for):
        return "cublaslt_bf16"
    return "xla_bf16"


def takes_values(dtype) -> bool:
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
