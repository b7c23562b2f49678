"""The weight-only NVFP4 GEMM of serving (W4A16): bfloat16 activations times
an NVFP4 weight, with the weight decoded inside the GEMM.

  out[m, n] = (amax / 2688) * sum_k x[m, k] * e2m1(w[n, k]) * s[n, k / 16]

x bfloat16 [M, K]; the weight as stored when quantized along K: codes uint8
[N, K / 2], E4M3 scales [N, K / 16], its amax. Products are exact (e2m1 times
an E4M3 scale fits bfloat16), sums float32, alpha in the epilogue, one
rounding to the output dtype.

The GEMMs the W4A16 primitive (``jax_nvfp4.ops.w4a16_matmul``) lowers to on
CUDA, as ``ops.dispatch`` chooses them. On compute capability 9.0 the Hopper
engine's handler ``jax_nvfp4_matmul_w4a16_sm90``
(ffi/gemm/engine/w4a16_gemm.cu) runs 1 to ``MAX_ENGINE_ROWS`` rows: the
weight is wgmma's A operand, decoded in registers from codes and scales
that TMA stages in shared memory, and x its B operand, so that a few tokens
fill an n16 tile; K is split across a thread-block cluster when the tiles
alone leave multiprocessors idle. Elsewhere (and for K off 256) the CUDA
handler
``jax_nvfp4_matmul_w4a16`` (ffi/gemm/mma/w4a16_gemm.cu) decodes the weight in
registers: it reads 4.5 bits per weight element and no bfloat16 copy of the
weight exists, which is what wins at the few rows of x of token-by-token
generation. From ``MAX_HANDLER_ROWS`` rows on, the GEMM is compute-bound and
the cuBLASLt bf16 GEMM on the decoded weight is faster
(``bf16_gemm.matmul_values``; the weight decoded by the CUDA decode handler,
as for training's GEMMs). The twin of both, and the path on the CPU: XLA's
dot on the decoded weight (``reference.w4a16_matmul``: exact products,
float32 sums in XLA's order).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import reference
from jax_nvfp4.backends import bf16_gemm, devices, library
from jax_nvfp4.format import SCALE_RANGE

__all__ = [
    "ENGINE_TARGET",
    "RAGGED_ENGINE_TARGET",
    "MAX_ENGINE_ROWS",
    "MAX_HANDLER_ROWS",
    "TARGET",
    "engine_supported",
    "handler_supported",
    "matmul_w4a16",
    "ragged_w4a16",
]

TARGET = "jax_nvfp4_matmul_w4a16"
MIN_CAPABILITY = (8, 0)  # bf16 mma.sync
ENGINE_TARGET = "jax_nvfp4_matmul_w4a16_sm90"
# The grouped form (ragged_dot by NVFP4 experts) of the engine's kernel.
RAGGED_ENGINE_TARGET = "jax_nvfp4_ragged_w4a16_sm90"
ENGINE_K_MULTIPLE = 256  # TMA reads a weight row's scales 16 bytes at a time
# Rows of x the engine serves (benchmarks/serving_bench.py): up to these it is
# the faster of the two register-decoding kernels; past a few hundred rows
# the GEMM is compute-bound and cuBLASLt on the decoded weight is faster.
MAX_ENGINE_ROWS = 512
# Rows of x up to which the handler runs (benchmarks/serving_bench.py): its
# tiles hold at most 64 rows; past that the GEMM is compute-bound and the
# cuBLASLt path is faster.
MAX_HANDLER_ROWS = 64


def handler_supported(k: int, n: int, target: Any = None) -> bool:
    """Whether the CUDA handler takes a weight [N, K]: compiled in,
    every device of compute capability >= 8.0,
    K a multiple of 128 and N even."""
    if TARGET not in library.targets_on("cuda") or k % 128 or n % 2:
        return False
    lowered_for = devices.lowering_devices(target)
    return bool(lowered_for) and devices.all_capable(lowered_for, MIN_CAPABILITY)


def engine_supported(k: int, target: Any = None, *, grouped: bool = False) -> bool:
    """Whether the Hopper engine's handler takes a weight [N, K] (``grouped``:
    its grouped form, weights [G, N, K]): compiled in, every device of
    compute capability 9.0 exactly, K a positive multiple of 256."""
    target_name = RAGGED_ENGINE_TARGET if grouped else ENGINE_TARGET
    if target_name not in library.targets_on("cuda"):
        return False
    if k <= 0 or k % ENGINE_K_MULTIPLE:
        return False
    return devices.all_engine_capable(devices.lowering_devices(target))


def matmul_w4a16(
    x: jax.Array,
    codes: jax.Array,
    scales: jax.Array,
    amax: jax.Array,
    dtype: Any,
    *,
    path: str,
    decode_handler: bool = False,
    graphs: bool = True,
) -> jax.Array:
    """x bfloat16 [b, M, K] times the weight (codes uint8 [b', N, K/2],
    scales float8_e4m3fn [b', N, K/16], amax float32 [b'], b' 1 or b) ->
    [b, M, N] of dtype (bfloat16 or float32): a lowering body.

    path: "engine" (the Hopper engine's handler) or "handler" (the mma.sync
    handler; for both one weight, b' = 1, x's batch folded into its rows),
    "cublaslt" (the decoded weight and the cuBLASLt bf16 GEMM
    with alpha in its epilogue) or "xla" (the twin). decode_handler: decode
    the weight with the CUDA decode handler (``bf16_gemm.decode_bf16_cuda``)
    instead of XLA's fusion of the twin (same values). graphs: the cuBLASLt
    target declared safe for XLA's command buffers.
    """
    dtype = np.dtype(dtype)
    amax = jnp.asarray(amax, jnp.float32).reshape(-1)
    batch, m, k = x.shape
    weights, n, _ = codes.shape
    if path == "xla" or 0 in (batch, m, n, k):
        return reference.w4a16_matmul(x, codes, scales, amax, dtype=dtype)
    if path in ("engine", "handler") and weights != 1:
        raise ValueError(
            f"the W4A16 {path} multiplies by one weight; got {weights} "
            "(one per batch item): use path 'cublaslt' or 'xla'"
        )
    if path == "engine":
        if k % ENGINE_K_MULTIPLE:
            raise ValueError(
                f"the engine's W4A16 GEMM needs K a multiple of {ENGINE_K_MULTIPLE}, "
                f"got K = {k}: use path 'auto', 'handler' or 'cublaslt'"
            )
        result = jax.ShapeDtypeStruct((batch * m, n), dtype)
        out = jax.ffi.ffi_call(ENGINE_TARGET, result)(
            x.reshape(batch * m, k), codes[0], scales[0], amax
        )
        return out.reshape(batch, m, n)
    if path == "handler":
        ext = library.extension()
        if ext is None:
            raise RuntimeError(
                "the W4A16 handler's workspace is sized by the compiled "
                "extension jax_nvfp4._ffi, which is not built"
            )
        plan = ext.plan_w4a16(batch * m, n, k)
        out, _ = jax.ffi.ffi_call(
            TARGET,
            (
                jax.ShapeDtypeStruct((batch * m, n), dtype),
                jax.ShapeDtypeStruct((plan["workspace_bytes"],), jnp.uint8),
            ),
        )(x.reshape(batch * m, k), codes[0], scales[0], amax)
        return out.reshape(batch, m, n)
    if path != "cublaslt":
        raise ValueError(
            f"path must be 'engine', 'handler', 'cublaslt' or 'xla', got {path!r}"
        )
    decode = bf16_gemm.decode_bf16_cuda if decode_handler else reference.decode_bf16
    w = decode(codes, scales)  # [b', N, K], the same values either way
    if weights == 1:  # one GEMM over every row of x
        x = x.reshape(1, batch * m, k)
    unit = jnp.full((1,), SCALE_RANGE, jnp.float32)  # alpha = amax / 2688
    out = bf16_gemm.matmul_values(x, w, unit, amax, dtype, graphs=graphs)
    return out.reshape(batch, m, n)


def ragged_w4a16(
    x: jax.Array,
    codes: jax.Array,
    scales: jax.Array,
    amax: jax.Array,
    group_sizes: jax.Array,
    dtype: Any,
    *,
    path: str,
) -> jax.Array:
    """The grouped form: x bfloat16 [T, K], its rows in groups of
    ``group_sizes`` int32 [G], group g's rows times weight g (codes uint8
    [G, N, K/2], scales float8_e4m3fn [G, N, K/16], amax float32 [G]) ->
    [T, N] of dtype: a lowering body. path: "engine" (the Hopper engine's
    grouped handler) or "xla" (the twin)."""
    dtype = np.dtype(dtype)
    amax = jnp.asarray(amax, jnp.float32).reshape(-1)
    rows, k = x.shape
    groups, n = codes.shape[:2]
    if path == "xla" or 0 in (rows, groups, n, k):
        return reference.ragged_w4a16_matmul(
            x, codes, scales, amax, group_sizes, dtype=dtype
        )
    if path != "engine":
        raise ValueError(f"path must be 'engine' or 'xla', got {path!r}")
    if k % ENGINE_K_MULTIPLE:
        raise ValueError(
            f"the engine's grouped W4A16 GEMM needs K a multiple of "
            f"{ENGINE_K_MULTIPLE}, got K = {k}: use path 'auto' or 'xla'"
        )
    result = jax.ShapeDtypeStruct((rows, n), dtype)
    return jax.ffi.ffi_call(RAGGED_ENGINE_TARGET, result)(
        x, codes, scales, amax, group_sizes
    )
