"""The quantize primitives: x [batch, m, k] -> codes and scales along k
(``rows``), along m (``cols``, written transposed), or both in one pass.

Each quantized output is described by one ``QuantizeSpec``, the handlers'
``rows`` / ``cols`` attribute with the same field names
(``QuantizeOptions`` in C++). ``Place`` says where x sits in a larger tensor,
for the stochastic-rounding index. ``jax_nvfp4.quantize`` maps user shapes
and options onto these.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_nvfp4 import reference
from jax_nvfp4.backends import library
from jax_nvfp4.ops import batching, primitive
from jax_nvfp4.ops.sharding import BATCH, Dim, Layout, per_item

__all__ = [
    "Place",
    "QuantizeSpec",
    "fused_writes_values",
    "quantize_cols",
    "quantize_cols_p",
    "quantize_rows",
    "quantize_rows_cols",
    "quantize_rows_cols_p",
    "quantize_rows_p",
]


@dataclasses.dataclass(frozen=True)
class QuantizeSpec:
    """How one quantized output is made.

    Attributes:
      block_rows: 1 for 1x16 blocks; 16 for 16x16 tiles (one scale per tile,
        stored repeated in each of its 16 rows).
      stochastic: stochastic rounding of the elements (the scales always
        round to nearest).
      rht: Random Hadamard Transform of each 16-chunk along the quantized axis.
      stream: stochastic-rounding stream id in [0, 255].
      decoded: write the bfloat16 GEMM operand e2m1(code) * scale (exact; the
        amax not applied) in place of the codes; only the fused rows + cols
        quantize does (see ``fused_writes_values``).
    """

    block_rows: int = 1
    stochastic: bool = False
    rht: bool = False
    stream: int = 0
    decoded: bool = False


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a call's x [batch, m, k] sits in the whole tensor: the whole
    tensor's m and k (its origin is an operand, since it varies by shard), and
    ``example_batch`` > 0 when the batch folds vmap examples of that many
    matrices each (every example's element index then starts at 0, as a loop
    over the examples would draw)."""

    global_m: int
    global_k: int
    example_batch: int = 0

    # A global size of 0 is the call's own size along that axis: the whole
    # tensor is quantized there. FFI attributes must be static, and under
    # jax.export's shape polymorphism the call's own size may be symbolic;
    # the handlers (and the reference) resolve 0 from the operand's shape.


def fused_writes_values(dtype, rows: QuantizeSpec, cols: QuantizeSpec) -> bool:
    """Whether the fused quantize can write decoded outputs for these options:
    the rule of the CUDA fused kernel, asked of the compiled extension (False
    without one). Every backend follows it, so that results do not depend on
    where they were computed."""
    ext = library.extension()
    if ext is None:
        return False
    return bool(
        ext.fused_quantize_writes_values(
            jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16),
            rows.block_rows,
            rows.rht,
            cols.block_rows,
            cols.rht,
        )
    )


