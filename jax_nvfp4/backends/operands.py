"""What the cuBLASLt GEMM handlers (Hopper bf16, Blackwell FP4) share: the
checks of the matmul primitive's operands and the layout of their workspace.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_nvfp4.format import BLOCK_SIZE

__all__ = [
    "WORKSPACE_BYTES",
    "check_codes_operands",
    "check_dtype",
    "round_up",
    "workspace_bytes",
]

# cuBLASLt's workspace: 32 MiB, the size the cuBLAS documentation recommends
# for Hopper and newer (cublasSetWorkspace).
WORKSPACE_BYTES = 32 * 1024 * 1024


def round_up(v: int, multiple: int) -> int:
    return -(-v // multiple) * multiple


def workspace_bytes(batch: int) -> int:
    """Size of a GEMM handler's workspace result: a head with beta and one
    alpha per batch item, 256-byte aligned (``ffi/gemm/*_plan.h``), then
    cuBLASLt's."""
    return round_up(4 * (1 + batch), 256) + WORKSPACE_BYTES


def check_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(jnp.bfloat16), np.dtype(np.float32)):
        raise TypeError(f"dtype must be bfloat16 or float32, got {dtype}")
    return dtype


def check_codes_operands(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax):
    """The matmul primitive's operands as codes: a_codes uint8 [batch, M, K/2],
    a_scales float8_e4m3fn [batch, M, K/16], a_amax float32 [1 or batch]; b
    likewise with N rows and a batch of 1 or a's."""
    for name, codes, scales in (
        ("a", a_codes, a_scales),
        ("b", b_codes, b_scales),
    ):
        if codes.ndim != 3 or codes.dtype != jnp.uint8:
            raise TypeError(
                f"{name}_codes must be uint8 [batch, rows, K/2], got "
                f"{codes.dtype} {codes.shape}"
            )
        want = (*codes.shape[:2], 2 * codes.shape[2] // BLOCK_SIZE)
        if scales.dtype != jnp.float8_e4m3fn or scales.shape != want:
            raise TypeError(
                f"{name}_scales must be float8_e4m3fn {want} (one per 16 codes), "
                f"got {scales.dtype} {scales.shape}"
            )
    batch, _, half = a_codes.shape
    b_batch = b_codes.shape[0]
    if b_codes.shape[2] != half or (2 * half) % BLOCK_SIZE:
        raise ValueError(
            f"a has K={2 * half} and b K={2 * b_codes.shape[2]}; both must be "
            "the same multiple of 16"
        )
    if b_batch not in (1, batch):
        raise ValueError(f"b's batch must be 1 or a's ({batch}), got {b_batch}")
    for name, amax, count in (("a", a_amax, batch), ("b", b_amax, b_batch)):
        if np.size(amax) not in (1, count):
            raise ValueError(
                f"{name}_amax must have 1 or {count} (its batch) values, got "
                f"shape {np.shape(amax)}"
            )
