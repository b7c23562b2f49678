"""The matmul primitive on CUDA GPUs: which GEMM runs, decided when lowered.

``matmul_cuda`` is the primitive's CUDA lowering body. It picks, in order:

1. ``"native_fp4"``: on Blackwell (compute capability >= 10.0) with the native
   block-scaled FP4 handler built -- ``blackwell.matmul_native``.
2. ``"cublaslt_bf16"``: on GPUs of compute capability >= 8.0 with the cuBLASLt
   bf16 handler built (``ffi/cublaslt_bf16_gemm.cu``, target
   ``jax_nvfp4_matmul_bf16``) -- ``matmul_bf16``: both operands are decoded to
   bfloat16 by the CUDA handler ``jax_nvfp4_decode_bf16`` (e2m1 times the
   E4M3 block scale has at most 6 significant bits, so the decode is exact),
   then one cuBLASLt GEMM accumulates in
   float32 and, in its epilogue, multiplies by alpha = (amax_a / 2688) *
   (amax_b / 2688) and rounds once to the output type.
3. ``"xla_bf16"``: otherwise -- ``reference.matmul_dequantize_bf16``, the same
   decode and a bf16 ``dot_general`` with a float32 result, then a multiply by
   alpha and the rounding in a separate XLA fusion.

(2) computes the same products and float32 sums as (3) (up to accumulation
order) without (3)'s float32 [M, N] intermediate: one write of the output
instead of a float32 write, a read and a second write. Its alpha is computed on
the device with IEEE division, bit for bit the CPU handler's (in XLA a division
by the constant 2688 may become an inexact multiplication by its reciprocal).
It is declared safe for XLA's command buffers, so that XLA can replay a
step's kernels as CUDA graphs instead of launching each from the host; its
one-time cuBLASLt setup runs with the thread's capture mode relaxed, so that
it may happen inside a capture (``ffi/cublaslt.h``).

Switches, read when a computation is lowered (set them before it is compiled):
``JAX_NVFP4_NATIVE_GEMM=0`` skips (1) and ``JAX_NVFP4_CUBLASLT_GEMM=0`` skips
(2), e.g. to bypass a handler that fails on some GPU or cuBLAS version.
``JAX_NVFP4_GEMM_GRAPHS=0`` lowers (2) to ``TARGET``, the same handler not
declared graph-safe, so that XLA's command buffers run around it (as before
2026-11-30; on an H200 the GEMM alone at 8192^3 took 1.12-1.16x bf16's
wall-clock time either way, 1.07x in one run inside graphs).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import _ffi_registry, blackwell, reference
from jax_nvfp4.format import holds_values

__all__ = [
    "TARGET",
    "cublaslt_gemm_supported",
    "decode_bf16",
    "decode_bf16_cuda",
    "gemm_path",
    "matmul_bf16",
    "matmul_cuda",
    "workspace_bytes",
]

TARGET = "jax_nvfp4_matmul_bf16"
# The same handler declared safe for XLA's command buffers (CUDA graphs): the
# default; JAX_NVFP4_GEMM_GRAPHS=0 chooses TARGET.
GRAPH_TARGET = TARGET + "_graph"
DECODE_TARGET = "jax_nvfp4_decode_bf16"
_SWITCH = "JAX_NVFP4_CUBLASLT_GEMM"
_DISABLE = ("0", "false", "off", "no")
_ENABLE = ("1", "true", "on", "yes")


def switch(name: str, default: bool) -> bool:
    """An on/off environment switch: "1"/"true"/"on"/"yes" and
    "0"/"false"/"off"/"no" (any case); unset, empty or anything else keeps
    the default."""
    value = os.environ.get(name, "").strip().lower()
    if value in _ENABLE:
        return True
    if value in _DISABLE:
        return False
    return default


_MIN_CAPABILITY = (8, 0)  # bf16 tensor cores (Ampere)


def workspace_bytes(batch: int) -> int:
    """Size of the handler's workspace result: beta and one alpha per batch
    item, padded to 256 bytes (``ffi/cublaslt_plan.h``), then cuBLASLt's 32 MiB
    (the size the cuBLAS documentation recommends for Hopper and newer). The
    same layout as the FP4 handler's (``blackwell.workspace_bytes``)."""
    return blackwell.workspace_bytes(batch)


def _capability(device: Any) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device; None for other devices (CPU, ROCm)."""
    if getattr(device, "platform", None) != "gpu":
        return None
    try:
        major, minor = (int(v) for v in str(device.compute_capability).split(".")[:2])
    except (AttributeError, ValueError):  # not CUDA (e.g. ROCm), or unknown
        return None
    return major, minor


def _cuda_devices() -> tuple[Any, ...]:
    """The devices of this process's CUDA backend; () without one."""
    try:
        return tuple(jax.devices("cuda"))
    except RuntimeError:
        return ()


