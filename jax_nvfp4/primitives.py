"""JAX primitives backed by the FFI handlers.

Each primitive has: an abstract evaluation (shapes and dtypes), a lowering to
its FFI custom call on every platform with handlers (CPU; CUDA when built)
and to the pure-JAX twin in ``jax_nvfp4.reference`` elsewhere, an eager
implementation (a jitted bind) and a batching rule that folds the vmapped
axis into the handlers' leading batch axis. Operands use the handlers' rank-3
layout ``[batch, m, k]``; ``jax_nvfp4.quantize`` maps user shapes onto it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_nvfp4 import _ffi_registry, reference

__all__ = [
    "amax_p",
    "matmul_p",
    "dequantize_p",
    "quantize_cols_p",
    "quantize_rows_cols_p",
    "quantize_rows_p",
]


def _codes_and_scales(batch, rows, length):
    return (
        jax.core.ShapedArray((batch, rows, length // 2), jnp.uint8),
        jax.core.ShapedArray((batch, rows, length // 16), jnp.float8_e4m3fn),
    )


def _quantize_rows_abstract(x, amax, key, **params):
    del amax, key, params
    b, m, k = x.shape
    return _codes_and_scales(b, m, k)


def _quantize_cols_abstract(x, amax, key, **params):
    del amax, key, params
    b, m, k = x.shape
    return _codes_and_scales(b, k, m)


def _quantize_rows_cols_abstract(x, row_amax, col_amax, key, **params):
    del row_amax, col_amax, key, params
    b, m, k = x.shape
    return (*_codes_and_scales(b, m, k), *_codes_and_scales(b, k, m))


def _amax_abstract(x, *, rht_axis):
    del rht_axis
    return jax.core.ShapedArray((x.shape[0], 2), jnp.float32)


def _dequantize_abstract(codes, scales, amax, *, dtype):
    del scales, amax
    b, r, half = codes.shape
    return jax.core.ShapedArray((b, r, 2 * half), dtype)


# --- batching: fold the vmapped axis into the leading batch axis -----------


def _batch_size(args, dims):
    return next(a.shape[d] for a, d in zip(args, dims, strict=False) if d is not None)


def _to_front(a, d, size):
    """Moves the vmapped axis d of a to the front (broadcasting if unmapped)."""
    if d is None:  # batching.not_mapped
        return jnp.broadcast_to(a, (size, *a.shape))
    return jnp.moveaxis(a, d, 0)


def _fold(a, d, size):
    """[size, b, ...] -> [size * b, ...]."""
    a = _to_front(a, d, size)
    return a.reshape(size * a.shape[1], *a.shape[2:])


def _fold_per_item(a, d, size, width=1):
    """Per-batch-item arrays (amax [n], key [n, 2]) -> [size * n, ...]."""
    a = _to_front(a, d, size)
    return a.reshape(-1, width) if width > 1 else a.reshape(-1)


def _unfold(outs, size):
    outs = [o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outs]
    return outs, [0] * len(outs)


def _quantize_batch(prim, args, dims, **params):
    x, amax, key = args
    xd, ad, kd = dims
    size = _batch_size(args, dims)
    outs = prim.bind(
        _fold(x, xd, size),
        _fold_per_item(amax, ad, size),
        _fold_per_item(key, kd, size, 2),
        **params,
    )
    return _unfold(outs, size)


def _quantize_rows_cols_batch(args, dims, **params):
    x, row_amax, col_amax, key = args
    xd, rd, cd, kd = dims
    size = _batch_size(args, dims)
    outs = quantize_rows_cols_p.bind(
        _fold(x, xd, size),
        _fold_per_item(row_amax, rd, size),
        _fold_per_item(col_amax, cd, size),
        _fold_per_item(key, kd, size, 2),
        **params,
    )
    return _unfold(outs, size)


def _amax_batch(args, dims, *, rht_axis):
    (x,), (xd,) = args, dims
    size = _batch_size(args, dims)
    out = amax_p.bind(_fold(x, xd, size), rht_axis=rht_axis)
    return out.reshape(size, -1, 2), 0


def _dequantize_batch(args, dims, *, dtype):
    codes, scales, amax = args
    size = _batch_size(args, dims)
    out = dequantize_p.bind(
        _fold(codes, dims[0], size),
        _fold(scales, dims[1], size),
        _fold_per_item(amax, dims[2], size),
        dtype=dtype,
    )
    return out.reshape(size, -1, *out.shape[1:]), 0


# --- construction ----------------------------------------------------------


def _no_derivative(name, primals, tangents, **params):
    raise NotImplementedError(
        f"{name} has no derivative: NVFP4 quantization is piecewise constant. "
        "jax_nvfp4.dot defines its gradient with a custom VJP; higher-order "
        "derivatives (grad of grad, jvp) of it are not supported — differentiate "
        "a bf16 model (recipe=jax_nvfp4.BF16) for those."
    )


@functools.cache
def _jitted_bind(prim, params):
    return jax.jit(lambda *args: prim.bind(*args, **dict(params)))


def _ffi_rule(target, drop=()):
    rule = jax.ffi.ffi_lowering(target)

    def lowering(ctx, *args, **params):
        for name in drop:
            params.pop(name)
        return rule(ctx, *args, **params)

    return lowering


def _define(
    name,
    target,
    abstract,
    reference_fn,
    batch_rule,
    *,
    multiple,
    drop=(),
    lowerings=None,
):
    prim = Primitive(name)
    prim.multiple_results = multiple
    prim.def_abstract_eval(abstract)
    prim.def_impl(
        lambda *args, **params: _jitted_bind(prim, tuple(sorted(params.items())))(*args)
    )
    batching.primitive_batchers[prim] = batch_rule
    ad.primitive_jvps[prim] = functools.partial(_no_derivative, name)
    # The reference is the default lowering; handler platforms override it.
    mlir.register_lowering(
        prim, mlir.lower_fun(reference_fn, multiple_results=multiple)
    )
    # Platform-specific pure-JAX paths (e.g. the Hopper GEMM), then handlers.
    for platform, fn in (lowerings or {}).items():
        mlir.register_lowering(
            prim, mlir.lower_fun(fn, multiple_results=multiple), platform=platform
        )
    for platform, targets in _ffi_registry.registered_targets().items():
        if target in targets:
            mlir.register_lowering(prim, _ffi_rule(target, drop), platform=platform)
    return prim


quantize_rows_p = _define(
    "nvfp4_quantize_rows",
    "jax_nvfp4_quantize_rows",
    _quantize_rows_abstract,
    reference.quantize_rows,
    lambda args, dims, **p: _quantize_batch(quantize_rows_p, args, dims, **p),
    multiple=True,
)
quantize_cols_p = _define(
    "nvfp4_quantize_cols",
    "jax_nvfp4_quantize_cols",
    _quantize_cols_abstract,
    reference.quantize_cols,
    lambda args, dims, **p: _quantize_batch(quantize_cols_p, args, dims, **p),
    multiple=True,
)
quantize_rows_cols_p = _define(
    "nvfp4_quantize_rows_cols",
    "jax_nvfp4_quantize_rows_cols",
    _quantize_rows_cols_abstract,
    reference.quantize_rows_cols,
    _quantize_rows_cols_batch,
    multiple=True,
)
amax_p = _define(
    "nvfp4_amax",
    "jax_nvfp4_amax",
    _amax_abstract,
    reference.amax,
    _amax_batch,
    multiple=False,
)
dequantize_p = _define(
    "nvfp4_dequantize",
    "jax_nvfp4_dequantize",
    _dequantize_abstract,
    reference.dequantize,
    _dequantize_batch,
    multiple=False,
    drop=("dtype",),
)


def _matmul_abstract(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, *, dtype):
    del a_scales, a_amax, b_scales, b_amax
    return jax.core.ShapedArray((*a_codes.shape[:2], b_codes.shape[1]), dtype)


def _per_item_amax(amax, d, size, count):
    """amax with 1 or `count` values per vmapped item -> [size * count]."""
    amax = _to_front(amax, d, size).reshape(size, -1)
    if amax.shape[1] == 1:
        amax = jnp.repeat(amax, count, axis=1)
    return amax.reshape(-1)


def _matmul_batch(args, dims, *, dtype):
    """Folds the vmapped axis into the GEMM batch; amaxes become per item."""
    size = _batch_size(args, dims)
    (a_codes, a_scales, a_amax, b_codes, b_scales, b_amax) = args
    per_a = _to_front(a_codes, dims[0], size).shape[1]
    a_codes, a_scales = _fold(a_codes, dims[0], size), _fold(a_scales, dims[1], size)
    a_amax = _per_item_amax(a_amax, dims[2], size, per_a)
    if all(d is None for d in dims[3:]) and b_codes.shape[0] == 1:
        pass  # one b shared by every item
    else:
        b_front = _to_front(b_codes, dims[3], size)
        per_b = b_front.shape[1]
        b_codes, b_scales = (
            _fold(b_codes, dims[3], size),
            _fold(b_scales, dims[4], size),
        )
        b_amax = _per_item_amax(b_amax, dims[5], size, per_b)
        if per_b != per_a:  # one b matrix per item, shared by a's batch
            b_codes = jnp.repeat(b_codes, per_a, axis=0)
            b_scales = jnp.repeat(b_scales, per_a, axis=0)
            b_amax = jnp.repeat(b_amax, per_a)
    out = matmul_p.bind(
        a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, dtype=dtype
    )
    return out.reshape(size, -1, *out.shape[1:]), 0


matmul_p = _define(
    "nvfp4_matmul",
    "jax_nvfp4_matmul",
    _matmul_abstract,
    reference.matmul,
    _matmul_batch,
    multiple=False,
    drop=("dtype",),
    lowerings={"cuda": reference.matmul_dequantize_bf16},
)


def matmul(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, *, dtype):
    return matmul_p.bind(
        a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, dtype=np.dtype(dtype)
    )


def quantize_rows(x, amax, key, **params):
    return tuple(quantize_rows_p.bind(x, amax, key, **params))


def quantize_cols(x, amax, key, **params):
    return tuple(quantize_cols_p.bind(x, amax, key, **params))


def quantize_rows_cols(x, row_amax, col_amax, key, **params):
    return tuple(quantize_rows_cols_p.bind(x, row_amax, col_amax, key, **params))


def amax(x, *, rht_axis):
    return amax_p.bind(x, rht_axis=rht_axis)


def dequantize(codes, scales, amax, *, dtype):
    return dequantize_p.bind(codes, scales, amax, dtype=np.dtype(dtype))
