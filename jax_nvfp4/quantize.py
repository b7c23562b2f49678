"""Public NVFP4 quantize / dequantize API.

``quantize`` maps any shape and quantized axis onto the primitives' rank-3
``[batch, m, k]`` layout without a transpose: quantizing the last axis is the
row-wise primitive, any other axis the column-wise one (which reads the
matrix once and writes it transposed). ``quantize_rowwise_and_columnwise``
is the fused pass that the training recipe needs for X and dY.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import ops, reference
from jax_nvfp4.format import (
    BLOCK_SIZE,
    Block,
    NVFP4Tensor,
    Rounding,
    holds_values,
    is_supported_input_dtype,
)

__all__ = [
    "dequantize",
    "global_amax",
    "quantize",
    "quantize_rowwise_and_columnwise",
]

Implementation = Literal["ffi", "reference"]
# The pure-JAX twin counts Philox's block counters f // 16 in uint32 (2^36
# elements); the limit keeps a factor of two in hand.
_MAX_STOCHASTIC_ELEMENTS = 2**35


def implementation_ops(implementation: Implementation):
    """The module whose functions run the ops: the primitives or their twins."""
    if implementation == "ffi":
        return ops
    if implementation == "reference":
        return reference
    raise ValueError(
        f"implementation must be 'ffi' or 'reference', got {implementation!r}"
    )


def _check_input(x, name="x") -> jax.Array:
    if not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if not is_supported_input_dtype(x.dtype):
        raise TypeError(
            f"{name} has dtype {x.dtype}; NVFP4 quantization takes float32, "
            f"bfloat16 or float16 — cast it first, e.g. {name}.astype(jnp.float32)"
        )
    if x.ndim == 0:
        raise ValueError(
            f"{name} is a scalar; NVFP4 quantizes blocks of 16 elements along "
            "an axis — pass an array with at least one axis"
        )
    return x


def _normalize_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for an array of rank {ndim}")
    return axis % ndim


def _check_multiple_of_16(shape, axis: int, what: str):
    if shape[axis] % BLOCK_SIZE:
        raise ValueError(
            f"axis {axis} has length {shape[axis]}; {what} needs a multiple of "
            f"{BLOCK_SIZE} — pad it or quantize another axis"
        )


def _block_rows(block: Block) -> int:
    if block == "1x16":
        return 1
    if block == "16x16":
        return 16
    raise ValueError(f"block must be '1x16' or '16x16', got {block!r}")


def _is_stochastic(rounding: Rounding) -> bool:
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(
            f"rounding must be 'nearest' or 'stochastic', got {rounding!r}"
        )
    return rounding == "stochastic"


def _warn_unused_key(key, stochastic: bool) -> None:
    if key is not None and not stochastic:
        warnings.warn(
            "a key was passed with rounding='nearest', which draws no random "
            "bits: it is ignored (pass rounding='stochastic' to use it)",
            stacklevel=3,
        )


def key_words(key, stochastic: bool, size: int) -> jax.Array:
    """The two uint32 words that key the stochastic-rounding generator, [1, 2].

    A threefry key (``jax.random.key`` or a legacy ``PRNGKey``) is used as is;
    keys of other implementations are first hashed to two words.
    """
    if not stochastic:
        return jnp.zeros((1, 2), jnp.uint32)
    if key is None:
        raise ValueError(
            "rounding='stochastic' needs a PRNG key: pass key=jax.random.key(seed) "
            "(a new key each step)"
        )
    # (A symbolic size, under jax.export's shape polymorphism, is not checked.)
    if isinstance(size, int) and size >= _MAX_STOCHASTIC_ELEMENTS:
        raise ValueError(
            f"stochastic rounding supports tensors of fewer than 2**35 elements; "
            f"this one has {size} — quantize it in pieces"
        )
    if not hasattr(key, "dtype"):
        raise ValueError(
            "key must be a jax.random.key(...) or a uint32[2] PRNGKey, got "
            f"{type(key).__name__} {key!r}"
        )
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(
                f"key must be a single PRNG key (shape ()), got shape {key.shape}"
            )
        data = jax.random.key_data(key)
        if data.shape != (2,) or data.dtype != jnp.uint32:
            data = jax.random.bits(key, (2,), jnp.uint32)
    else:
        if key.shape != (2,) or key.dtype != jnp.uint32:
            raise ValueError(
                "key must be a jax.random.key(...) or a uint32[2] PRNGKey, got "
                f"{key.dtype}{list(key.shape)}"
            )
        data = key
    return data.reshape(1, 2)


def _check_amax(amax, name="amax") -> jax.Array:
    amax = jnp.asarray(amax)
    if amax.size != 1 or amax.ndim > 1:
        raise ValueError(
            f"{name} must be a scalar (the max |x| of the whole tensor), got shape "
            f"{amax.shape}"
        )
    if not jnp.issubdtype(amax.dtype, jnp.floating):
        raise TypeError(f"{name} must be a float, got {amax.dtype}")
    amax = amax.astype(jnp.float32).reshape(())
    try:  # a concrete value can be checked; a traced one cannot
        value = float(amax)
    except (jax.errors.ConcretizationTypeError, TypeError):
        return amax
    if not (np.isfinite(value) and value > 0):
        raise ValueError(
            f"{name}={value} must be a finite, positive max |x| (0 would give "
            "all-zero scales); pass the tensor's amax, e.g. "
            "jax_nvfp4.global_amax(x), or leave it out"
        )
    return amax


def global_amax(
    x: jax.Array,
    axis: int = -1,
    *,
    rht: bool = False,
    implementation: Implementation = "ffi",
) -> jax.Array:
    """The float32 amax that ``quantize(x, axis, rht=rht)`` uses.

    max |x| over the whole tensor (NaN ignored); with ``rht``, the max of the
    bfloat16 Random-Hadamard-transformed values along ``axis``.
    """
    x = _check_input(x)
    if not rht:
        return implementation_ops(implementation).abs_max(x)
    axis = _normalize_axis(axis, x.ndim)
    _check_multiple_of_16(x.shape, axis, "the Random Hadamard Transform")
    x3, cols = _rank3(x, axis)
    return jnp.max(implementation_ops(implementation).amax(x3, cols=cols)[:, 1])


def _rank3(x, axis):
    """x viewed as [batch, m, k] with the quantized axis at k (cols False) or
    at m (cols True)."""
    shape = x.shape
    if axis == x.ndim - 1:
        return x.reshape(1, math.prod(shape[:-1]), shape[-1]), False
    before, after = math.prod(shape[:axis]), math.prod(shape[axis + 1 :])
    return x.reshape(before, shape[axis], after), True


def quantize(
    x: jax.Array,
    axis: int = -1,
    *,
    block: Block = "1x16",
    rounding: Rounding = "nearest",
    rht: bool = False,
    key: jax.Array | None = None,
    amax: jax.Array | None = None,
    stream: int = 0,
    implementation: Implementation = "ffi",
    _place=None,
) -> NVFP4Tensor:
    """Quantizes x to NVFP4 along ``axis``.

    Args:
      x: float32, bfloat16 or float16 array; ``x.shape[axis]`` a multiple of 16.
      axis: the quantized axis (blocks of 16 consecutive elements along it).
      block: ``"1x16"`` blocks, or ``"16x16"`` tiles (16 along ``axis`` times 16
        along the last axis, or along axis -2 when ``axis`` is the last), whose
        values are the same whichever of the two axes is quantized.
      rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (needs ``key``).
      rht: apply the Random Hadamard Transform to each 16-chunk along ``axis``
        first (the values are then stored transformed; see ``NVFP4Tensor.rht``).
      key: PRNG key for stochastic rounding; the random bits depend only on the
        key, ``stream`` and the element's index, on every backend.
      amax: the global amax to use (a scalar), e.g. one reduced across shards;
        computed from x when omitted.
      stream: stochastic-rounding stream id in [0, 255], to draw independent
        bits from one key for several quantizations.
      implementation: ``"ffi"`` (the custom calls) or ``"reference"`` (pure JAX).

    Returns:
      An ``NVFP4Tensor`` with codes ``[..., L/2]`` and scales ``[..., L/16]``,
      ``...`` being x's shape without ``axis``.
    """
    x = _check_input(x)
    axis = _normalize_axis(axis, x.ndim)
    _check_multiple_of_16(x.shape, axis, "NVFP4")
    block_rows = _block_rows(block)
    if block_rows == 16:
        if x.ndim < 2:
            raise ValueError(
                "block='16x16' needs an array of rank >= 2 (tiles span two axes); "
                "use block='1x16' for a vector"
            )
        other = x.ndim - 2 if axis == x.ndim - 1 else x.ndim - 1
        _check_multiple_of_16(x.shape, other, "a 16x16 tile")
    spec = ops.QuantizeSpec(
        block_rows=block_rows,
        stochastic=_is_stochastic(rounding),
        rht=rht,
        stream=_check_stream(stream),
    )
    impl = implementation_ops(implementation)
    _warn_unused_key(key, spec.stochastic)
    words = key_words(key, spec.stochastic, _global_size(x, _place))
    x3, cols = _rank3(x, axis)
    if amax is None:
        if rht:
            amax = jnp.max(impl.amax(x3, cols=cols)[:, 1])
        else:
            amax = reference.abs_max(x)
    else:
        amax = _check_amax(amax)
    origin, place = _placement(_place, x3)
    if cols:
        codes, scales = impl.quantize_cols(
            x3, amax.reshape(1), words, origin, cols=spec, place=place
        )
    else:
        codes, scales = impl.quantize_rows(
            x3, amax.reshape(1), words, origin, rows=spec, place=place
        )
    return _wrap(codes, scales, amax, x.shape, axis, block, rht)


def _global_size(x, place) -> int:
    """Elements of the whole tensor that x is a token shard of."""
    if place is None:
        return x.size
    return x.size // x.shape[0] * place[1]


def _placement(place, x3):
    """(origin, Place) for a quantize of x3 [b, m, k] that is one shard of a
    larger tensor; ``place`` = (m0, global_m) offsets the rows (the token axis
    of the training recipe). (None, None) when x3 is the whole."""
    if place is None:
        return None, None
    m0, global_m = place
    origin = jnp.stack([jnp.int32(0), jnp.asarray(m0, jnp.int32), jnp.int32(0)])
    return origin, ops.Place(global_m=global_m, global_k=x3.shape[2])


def _check_stream(stream: int) -> int:
    if not 0 <= stream <= 255:
        raise ValueError(f"stream must be in [0, 255], got {stream}")
    return stream


def _wrap(codes, scales, amax, shape, axis, block, rht) -> NVFP4Tensor:
    """codes: packed uint8 codes or (a decoded side) bfloat16 values."""
    rest = tuple(d for i, d in enumerate(shape) if i != axis)
    length = shape[axis]
    decoded = holds_values(codes)
    return NVFP4Tensor(
        codes=codes.reshape(*rest, length if decoded else length // 2),
        scales=scales.reshape(*rest, length // BLOCK_SIZE),
        amax=amax,
        shape=tuple(shape),
        axis=axis,
        block=block,
        rht=rht,
    )


def quantize_rowwise_and_columnwise(
    x: jax.Array,
    *,
    row_block: Block = "1x16",
    row_rounding: Rounding = "nearest",
    row_rht: bool = False,
    col_block: Block = "1x16",
    col_rounding: Rounding = "nearest",
    col_rht: bool = False,
    key: jax.Array | None = None,
    row_amax: jax.Array | None = None,
    col_amax: jax.Array | None = None,
    row_stream: int = 0,
    col_stream: int = 1,
    implementation: Implementation = "ffi",
    _place=None,
    _row_decoded: bool = False,
    _col_decoded: bool = False,
) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """Quantizes x [..., M, K] along K (row-wise) and along M (column-wise).

    One pass over x in the fused handler. The results equal
    ``quantize(x, -1, ...)`` and ``quantize(x, -2, ...)`` with the same options
    (and ``stream``); the column-wise copy is stored transposed,
    codes ``[..., K, M/2]``. Leading axes are independent matrices that share
    one global amax. For the training recipe, X and dY are [tokens, features]:
    the column-wise copy (typically with ``col_rht=True``) feeds WGRAD.

    ``_row_decoded`` / ``_col_decoded`` (the recipe's, on the Hopper GEMM
    path): return that side as a ``decoded`` NVFP4Tensor, its bfloat16 GEMM
    operand, written by the fused kernel in place of the codes -- for the
    options that kernel serves (``ops.fused_writes_values``); otherwise both
    sides come as codes.
    """
    x = _check_input(x)
    if x.ndim < 2:
        raise ValueError(
            f"x has rank {x.ndim}; row-wise and column-wise quantization needs a "
            "matrix [..., M, K]"
        )
    n = x.ndim
    _check_multiple_of_16(x.shape, n - 1, "row-wise NVFP4")
    _check_multiple_of_16(x.shape, n - 2, "column-wise NVFP4")
    row_spec = ops.QuantizeSpec(
        block_rows=_block_rows(row_block),
        stochastic=_is_stochastic(row_rounding),
        rht=row_rht,
        stream=_check_stream(row_stream),
    )
    col_spec = ops.QuantizeSpec(
        block_rows=_block_rows(col_block),
        stochastic=_is_stochastic(col_rounding),
        rht=col_rht,
        stream=_check_stream(col_stream),
    )
    impl = implementation_ops(implementation)
    _warn_unused_key(key, row_spec.stochastic or col_spec.stochastic)
    words = key_words(
        key, row_spec.stochastic or col_spec.stochastic, _global_size(x, _place)
    )
    x3 = x.reshape(math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])

    plain = None
    if col_amax is None:
        if col_rht:
            both = impl.amax(x3, cols=True)
            plain, col_amax = jnp.max(both[:, 0]), jnp.max(both[:, 1])
        else:
            plain = col_amax = reference.abs_max(x)
    else:
        col_amax = _check_amax(col_amax, "col_amax")
    if row_amax is None:
        if row_rht:
            row_amax = jnp.max(impl.amax(x3, cols=False)[:, 1])
        else:
            row_amax = plain if plain is not None else reference.abs_max(x)
    else:
        row_amax = _check_amax(row_amax, "row_amax")

    if (_row_decoded or _col_decoded) and ops.fused_writes_values(
        x.dtype, row_spec, col_spec
    ):
        row_spec = dataclasses.replace(row_spec, decoded=_row_decoded)
        col_spec = dataclasses.replace(col_spec, decoded=_col_decoded)
    origin, place = _placement(_place, x3)
    row_codes, row_scales, col_codes, col_scales = impl.quantize_rows_cols(
        x3,
        row_amax.reshape(1),
        col_amax.reshape(1),
        words,
        origin,
        rows=row_spec,
        cols=col_spec,
        place=place,
    )
    rows = _wrap(row_codes, row_scales, row_amax, x.shape, n - 1, row_block, row_rht)
    cols = _wrap(col_codes, col_scales, col_amax, x.shape, n - 2, col_block, col_rht)
    return rows, cols


def dequantize(
    t: NVFP4Tensor,
    dtype=jnp.bfloat16,
    *,
    implementation: Implementation = "ffi",
) -> jax.Array:
    """Decodes an NVFP4Tensor to ``dtype`` (bfloat16, float32 or float16).

    Returns an array of the logical shape ``t.shape``:
    ``e2m1(code) * (scale * amax / 2688)`` computed in float32, then rounded
    to ``dtype``. For a tensor quantized with ``rht=True`` these are the
    transformed values.
    """
    if not isinstance(t, NVFP4Tensor):
        raise TypeError(f"dequantize takes an NVFP4Tensor, got {type(t).__name__}")
    if t.decoded:
        raise ValueError(
            "this NVFP4Tensor holds its bfloat16 GEMM operand (decoded=True), "
            "not codes; only matmul takes it"
        )
    if t.batch_ndim:  # returned by vmap: [batch..., *t.shape]
        return jax.vmap(
            functools.partial(dequantize, dtype=dtype, implementation=implementation)
        )(t)
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        if dtype != jnp.dtype(jnp.float16):
            raise TypeError(
                f"dequantize produces float32, bfloat16 or float16, not {dtype}"
            )
        return dequantize(t, jnp.float32, implementation=implementation).astype(dtype)
    ops = implementation_ops(implementation)
    stored = t.stored_shape
    rows = math.prod(stored[:-1])
    # Rows merged first, the unit batch axis added after: one reshape doing
    # both is refused under vmap over Explicit-sharded axes (JAX 0.10).
    values = ops.dequantize(
        t.codes.reshape(rows, stored[-1] // 2)[None],
        t.scales.reshape(rows, stored[-1] // BLOCK_SIZE)[None],
        jnp.asarray(t.amax, jnp.float32).reshape(1),
        dtype=np.dtype(dtype),
    )
    # The stored last axis back to t.axis; lax.transpose, not jnp.moveaxis
    # (a jitted helper, which JAX 0.11 fails to batch when vmap's axis is
    # sharded over Explicit mesh axes).
    order = list(range(len(stored) - 1))
    order.insert(t.axis, len(stored) - 1)
    return jax.lax.transpose(values.reshape(stored), order)