def cublaslt_gemm_supported(devices: Sequence[Any] | None = None) -> bool:
    """Whether the matmul primitive can use the cuBLASLt bf16 GEMM handler.

    True when the handler was compiled in (``jax_nvfp4_matmul_bf16`` is a
    registered CUDA target), ``JAX_NVFP4_CUBLASLT_GEMM`` is not ``0``, and
    every device has compute capability >= 8.0.

    Args:
      devices: the devices lowered for; None for the CUDA backend's devices.
        Without any (e.g. lowering for "cuda" on a machine without a GPU) the
        portable XLA GEMM is used, so that the module does not depend on this
        extension's handler.
    """
    if devices is None:
        devices = _cuda_devices()
    if not switch(_SWITCH, True):
        return False
    if TARGET not in _ffi_registry.registered_targets().get("cuda", frozenset()):
        return False
    capabilities = [_capability(d) for d in devices]
    return bool(capabilities) and all(
        c is not None and c >= _MIN_CAPABILITY for c in capabilities
    )


def gemm_path(devices: Sequence[Any] | None = None) -> str:
    """The GEMM ``matmul_cuda`` lowers to for these devices (None: the CUDA
    backend's): ``"native_fp4"``, ``"cublaslt_bf16"`` or ``"xla_bf16"``."""
    devices = _cuda_devices() if devices is None else tuple(devices)
    if blackwell.native_fp4_supported(devices):
        return "native_fp4"
    if cublaslt_gemm_supported(devices):
        return "cublaslt_bf16"
    return "xla_bf16"


# e2m1(code) * block scale as bfloat16 (exact), without the amax; pure JAX,
# the twin of the CUDA handler behind decode_bf16_cuda.
decode_bf16 = reference.decode_bf16


def decode_bf16_cuda(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """``decode_bf16`` by the CUDA handler ``jax_nvfp4_decode_bf16`` (one
    kernel at about copy speed; XLA's fusion of the pure-JAX form moved ~2.1
    TB/s on an H200). Only where that handler is registered and the arrays
    live on a CUDA GPU."""
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


def _call_handler(
    a: jax.Array, b: jax.Array, a_amax: jax.Array, b_amax: jax.Array, dtype
) -> jax.Array:
    """The custom call: a bf16 [batch, M, K], b bf16 [1 or batch, N, K], the
    amaxes float32 [1 or batch] -> out [batch, M, N] of dtype (the workspace
    result is dropped)."""
    batch, m, _ = a.shape
    target = GRAPH_TARGET if switch("JAX_NVFP4_GEMM_GRAPHS", True) else TARGET
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
) -> jax.Array:
    """The matmul primitive on the cuBLASLt bf16 GEMM: out [batch, M, N].

    Same operands and result as ``jax_nvfp4.reference.matmul``: a_codes uint8
    [batch, M, K/2], a_scales float8_e4m3fn [batch, M, K/16], a_amax float32
    [1 or batch], b likewise with N rows and a batch of 1 or a's; dtype is
    bfloat16 or float32. Runs only on a CUDA GPU of compute capability >= 8.0
    with the handler built (elsewhere the custom call fails to compile or to
    run, with a message). decode_handler: decode the operands with the CUDA
    handler (``decode_bf16_cuda``; ``matmul_cuda`` sets it when the handler is
    built) instead of XLA's fusion of ``decode_bf16`` -- same values.
    An operand whose codes are bfloat16 already holds its values [batch,
    rows, K] (the fused quantize's decoded output; ``holds_values``).
    """
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(jnp.bfloat16), np.dtype(np.float32)):
        raise TypeError(f"dtype must be bfloat16 or float32, got {dtype}")
    a_decoded, b_decoded = holds_values(a_codes), holds_values(b_codes)
    if not (a_decoded or b_decoded):  # (decoded operands: checked by matmul)
        blackwell._check_operands(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax)
    decode = decode_bf16_cuda if decode_handler else decode_bf16
    a = a_codes if a_decoded else decode(a_codes, a_scales)
    b = b_codes if b_decoded else decode(b_codes, b_scales)
    batch, m, k = a.shape
    n = b.shape[1]
    if batch == 0 or m == 0 or n == 0 or k == 0:
        return jnp.zeros((batch, m, n), dtype)  # nothing to multiply
    return _call_handler(
        a,
        b,
        jnp.asarray(a_amax, jnp.float32).reshape(-1),
        jnp.asarray(b_amax, jnp.float32).reshape(-1),
        dtype,
    )


def matmul_cuda(
    a_codes: jax.Array,
    a_scales: jax.Array,
    a_amax: jax.Array,
    b_codes: jax.Array,
    b_scales: jax.Array,
    b_amax: jax.Array,
    *,
    dtype: Any,
) -> jax.Array:
    """The matmul primitive's CUDA implementation, chosen when it is lowered
    (``gemm_path``): native FP4 on Blackwell, the cuBLASLt bf16 GEMM with alpha
    in the epilogue on other GPUs, XLA's bf16 GEMM where neither applies.
    Decoded operands (bfloat16 e2m1 * scale) take a bf16 GEMM on any GPU."""
    path = gemm_path()
    decoded = holds_values(a_codes) or holds_values(b_codes)
    if path == "cublaslt_bf16" or (path == "native_fp4" and decoded):
        cuda_targets = _ffi_registry.registered_targets().get("cuda", frozenset())
        fn = functools.partial(
            matmul_bf16, decode_handler=DECODE_TARGET in cuda_targets
        )
    elif path == "native_fp4":
        fn = blackwell.matmul_native
    else:
        fn = reference.matmul_dequantize_bf16
    return fn(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, dtype=dtype)
