"""Block-scaled FP4 GEMM on NVFP4Tensors.

``matmul(a, b)`` contracts the quantized axis of both operands:
``out = (A_a / 2688)(A_b / 2688) * sum_k e2m1(a) s_a * e2m1(b) s_b`` with
float32 accumulation. Which GEMM computes it on each backend is the matmul
primitive's business (``jax_nvfp4.ops.matmul``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4.format import BLOCK_SIZE, NVFP4Tensor
from jax_nvfp4.quantize import implementation_ops

__all__ = ["matmul"]


def _stored_rank3(t: NVFP4Tensor, name: str):
    stored = t.stored_shape
    if len(stored) < 2:
        raise ValueError(
            f"{name} has rank {len(stored)}; matmul needs matrices (rank >= 2)"
        )
    batch = math.prod(stored[:-2])
    rows, length = stored[-2], stored[-1]
    return (
        t.codes.reshape(batch, rows, length if t.decoded else length // 2),
        t.scales.reshape(batch, rows, length // BLOCK_SIZE),
        jnp.asarray(t.amax, jnp.float32).reshape(1),
    )


def matmul(
    a: NVFP4Tensor,
    b: NVFP4Tensor,
    *,
    out_dtype=jnp.bfloat16,
    implementation: str = "ffi",
):
    """Multiplies two NVFP4 tensors over their quantized (contraction) axes.

    Args:
      a: stored ``[..., M, K]`` (quantized along K, e.g. activations
        ``quantize(x, -1)`` of x ``[..., M, K]``).
      b: stored ``[N, K]`` or ``[..., N, K]`` with a's leading dims (e.g. a
        weight w ``[K, N]`` quantized along axis 0).
      out_dtype: bfloat16 or float32.

    Returns:
      ``[..., M, N]`` of ``out_dtype``: sum over k of a[..., m, k] * b[n, k].
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, NVFP4Tensor):
            raise TypeError(f"matmul takes NVFP4Tensors; {name} is {type(t).__name__}")
    if a.batch_ndim or b.batch_ndim:  # tensors returned by vmap
        if a.batch_ndim and b.batch_ndim and a.batch_ndim != b.batch_ndim:
            raise ValueError(
                f"a and b carry {a.batch_ndim} and {b.batch_ndim} vmapped leading "
                "axes; give them the same number (or none to one of them)"
            )
        return jax.vmap(
            functools.partial(
                matmul, out_dtype=out_dtype, implementation=implementation
            ),
            in_axes=(0 if a.batch_ndim else None, 0 if b.batch_ndim else None),
        )(a, b)
    if a.rht != b.rht:
        raise ValueError(
            "both operands must be Random-Hadamard-transformed along K or neither "
            f"(a.rht={a.rht}, b.rht={b.rht}): only then does the transform cancel"
        )
    sa, sb = a.stored_shape, b.stored_shape
    if sa[-1] != sb[-1]:
        raise ValueError(
            f"contraction lengths differ: a has K={sa[-1]}, b has K={sb[-1]}"
        )
    if len(sb) > 2 and sb[:-2] != sa[:-2]:
        raise ValueError(
            f"b's leading dims {sb[:-2]} must equal a's {sa[:-2]} (or b be a matrix)"
        )
    out_dtype = np.dtype(out_dtype)
    if out_dtype not in (np.dtype(jnp.bfloat16), np.dtype(np.float32)):
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    ops = implementation_ops(implementation)
    a3 = _stored_rank3(a, "a")
    b3 = _stored_rank3(b, "b")
    if len(sb) == 2 and a3[0].shape[0] != 1:
        # A shared matrix b: fold a's leading dims into M (one GEMM).
        rows = a3[0].shape[0] * a3[0].shape[1]
        a3 = (
            a3[0].reshape(1, rows, -1),
            a3[1].reshape(1, rows, -1),
            a3[2],
        )
    out = ops.matmul(*a3, *b3, dtype=out_dtype)
    return out.reshape(*sa[:-1], sb[-2])
