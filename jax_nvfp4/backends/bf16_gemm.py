"""The exact NVFP4 GEMM on GPUs without FP4 tensor cores (Hopper, Ampere, Ada).

e2m1 (at most 2 significant bits) times an E4M3 block scale (at most 4) fits
bfloat16's 8-bit significand, so decoding e2m1 * scale to bfloat16 is exact,
bf16 products are exact in float32, and a bf16 tensor-core GEMM with float32
accumulation computes the format's exact products. ``matmul_bf16``:

* each operand is decoded by the CUDA handler ``jax_nvfp4_decode_bf16`` (one
  kernel at about copy speed), unless it already holds its bfloat16 values
  (the fused quantize writes them for operands that only feed a GEMM);
* one cuBLASLt GEMM (``jax_nvfp4_matmul_bf16``) accumulates in float32 and, in
  its epilogue, multiplies by alpha = (amax_a / 2688) * (amax_b / 2688) and
  rounds once to the output type. alpha is computed on the device with IEEE
  division, bit for bit the CPU handler's (in XLA a division by the constant
  2688 may become an inexact multiplication by its reciprocal), and there is
  no float32 [M, N] intermediate.

The handler is registered twice: ``GRAPH_TARGET`` is declared safe for XLA's
command buffers, so that XLA can replay a step's kernels as CUDA graphs (its
one-time cuBLASLt setup runs with the thread's capture mode relaxed, so it may
happen inside a capture); ``TARGET`` keeps the command buffers around the GEMM
(``JAX_NVFP4_GEMM_GRAPHS=0``). Where the handler is missing or switched off
(``JAX_NVFP4_CUBLASLT_GEMM=0``), ``reference.matmul_dequantize_bf16`` runs the
same decode and a bf16 ``dot_general`` through XLA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_nvfp4 import reference
from jax_nvfp4.backends import devices, library
from jax_nvfp4.backends.operands import (
    check_codes_operands,
    check_dtype,
    workspace_bytes,
)
from jax_nvfp4.reference.gemm import is_decoded

__all__ = [
    "DECODE_TARGET",
    "GRAPH_TARGET",
    "TARGET",
    "cublaslt_gemm_supported",
    "decode_bf16",
    "decode_bf16_cuda",
    "matmul_bf16",
    "matmul_values",
    "workspace_bytes",
]

TARGET = "jax_nvfp4_matmul_bf16"
GRAPH_TARGET = TARGET + "_graph"
DECODE_TARGET = "jax_nvfp4_decode_bf16"
MIN_CAPABILITY = (8, 0)  # bf16 tensor cores (Ampere)

# e2m1(code) * block scale as bfloat16 (exact), without the amax: the pure-JAX
# twin of the CUDA handler behind decode_bf16_cuda.
decode_bf16 = reference.decode_bf16


def cublaslt_gemm_supported(target: Sequence[Any] | None = None) -> bool:
    """Whether the matmul primitive can use the cuBLASLt bf16 GEMM handler.

    True when the handler was compiled in and every device has compute
    capability >= 8.0.

    Args:
      target: the devices lowered for (see ``devices.lowering_devices``); None
        for the CUDA backend's devices. Without any (e.g. lowering for "cuda"
        on a machine without a GPU) the portable XLA GEMM is used, so that the
        module does not depend on this extension's handler.
    """
    lowered_for = devices.lowering_devices(target)
    if TARGET not in library.targets_on("cuda"):
        return False
    return devices.all_capable(lowered_for, MIN_CAPABILITY)


def decode_bf16_cuda(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """``decode_bf16`` by the CUDA handler ``jax_nvfp4_decode_bf16``, a
    lowering body (the GEMMs' CUDA lowerings call it). Only where that
    handler is registered and the arrays live on a CUDA GPU; elsewhere use
    the primitive ``jax_nvfp4.ops.decode_bf16``, which partitions and runs
    on any platform."""
    if scales.shape != (*codes.shape[:-1], codes.shape[-1] // 8) or (
        codes.shape[-1] % 8
    ):
        raise ValueError(
            "decode_bf16_cuda expects codes [..., K/2] and scales [..., K/16] "
            f"with K a multiple of 16; got {codes.shape} and {scales.shape}"
        )
    return jax.ffi.ffi_call(
        DECODE_TARGET,
        jax.ShapeDtypeStruct((*codes.shape[:-1], 2 * codes.shape[-1]), jnp.bfloat16),
    )(codes, scales)


def matmul_values(
    a: jax.Array,
    b: jax.Array,
    a_amax: jax.Array,
    b_amax: jax.Array,
    dtype,
    *,
    graphs: bool = True,
) -> jax.Array:
    """The cuBLASLt GEMM on values: a bf16 [batch, M, K], b bf16 [1 or batch,
    N, K], the amaxes float32 [1 or batch] -> out [batch, M, N] of dtype (the
    workspace result is dropped). graphs: the target declared safe for XLA's
    command buffers."""
    batch, m, _ = a.shape
    target = GRAPH_TARGET if graphs else TARGET
    out, _ = jax.ffi.ffi_call(
        target,
        (
            jax.ShapeDtypeStruct((batch, m, b.shape[1]), dtype),
            jax.ShapeDtypeStruct((workspace_bytes(batch),), jnp.uint8),
        ),
    )(a, b, a_amax, b_amax)
    return out


def matmul_bf16(
    a_codes: jax.Array,
    a_scales: jax.Array,
    a_amax: jax.Array,
    b_codes: jax.Array,
    b_scales: jax.Array,
    b_amax: jax.Array,
    *,
    dtype: Any,
    decode_handler: bool = False,
    graphs: bool = True,
) -> jax.Array:
    """The matmul primitive on the cuBLASLt bf16 GEMM: out [batch, M, N].

    Same operands and result as ``jax_nvfp4.reference.matmul``: a_codes uint8
    [batch, M, K/2], a_scales float8_e4m3fn [batch, M, K/16], a_amax float32
    [1 or batch], b likewise with N rows and a batch of 1 or a's; dtype is
    bfloat16 or float32. An operand whose codes are bfloat16 already holds its
    values [batch, rows, K] (``reference.gemm.is_decoded``). Runs only on a CUDA GPU
    of compute capability >= 8.0 with the handler built (elsewhere the custom
    call fails to compile or to run, with a message). decode_handler: decode
    with ``decode_bf16_cuda`` instead of XLA's fusion of ``decode_bf16`` (same
    values).
    """
    dtype = check_dtype(dtype)
    a_decoded, b_decoded = is_decoded(a_codes), is_decoded(b_codes)
    if not (a_decoded or b_decoded):  # (decoded operands: checked by matmul)
        check_codes_operands(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax)
    decode = decode_bf16_cuda if decode_handler else decode_bf16
    a = a_codes if a_decoded else decode(a_codes, a_scales)
    b = b_codes if b_decoded else decode(b_codes, b_scales)
    batch, m, k = a.shape
    n = b.shape[1]
    if batch == 0 or m == 0 or n == 0 or k == 0:
        return jnp.zeros((batch, m, n), dtype)  # nothing to multiply
    return matmul_values(
        a,
        b,
        jnp.asarray(a_amax, jnp.float32).reshape(-1),
        jnp.asarray(b_amax, jnp.float32).reshape(-1),
        dtype,
        graphs=graphs,
    )