def _values_and_scales(batch, rows, length, decoded=False):
    values = (
        jax.core.ShapedArray((batch, rows, length), jnp.bfloat16)
        if decoded
        else jax.core.ShapedArray((batch, rows, length // 2), jnp.uint8)
    )
    return values, jax.core.ShapedArray((batch, rows, length // 16), jnp.float8_e4m3fn)


def _rows_abstract(x, amax, key, origin, *, rows, place):
    b, m, k = x.shape
    return _values_and_scales(b, m, k)


def _cols_abstract(x, amax, key, origin, *, cols, place):
    b, m, k = x.shape
    return _values_and_scales(b, k, m)


def _rows_cols_abstract(x, row_amax, col_amax, key, origin, *, rows, cols, place):
    b, m, k = x.shape
    return (
        *_values_and_scales(b, m, k, rows.decoded),
        *_values_and_scales(b, k, m, cols.decoded),
    )


# --- layouts: how the dimensions partition -------------------------------------


def _layout(shapes, rows: QuantizeSpec | None, cols: QuantizeSpec | None) -> Layout:
    """x [b, m, k]; outputs quantized along k (rows) and/or along m (cols).
    A quantized axis is a factor counting 16-element blocks, and so is the
    other axis of a 16x16 tile. Codes hold 8 bytes per block, decoded values
    16."""
    (batch, m, k) = shapes[0]
    m_blocked = cols is not None or (rows is not None and rows.block_rows == 16)
    k_blocked = rows is not None or (cols is not None and cols.block_rows == 16)

    def axis(f, blocked):
        return Dim(f, 16 if blocked else 1)

    def output(spec, rows_factor, len_factor):
        blocked = m_blocked if rows_factor == "m" else k_blocked
        return (
            (
                Dim(BATCH),
                axis(rows_factor, blocked),
                Dim(len_factor, 16 if spec.decoded else 8),
            ),
            (Dim(BATCH), axis(rows_factor, blocked), Dim(len_factor)),
        )

    results = ()
    if rows is not None:
        results += output(rows, "m", "k")
    if cols is not None:
        results += output(cols, "k", "m")
    n_amax = [s[0] for s in shapes[1:-2]]
    n_key = shapes[-2][0]
    return Layout(
        operands=(
            (Dim(BATCH), axis("m", m_blocked), axis("k", k_blocked)),
            *[(per_item(n, batch),) for n in n_amax],
            (per_item(n_key, batch), Dim(None)),
            (Dim(None),),
        ),
        results=results,
        sizes={
            BATCH: batch,
            "m": m // 16 if m_blocked else m,
            "k": k // 16 if k_blocked else k,
        },
        granule={"m": 16 if m_blocked else 1, "k": 16 if k_blocked else 1},
        origin=(BATCH, "m", "k"),
        names={BATCH: "batch", "m": "row (m)", "k": "column (k)"},
    )


# --- batching: fold the vmapped axis into the leading batch axis ----------------


def _unbatched_origin(origin, d):
    if d is not None:
        raise NotImplementedError(
            "vmap over the origin operand of a quantize primitive is not supported"
        )
    return origin


def _batch(prim, args, dims, *, place, **specs):
    """Folds the vmapped axis into the batch. The stochastic-rounding index
    restarts at every vmap example (of x.shape[0] matrices), as in a loop over
    the examples; a nested vmap keeps the innermost example's size."""
    x, *amaxes, key, origin = args
    xd, *amax_dims, kd, od = dims
    size = batching.batch_size(args, dims)
    if place.example_batch == 0:
        place = dataclasses.replace(place, example_batch=x.shape[1 if xd == 0 else 0])
    x = batching.fold(x, xd, size)
    batch = x.shape[0]
    outs = prim.bind(
        x,
        *[
            batching.per_batch_item(a, d, size, batch)
            for a, d in zip(amaxes, amax_dims, strict=True)
        ],
        batching.per_batch_item(key, kd, size, batch, 2),
        _unbatched_origin(origin, od),
        place=place,
        **specs,
    )
    return batching.unfold(outs, size)


def _define(name, target, abstract, reference_fn, layout, origin_arg):
    def batch_rule(args, dims, **params):
        return _batch(prim, args, dims, **params)

    prim = primitive.define(
        name,
        target,
        abstract,
        reference_fn,
        batch_rule,
        layout,
        multiple=True,
        origin_arg=origin_arg,
    )
    return prim


quantize_rows_p = _define(
    "nvfp4_quantize_rows",
    "jax_nvfp4_quantize_rows",
    _rows_abstract,
    reference.quantize_rows,
    lambda shapes, *, rows, place: _layout(shapes, rows, None),
    origin_arg=3,
)
quantize_cols_p = _define(
    "nvfp4_quantize_cols",
    "jax_nvfp4_quantize_cols",
    _cols_abstract,
    reference.quantize_cols,
    lambda shapes, *, cols, place: _layout(shapes, None, cols),
    origin_arg=3,
)
quantize_rows_cols_p = _define(
    "nvfp4_quantize_rows_cols",
    "jax_nvfp4_quantize_rows_cols",
    _rows_cols_abstract,
    reference.quantize_rows_cols,
    lambda shapes, *, rows, cols, place: _layout(shapes, rows, cols),
    origin_arg=4,
)


def _static_or_own(size) -> int:
    return size if isinstance(size, int) else 0


def _placed(x, origin, place):
    """Defaults: x is the whole tensor (origin 0, global sizes = local; a
    symbolic size, under jax.export, is passed as 0: see Place)."""
    _, m, k = x.shape
    if place is None:
        place = Place(global_m=_static_or_own(m), global_k=_static_or_own(k))
    return (jnp.zeros(3, jnp.int32) if origin is None else origin), place


def _check_single(spec: QuantizeSpec):
    if spec.decoded:
        raise ValueError(
            "only the fused rows + cols quantize writes decoded outputs; "
            "use quantize_rows_cols"
        )


def quantize_rows(x, amax, key, origin=None, *, rows: QuantizeSpec, place=None):
    """x [b, m, k] -> (codes [b, m, k/2], scales [b, m, k/16]) along k."""
    _check_single(rows)
    origin, place = _placed(x, origin, place)
    return tuple(quantize_rows_p.bind(x, amax, key, origin, rows=rows, place=place))


def quantize_cols(x, amax, key, origin=None, *, cols: QuantizeSpec, place=None):
    """x [b, m, k] -> (codes [b, k, m/2], scales [b, k, m/16]) along m."""
    _check_single(cols)
    origin, place = _placed(x, origin, place)
    return tuple(quantize_cols_p.bind(x, amax, key, origin, cols=cols, place=place))


def quantize_rows_cols(
    x, row_amax, col_amax, key, origin=None, *, rows, cols, place=None
):
    """Both quantizations of x [b, m, k] in one pass: (row codes or values,
    row scales, col codes or values, col scales)."""
    origin, place = _placed(x, origin, place)
    return tuple(
        quantize_rows_cols_p.bind(
            x, row_amax, col_amax, key, origin, rows=rows, cols=cols, place=place
        )
    )
