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

from jax_nvfp4 import _ffi_registry, cuda_gemm, partitioning, reference
from jax_nvfp4.format import holds_values
from jax_nvfp4.partitioning import Dim

__all__ = [
    "amax_p",
    "matmul_p",
    "dequantize_p",
    "quantize_cols_p",
    "quantize_rows_cols_decoded_p",
    "quantize_rows_cols_p",
    "quantize_rows_p",
]


def _codes_and_scales(batch, rows, length):
    return (
        jax.core.ShapedArray((batch, rows, length // 2), jnp.uint8),
        jax.core.ShapedArray((batch, rows, length // 16), jnp.float8_e4m3fn),
    )


def _quantize_rows_abstract(x, amax, key, origin, **params):
    del amax, key, origin, params
    b, m, k = x.shape
    return _codes_and_scales(b, m, k)


def _quantize_cols_abstract(x, amax, key, origin, **params):
    del amax, key, origin, params
    b, m, k = x.shape
    return _codes_and_scales(b, k, m)


def _quantize_rows_cols_abstract(x, row_amax, col_amax, key, origin, **params):
    del row_amax, col_amax, key, origin, params
    b, m, k = x.shape
    return (*_codes_and_scales(b, m, k), *_codes_and_scales(b, k, m))


def _quantize_rows_cols_decoded_abstract(
    x, row_amax, col_amax, key, origin, *, row_decoded, col_decoded, **params
):
    """As quantize_rows_cols, a decoded side's codes replaced by bfloat16
    values [b, rows, len]."""
    del row_amax, col_amax, key, origin, params
    b, m, k = x.shape
    row_codes, row_scales = _codes_and_scales(b, m, k)
    col_codes, col_scales = _codes_and_scales(b, k, m)
    if row_decoded:
        row_codes = jax.core.ShapedArray((b, m, k), jnp.bfloat16)
    if col_decoded:
        col_codes = jax.core.ShapedArray((b, k, m), jnp.bfloat16)
    return row_codes, row_scales, col_codes, col_scales


def _amax_abstract(x, *, rht_axis):
    del rht_axis
    return jax.core.ShapedArray((x.shape[0], 2), jnp.float32)


def _dequantize_abstract(codes, scales, amax, *, dtype):
    del scales, amax
    b, r, half = codes.shape
    return jax.core.ShapedArray((b, r, 2 * half), dtype)


# --- shard_map: outputs vary over the manual axes that the inputs vary over -


def _varying(aval) -> frozenset:
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", frozenset())
    return frozenset(vma)


def _with_varying(out, avals):
    """Gives abstract outputs the manual-axis variance of all inputs together
    (inside shard_map with check_vma; a no-op elsewhere)."""
    varying = frozenset().union(*(_varying(a) for a in avals))
    if not varying:
        return out
    from jax._src import core as jax_core  # the current (manual) mesh

    def one(o):
        sharding = jax_core.get_cur_mesh_sharding()
        if hasattr(avals[0], "mat"):  # jax 0.10: ManualAxisType
            mat = jax_core.ManualAxisType(varying=varying)
            return o.update(sharding=sharding, manual_axis_type=mat)
        return o.update(sharding=sharding, vma=varying)

    return [one(o) for o in out] if isinstance(out, list | tuple) else one(out)


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


def _per_batch_item(a, d, size, batch, width=1):
    """Folds a per-item operand and repeats it to one entry per item of the
    folded batch, so that a sharded batch axis carries its amaxes and keys
    along (a [n] operand with 1 < n < batch could not follow the batch's
    sharding)."""
    a = _fold_per_item(a, d, size, width)
    return jnp.repeat(a, batch // a.shape[0], axis=0) if a.shape[0] != batch else a


def _unfold(outs, size):
    outs = [o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outs]
    return outs, [0] * len(outs)


def _unbatched_origin(origin, d):
    if d is not None:
        raise NotImplementedError(
            "vmap over the origin operand of a quantize primitive is not supported"
        )
    return origin


def _example_batch(x, xd, params):
    """The stochastic-rounding index restarts at every vmap example (of
    x.shape[0] matrices), as in a loop over the examples; a nested vmap keeps
    the innermost example's size."""
    if params.get("example_batch", 0) == 0:
        params = {**params, "example_batch": x.shape[1 if xd == 0 else 0]}
    return params


def _quantize_batch(prim, args, dims, **params):
    x, amax, key, origin = args
    xd, ad, kd, od = dims
    size = _batch_size(args, dims)
    params = _example_batch(x, xd, params)
    x = _fold(x, xd, size)
    batch = x.shape[0]
    outs = prim.bind(
        x,
        _per_batch_item(amax, ad, size, batch),
        _per_batch_item(key, kd, size, batch, 2),
        _unbatched_origin(origin, od),
        **params,
    )
    return _unfold(outs, size)


def _quantize_rows_cols_batch(args, dims, prim=None, **params):
    x, row_amax, col_amax, key, origin = args
    xd, rd, cd, kd, od = dims
    size = _batch_size(args, dims)
    params = _example_batch(x, xd, params)
    x = _fold(x, xd, size)
    batch = x.shape[0]
    outs = (prim or quantize_rows_cols_p).bind(
        x,
        _per_batch_item(row_amax, rd, size, batch),
        _per_batch_item(col_amax, cd, size, batch),
        _per_batch_item(key, kd, size, batch, 2),
        _unbatched_origin(origin, od),
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
    codes = _fold(codes, dims[0], size)
    out = dequantize_p.bind(
        codes,
        _fold(scales, dims[1], size),
        _per_batch_item(amax, dims[2], size, codes.shape[0]),
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


def _ffi_rule(target, drop=(), applies=None, otherwise=None):
    """The lowering to the FFI handler `target`, with the params in `drop`
    left out of its attributes; where ``applies(operand avals)`` is False,
    the lowering `otherwise` instead."""
    rule = jax.ffi.ffi_lowering(target)

    def lowering(ctx, *args, **params):
        if applies is not None and not applies(ctx.avals_in):
            return otherwise(ctx, *args, **params)
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
    layout,
    *,
    multiple,
    drop=(),
    lowerings=None,
    origin_arg=None,
    handler_applies=None,
):
    """Two primitives: ``name`` (the public one: abstract eval, batching,
    impl, and a lowering that partitions by ``layout`` under sharded jit) and
    ``name_local`` (one shard's work: the FFI handler, a platform-specific
    pure-JAX path, or the reference). ``handler_applies(operand avals)``:
    whether the handlers take these operands (else the reference lowers it
    there)."""

    def abstract_eval(*avals, **params):
        return _with_varying(abstract(*avals, **params), avals)

    local = Primitive(name + "_local")
    local.multiple_results = multiple
    local.def_abstract_eval(abstract_eval)
    # The reference is the default lowering; handler platforms override it.
    reference_lowering = mlir.lower_fun(reference_fn, multiple_results=multiple)
    mlir.register_lowering(local, reference_lowering)
    # Platform-specific pure-JAX paths (e.g. the Hopper GEMM), then handlers.
    for platform, fn in (lowerings or {}).items():
        mlir.register_lowering(
            local, mlir.lower_fun(fn, multiple_results=multiple), platform=platform
        )
    for platform, targets in _ffi_registry.registered_targets().items():
        if target in targets:
            mlir.register_lowering(
                local,
                _ffi_rule(target, drop, handler_applies, reference_lowering),
                platform=platform,
            )

    def local_fn(*args, **params):
        out = local.bind(*args, **params)
        return tuple(out) if multiple else out

    prim = Primitive(name)
    prim.multiple_results = multiple
    prim.def_abstract_eval(abstract_eval)
    prim.def_impl(
        lambda *args, **params: _jitted_bind(prim, tuple(sorted(params.items())))(*args)
    )
    batching.primitive_batchers[prim] = batch_rule
    ad.primitive_jvps[prim] = functools.partial(_no_derivative, name)
    sharded = partitioning.partitioned(local_fn, layout, origin_arg=origin_arg)
    mlir.register_lowering(prim, mlir.lower_fun(sharded, multiple_results=multiple))
    partitioning.needs_devices_during_lowering(prim)
    return prim


# --- layouts: how each primitive's dimensions partition -----------------------

_B = "batch"


def _per_item(n, batch):
    """A per-batch-item operand ([n] or [n, 2]) follows the batch if n > 1."""
    return Dim(_B if n == batch and n > 1 else None)


def _quantize_layout(
    shapes,
    *,
    along_m_rows,
    along_m_cols,
    tile16_rows=False,
    tile16_cols=False,
    rows_cols=False,
    row_decoded=False,
    col_decoded=False,
):
    """x [b, m, k]; outputs quantized along k (rows) and/or along m (cols).
    A quantized axis is a factor counting 16-element blocks; the other axis
    of a 16x16 tile too. A decoded output holds 16 values per block, codes 8
    bytes."""
    (batch, m, k) = shapes[0]
    m_blocked = along_m_cols or tile16_rows
    k_blocked = along_m_rows or tile16_cols
    units = {
        _B: batch,
        "m": m // 16 if m_blocked else m,
        "k": k // 16 if k_blocked else k,
    }
    granule = {"m": 16 if m_blocked else 1, "k": 16 if k_blocked else 1}

    def axis(f, blocked, per):
        return Dim(f, per if blocked else 1)

    x = (Dim(_B), axis("m", m_blocked, 16), axis("k", k_blocked, 16))
    rows_out = (
        (Dim(_B), axis("m", m_blocked, 16), Dim("k", 16 if row_decoded else 8)),
        (Dim(_B), axis("m", m_blocked, 16), Dim("k")),
    )
    cols_out = (
        (Dim(_B), axis("k", k_blocked, 16), Dim("m", 16 if col_decoded else 8)),
        (Dim(_B), axis("k", k_blocked, 16), Dim("m")),
    )
    n_amax = [s[0] for s in shapes[1:-2]]
    n_key = shapes[-2][0]
    operands = (
        x,
        *[(_per_item(n, batch),) for n in n_amax],
        (_per_item(n_key, batch), Dim(None)),
        (Dim(None),),
    )
    if rows_cols:
        results = (*rows_out, *cols_out)
    elif along_m_rows:
        results = rows_out
    else:
        results = cols_out
    return partitioning.Layout(
        operands=operands,
        results=results,
        sizes=units,
        granule=granule,
        origin=(_B, "m", "k"),
        names={_B: "batch", "m": "row (m)", "k": "column (k)"},
    )


def _rows_layout(shapes, *, tile_rows, **_):
    return _quantize_layout(
        shapes, along_m_rows=True, along_m_cols=False, tile16_rows=tile_rows == 16
    )


def _cols_layout(shapes, *, tile_rows, **_):
    return _quantize_layout(
        shapes, along_m_rows=False, along_m_cols=True, tile16_cols=tile_rows == 16
    )


def _rows_cols_layout(shapes, row_decoded=False, col_decoded=False, **_):
    return _quantize_layout(
        shapes,
        along_m_rows=True,
        along_m_cols=True,
        rows_cols=True,
        row_decoded=row_decoded,
        col_decoded=col_decoded,
    )


def _amax_layout(shapes, *, rht_axis):
    ((batch, m, k),) = shapes
    m_blocked, k_blocked = rht_axis == 1, rht_axis == 2
    return partitioning.Layout(
        operands=(
            (
                Dim(_B),
                Dim("m", 16 if m_blocked else 1),
                Dim("k", 16 if k_blocked else 1),
            ),
        ),
        results=((Dim(_B), Dim(None)),),
        sizes={
            _B: batch,
            "m": m // 16 if m_blocked else m,
            "k": k // 16 if k_blocked else k,
        },
        granule={"m": 16 if m_blocked else 1, "k": 16 if k_blocked else 1},
        reduce={"m": "max", "k": "max"},
        names={_B: "batch", "m": "row (m)", "k": "column (k)"},
    )


def _dequantize_layout(shapes, **_):
    (batch, rows, half), _, (n_amax,) = shapes
    return partitioning.Layout(
        operands=(
            (Dim(_B), Dim("r"), Dim("l", 8)),
            (Dim(_B), Dim("r"), Dim("l")),
            (_per_item(n_amax, batch),),
        ),
        results=((Dim(_B), Dim("r"), Dim("l", 16)),),
        sizes={_B: batch, "r": rows, "l": half // 8},
        granule={"l": 16},
        names={_B: "batch", "r": "row", "l": "quantized"},
    )


def _matmul_layout(shapes, **_):
    """Codes hold 8 bytes per 16-element block of k, decoded operands (their
    bfloat16 values) 16."""
    (batch, m, a_len), (_, _, blocks), (n_a,), (batch_b, n, b_len), _, (n_b,) = shapes
    a_decoded = a_len == 16 * blocks != 0
    b_decoded = b_len == 16 * blocks != 0
    b_batch = Dim(_B) if batch_b == batch and batch > 1 else Dim(None)
    return partitioning.Layout(
        operands=(
            (Dim(_B), Dim("m"), Dim("k", 16 if a_decoded else 8)),
            (Dim(_B), Dim("m"), Dim("k")),
            (_per_item(n_a, batch),),
            (b_batch, Dim("n"), Dim("k", 16 if b_decoded else 8)),
            (b_batch, Dim("n"), Dim("k")),
            (_per_item(n_b, batch) if n_b == batch_b else Dim(None),),
        ),
        results=((Dim(_B), Dim("m"), Dim("n")),),
        sizes={_B: batch, "m": m, "n": n, "k": blocks},
        granule={"k": 16},
        reduce={"k": "sum"},
        names={_B: "batch", "m": "row (m)", "n": "column (n)", "k": "contraction (k)"},
    )


quantize_rows_p = _define(
    "nvfp4_quantize_rows",
    "jax_nvfp4_quantize_rows",
    _quantize_rows_abstract,
    reference.quantize_rows,
    lambda args, dims, **p: _quantize_batch(quantize_rows_p, args, dims, **p),
    _rows_layout,
    multiple=True,
    origin_arg=3,
)
quantize_cols_p = _define(
    "nvfp4_quantize_cols",
    "jax_nvfp4_quantize_cols",
    _quantize_cols_abstract,
    reference.quantize_cols,
    lambda args, dims, **p: _quantize_batch(quantize_cols_p, args, dims, **p),
    _cols_layout,
    multiple=True,
    origin_arg=3,
)
quantize_rows_cols_p = _define(
    "nvfp4_quantize_rows_cols",
    "jax_nvfp4_quantize_rows_cols",
    _quantize_rows_cols_abstract,
    reference.quantize_rows_cols,
    _quantize_rows_cols_batch,
    _rows_cols_layout,
    multiple=True,
    origin_arg=4,
)


def _rows_cols_decoded_by_codes_handler(
    x, row_amax, col_amax, key, origin, *, row_decoded, col_decoded, **params
):
    """Where only the codes handler exists (CPU): it quantizes, XLA decodes."""
    shapes = [
        jax.ShapeDtypeStruct(a.shape, a.dtype)
        for a in _quantize_rows_cols_abstract(x, row_amax, col_amax, key, origin)
    ]
    outs = jax.ffi.ffi_call("jax_nvfp4_quantize_rows_cols", shapes)(
        x, row_amax, col_amax, key, origin, **params
    )
    return reference.decode_rows_cols(
        outs, row_decoded=row_decoded, col_decoded=col_decoded
    )


quantize_rows_cols_decoded_p = _define(
    "nvfp4_quantize_rows_cols_decoded",
    "jax_nvfp4_quantize_rows_cols_decoded",  # a CUDA handler only
    _quantize_rows_cols_decoded_abstract,
    reference.quantize_rows_cols_decoded,
    lambda args, dims, **p: _quantize_rows_cols_batch(
        args, dims, prim=quantize_rows_cols_decoded_p, **p
    ),
    _rows_cols_layout,
    multiple=True,
    origin_arg=4,
    lowerings={
        platform: _rows_cols_decoded_by_codes_handler
        for platform, targets in _ffi_registry.registered_targets().items()
        if "jax_nvfp4_quantize_rows_cols" in targets
    },
)
amax_p = _define(
    "nvfp4_amax",
    "jax_nvfp4_amax",
    _amax_abstract,
    reference.amax,
    _amax_batch,
    _amax_layout,
    multiple=False,
)
dequantize_p = _define(
    "nvfp4_dequantize",
    "jax_nvfp4_dequantize",
    _dequantize_abstract,
    reference.dequantize,
    _dequantize_batch,
    _dequantize_layout,
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
    _matmul_layout,
    multiple=False,
    drop=("dtype",),
    lowerings={"cuda": cuda_gemm.matmul_cuda},
    # The CPU handler multiplies codes; decoded operands (bfloat16 values in
    # place of the codes) take the twin there.
    handler_applies=lambda avals: (
        not (holds_values(avals[0]) or holds_values(avals[3]))
    ),
)


def matmul(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, *, dtype):
    """An operand's codes may be its bfloat16 values e2m1 * scale [batch,
    rows, K] (a decoded NVFP4Tensor's; ``format.holds_values``)."""
    return matmul_p.bind(
        a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, dtype=np.dtype(dtype)
    )


def _place(x, origin, params):
    """Defaults: x is the whole tensor (origin 0, global sizes = local)."""
    _, m, k = x.shape
    params["global_m"] = params.get("global_m") or m
    params["global_k"] = params.get("global_k") or k
    params.setdefault("example_batch", 0)  # set by the vmap rule
    return jnp.zeros(3, jnp.int32) if origin is None else origin, params


def quantize_rows(x, amax, key, origin=None, **params):
    origin, params = _place(x, origin, params)
    return tuple(quantize_rows_p.bind(x, amax, key, origin, **params))


def quantize_cols(x, amax, key, origin=None, **params):
    origin, params = _place(x, origin, params)
    return tuple(quantize_cols_p.bind(x, amax, key, origin, **params))


def quantize_rows_cols(x, row_amax, col_amax, key, origin=None, **params):
    origin, params = _place(x, origin, params)
    return tuple(
        quantize_rows_cols_p.bind(x, row_amax, col_amax, key, origin, **params)
    )


def quantize_rows_cols_decoded(x, row_amax, col_amax, key, origin=None, **params):
    origin, params = _place(x, origin, params)
    return tuple(
        quantize_rows_cols_decoded_p.bind(x, row_amax, col_amax, key, origin, **params)
    )


def amax(x, *, rht_axis):
    return amax_p.bind(x, rht_axis=rht_axis)


def dequantize(codes, scales, amax, *, dtype):
    return dequantize_p.bind(codes, scales, amax, dtype=np.dtype(dtype))
