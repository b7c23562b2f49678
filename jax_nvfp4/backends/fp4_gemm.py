"""The native Blackwell (sm_100+) block-scaled FP4 GEMM: host-side logic.

On GPUs with FP4 tensor cores (compute capability 10.0 and newer) the matmul
primitive runs as one cuBLASLt block-scaled FP4 GEMM per batch item, through
the FFI target ``jax_nvfp4_matmul_fp4_sm100`` (``ffi/gemm/``). This module
prepares its operands with plain, traceable JAX:

* ``native_operands``: codes padded with zeros to the handler's tiles, and
  block scales swizzled into cuBLASLt's VEC16_UE4M3 layout.
* ``matmul_native``: operands -> custom call -> the result sliced back.
* ``native_fp4_supported``: whether the matmul primitive's CUDA lowering
  (``jax_nvfp4.ops.matmul``) may use it.

The handler's contract (checked by its plan in C++): for every batch item,
``out[m, n] = alpha * sum_k e2m1(a[m,k]) s_a[m,k/16] e2m1(b[n,k]) s_b[n,k/16]``
with float32 accumulation, M and N multiples of 128 and K of 64. The handler
computes alpha = (amax_a / 2688) * (amax_b / 2688) itself from the float32
amaxes with IEEE division, as the CPU handler does: in XLA a division by the
constant 2688 becomes a multiplication by its inexact reciprocal. Padding is
exact: padded codes and scales are zero, so padded K contributes 0 * 0, and
padded rows and columns of the output are sliced off.

Why these tiles (the cuBLAS documentation, cublasLtMatmul, "1D Block Scaling
Factors Layout"): block-scaled FP4 is TN only, its scale tensors are laid out
in tiles of 128 rows x 4 scale columns (64 elements of K) padded with zeros,
and FP4 operands need 16-byte aligned leading dimensions. Padding the codes to
whole scale tiles (rows to 128, K to 64) satisfies all of these and makes
every byte cuBLASLt may read defined. Scales must be non-negative (cuBLASLt
reads them as unsigned UE4M3); the quantizers never set the sign bit.

This path has not run on Blackwell hardware. What is tested on CPU: the
padding, the swizzle (against its definition and the C++ offsets), the
handler's shape checks, the custom call's operands, and a float64 emulation of
the handler's contract against the reference GEMM.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4.backends import devices, library
from jax_nvfp4.backends.operands import (
    WORKSPACE_BYTES,
    check_codes_operands,
    check_dtype,
    round_up,
    workspace_bytes,
)

__all__ = [
    "WORKSPACE_BYTES",
    "NativeOperands",
    "matmul_native",
    "native_fp4_supported",
    "native_operands",
    "swizzle_scales",
    "workspace_bytes",
]

TARGET = "jax_nvfp4_matmul_fp4_sm100"
ROW_TILE = 128  # M and N padding: the rows of one scale tile
K_TILE = 64  # K padding: the 4 scale columns of one scale tile
MIN_CAPABILITY = (10, 0)  # FP4 tensor cores


def swizzle_scales(scales: jax.Array) -> jax.Array:
    """[rows, cols] float8_e4m3fn scales -> the flat swizzled layout (uint8).

    Padding rows/columns are zero. Output length: round_up(rows, 128) *
    round_up(cols, 4).
    """
    if scales.ndim != 2:
        raise ValueError(f"scales must be [rows, K/16], got shape {scales.shape}")
    rows, cols = scales.shape
    padded_rows, padded_cols = round_up(rows, 128), round_up(cols, 4)
    raw = jax.lax.bitcast_convert_type(scales, jnp.uint8)
    raw = jnp.pad(raw, ((0, padded_rows - rows), (0, padded_cols - cols)))
    # [row tile, i (32-row band), j, col tile, c] -> [row tile, col tile, j, i, c]
    tiles = raw.reshape(padded_rows // 128, 4, 32, padded_cols // 4, 4)
    return tiles.transpose(0, 3, 2, 1, 4).reshape(-1)


class NativeOperands(NamedTuple):
    """The operands of the ``jax_nvfp4_matmul_fp4_sm100`` custom call.

    a_codes: uint8 [batch, Mp, Kp/2]; a_scales: uint8 [batch, Mp*Kp/16]
    (swizzled); a_amax: float32 [1 or batch]; b_codes: uint8 [1 or batch, Np,
    Kp/2]; b_scales: uint8 [1 or batch, Np*Kp/16]; b_amax: float32 [1 or b's
    batch]. ``m`` and ``n`` are the unpadded sizes to slice the [batch, Mp, Np]
    result back to.
    """

    a_codes: jax.Array
    a_scales: jax.Array
    a_amax: jax.Array
    b_codes: jax.Array
    b_scales: jax.Array
    b_amax: jax.Array
    m: int
    n: int


def native_operands(
    a_codes: jax.Array,
    a_scales: jax.Array,
    a_amax: jax.Array,
    b_codes: jax.Array,
    b_scales: jax.Array,
    b_amax: jax.Array,
) -> NativeOperands:
    """Pads the codes and swizzles the scales for the native FP4 GEMM.

    Takes the matmul primitive's operands: a_codes uint8 [batch, M, K/2] (even
    element in the low nibble), a_scales float8_e4m3fn [batch, M, K/16],
    a_amax float32 [1 or batch], and b likewise with N rows and a batch of 1
    or batch. M, N are any sizes and K any multiple of 16.
    """
    check_codes_operands(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax)
    _, m, half = a_codes.shape
    n = b_codes.shape[1]
    k = 2 * half
    mp, np_, kp = round_up(m, ROW_TILE), round_up(n, ROW_TILE), round_up(k, K_TILE)

    def pad_codes(codes, rows):
        return jnp.pad(codes, ((0, 0), (0, rows - codes.shape[1]), (0, (kp - k) // 2)))

    # swizzle_scales pads each item's [rows, K/16] to [round_up(rows, 128),
    # round_up(K/16, 4)] = [rows padded, Kp/16]: the padded codes' scales.
    swizzle = jax.vmap(swizzle_scales)
    return NativeOperands(
        a_codes=pad_codes(a_codes, mp),
        a_scales=swizzle(a_scales),
        a_amax=jnp.asarray(a_amax, jnp.float32).reshape(-1),
        b_codes=pad_codes(b_codes, np_),
        b_scales=swizzle(b_scales),
        b_amax=jnp.asarray(b_amax, jnp.float32).reshape(-1),
        m=m,
        n=n,
    )


def _call_handler(ops: NativeOperands, dtype: np.dtype) -> jax.Array:
    """The custom call: [batch, Mp, Np] of dtype (the workspace is dropped)."""
    batch, mp = ops.a_codes.shape[:2]
    np_ = ops.b_codes.shape[1]
    out, _ = jax.ffi.ffi_call(
        TARGET,
        (
            jax.ShapeDtypeStruct((batch, mp, np_), dtype),
            jax.ShapeDtypeStruct((workspace_bytes(batch),), jnp.uint8),
        ),
    )(*ops[:6])
    return out


def matmul_native(
    a_codes: jax.Array,
    a_scales: jax.Array,
    a_amax: jax.Array,
    b_codes: jax.Array,
    b_scales: jax.Array,
    b_amax: jax.Array,
    *,
    dtype: Any,
) -> jax.Array:
    """The matmul primitive on the native FP4 GEMM: out [batch, M, N] of dtype.

    Same operands and result as ``jax_nvfp4.reference.matmul``; dtype is
    bfloat16 or float32. Runs only on a GPU where ``native_fp4_supported``
    holds (elsewhere the custom call fails to compile or to run, with a
    message).
    """
    dtype = check_dtype(dtype)
    ops = native_operands(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax)
    batch = ops.a_codes.shape[0]
    if batch == 0 or ops.m == 0 or ops.n == 0 or a_codes.shape[2] == 0:
        return jnp.zeros((batch, ops.m, ops.n), dtype)  # nothing to multiply
    return _call_handler(ops, dtype)[:, : ops.m, : ops.n]


def native_fp4_supported(target: Any = None) -> bool:
    """Whether the matmul primitive can use the native FP4 GEMM.

    True when the handler was compiled in (``jax_nvfp4_matmul_fp4_sm100`` is a
    registered CUDA target) and every target device has compute capability >= 10.0.

    Args:
      target: what is lowered for: a lowering rule's context (its platforms
        must be just "cuda"; the devices are those of the CUDA backend), a
        device, a sequence of devices, or None for the CUDA backend's devices.
    """
    lowered_for = devices.lowering_devices(target)
    if TARGET not in library.targets_on("cuda"):
        return False
    return devices.all_capable(lowered_for, MIN_CAPABILITY)
