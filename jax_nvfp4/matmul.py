"""Block-scaled FP4 GEMM on NVFP4Tensors.

``matmul(a, b)`` contracts the quantized axis of both operands:
``out = (A_a / 2688)(A_b / 2688) * sum_k e2m1(a) s_a * e2m1(b) s_b`` with
float32 accumulation. Which GEMM computes it on each backend is the matmul
primitive's business (``jax_nvfp4.ops.matmul``).

``matmul(x, w)`` with bfloat16 activations x and an NVFP4 weight w is the
weight-only GEMM of serving (W4A16): ``out = (A_w / 2688) * sum_k x *
e2m1(w) s_w`` (the primitive ``jax_nvfp4.ops.w4a16_matmul``).

``matmul_gemm_operands`` is the same GEMM for the training recipe, whose
operands may also be ``DecodedOperand``s (the bfloat16 form the fused
quantize writes for the bf16 GEMMs).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4.decoded_operand import DecodedOperand
from jax_nvfp4.format import BLOCK_SIZE, NVFP4Tensor
from jax_nvfp4.quantize import implementation_ops

__all__ = ["matmul"]


def _stored_rank3(t: NVFP4Tensor | DecodedOperand, name: str):
    """The primitive's operand (codes or bfloat16 values, scales, amax) in
    its rank-3 layout [batch, rows, ...]."""
    stored = t.stored_shape
    if len(stored) < 2:
        raise ValueError(
            f"{name} has rank {len(stored)}; matmul needs matrices (rank >= 2)"
        )
    batch = math.prod(stored[:-2])
    rows, length = stored[-2], stored[-1]
    if isinstance(t, DecodedOperand):
        operand = t.values.reshape(batch, rows, length)
    else:
        operand = t.codes.reshape(batch, rows, length // 2)
    return (
        operand,
        t.scales.reshape(batch, rows, length // BLOCK_SIZE),
        jnp.asarray(t.amax, jnp.float32).reshape(1),
    )


def _out_dtype(out_dtype) -> np.dtype:
    try:
        dtype = np.dtype(out_dtype)
    except TypeError:
        dtype = None
    if dtype not in (np.dtype(jnp.bfloat16), np.dtype(np.float32)):
        got = repr(out_dtype) if dtype is None else str(dtype)
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {got}")
    return dtype


def _weight_only(x, w: NVFP4Tensor, out_dtype, implementation):
    """bfloat16 x [..., K] times the NVFP4 weight w stored [N, K]."""
    if not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if x.dtype != jnp.bfloat16:
        raise TypeError(
            f"matmul of activations by an NVFP4 weight takes bfloat16 activations "
            f"(exact products with the decoded weight); x is {x.dtype}: pass "
            "x.astype(jnp.bfloat16), or quantize x too (jax_nvfp4.quantize)"
        )
    stored = w.stored_shape
    if w.batch_ndim or len(stored) != 2:
        raise ValueError(
            f"the NVFP4 weight must be one matrix stored [N, K] (quantized along "
            f"K); got stored shape {stored} with {w.batch_ndim} vmapped axes"
        )
    if w.rht:
        raise ValueError(
            "the weight is Random-Hadamard-transformed along K, which only cancels "
            "against transformed activations: quantize x with rht=True as well"
        )
    n, k = stored
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x {x.shape} must end in the weight's K={k} (w is [N, K])")
    # The leading axes but the last are the primitive's batch: a sharded
    # batch or row axis stays where it is.
    lead = x.shape[:-1] or (1,)
    x3 = x.reshape(math.prod(lead[:-1]), lead[-1], k)
    out = implementation_ops(implementation).w4a16_matmul(
        x3,
        w.codes.reshape(1, n, k // 2),
        w.scales.reshape(1, n, k // BLOCK_SIZE),
        jnp.asarray(w.amax, jnp.float32).reshape(1),
        dtype=out_dtype,
    )
    return out.reshape(*x.shape[:-1], n)


def matmul(
    a: NVFP4Tensor | jax.Array,
    b: NVFP4Tensor,
    *,
    out_dtype=jnp.bfloat16,
    implementation: str = "ffi",
):
    """Multiplies two NVFP4 tensors over their quantized (contraction) axes.

    Args:
      a: stored ``[..., M, K]`` (quantized along K, e.g. activations
        ``quantize(x, -1)`` of x ``[..., M, K]``); or bfloat16 activations
        ``[..., K]`` themselves, for the weight-only GEMM (W4A16, serving):
        b must then be one weight stored ``[N, K]``.
      b: stored ``[N, K]`` or ``[..., N, K]`` with a's leading dims (e.g. a
        weight w ``[K, N]`` quantized along axis 0).
      out_dtype: bfloat16 or float32.

    Returns:
      ``[..., M, N]`` of ``out_dtype``: sum over k of a[..., m, k] * b[n, k].
    """
    implementation_ops(implementation)  # checks it
    if isinstance(b, NVFP4Tensor) and not isinstance(a, NVFP4Tensor):
        return _weight_only(a, b, _out_dtype(out_dtype), implementation)
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
    return matmul_gemm_operands(
        a, b, out_dtype=out_dtype, implementation=implementation
    )


def matmul_gemm_operands(
    a: NVFP4Tensor | DecodedOperand,
    b: NVFP4Tensor | DecodedOperand,
    *,
    out_dtype=jnp.bfloat16,
    implementation: str = "ffi",
):
    """``matmul`` of two operands without vmapped axes, either of which may
    be a ``DecodedOperand``: the training recipe's GEMMs."""
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
    out_dtype = _out_dtype(out_dtype)
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
