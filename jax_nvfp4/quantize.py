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
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import ops, reference
from jax_nvfp4.decoded_operand import DecodedOperand
from jax_nvfp4.format import (
    BLOCK_SIZE,
    Block,
    NVFP4Tensor,
    Rounding,
    is_supported_input_dtype,
)
from jax_nvfp4.given_amax import GivenAmax, given_amax
from jax_nvfp4.keys import (
    key_words,
    shard_words,
    warn_unused_key,
)

__all__ = [
    "dequantize",
    "global_amax",
    "quantize",
    "quantize_rowwise_and_columnwise",
]

Implementation = Literal["ffi", "reference"]


def implementation_ops(implementation: Implementation):
    """The module whose functions run the ops: the primitives or their twins."""
    if isinstance(implementation, str) and implementation == "ffi":
        return ops
    if isinstance(implementation, str) and implementation == "reference":
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
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(
            f"axis must be an int (the quantized axis), got "
            f"{type(axis).__name__} {axis!r}"
        )
    axis = int(axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for an array of rank {ndim}")
    return axis % ndim


def _check_multiple_of_16(shape, axis: int, what: str):
    if shape[axis] % BLOCK_SIZE:
        raise ValueError(
            f"axis {axis} has length {shape[axis]}; {what} needs a multiple of "
            f"{BLOCK_SIZE} — pad it or quantize another axis"
        )


def _block_rows(block: Block, name: str = "block") -> int:
    if isinstance(block, str) and block in _BLOCK_ROWS:
        return _BLOCK_ROWS[block]
    raise ValueError(f"{name} must be '1x16' or '16x16', got {block!r}")


_BLOCK_ROWS = {"1x16": 1, "16x16": 16}


def _is_stochastic(rounding: Rounding, name: str = "rounding") -> bool:
    if not (isinstance(rounding, str) and rounding in ("nearest", "stochastic")):
        raise ValueError(f"{name} must be 'nearest' or 'stochastic', got {rounding!r}")
    return rounding == "stochastic"


def global_amax(
    x: jax.Array,
    axis: int = -1,
    *,
    rht: bool = False,
    implementation: Implementation = "ffi",
) -> jax.Array:
    """The float32 amax that ``quantize(x, axis, rht=rht)`` uses.

    max |x| over the finite elements of the whole tensor (NaN and +-inf
    ignored; 0 if there is none); with ``rht``, the max of the finite
    bfloat16 Random-Hadamard-transformed values along ``axis``. Always a
    valid ``amax`` for ``quantize``, also after a ``jax.lax.pmax`` of it.
    """
    x = _check_input(x)
    axis = _normalize_axis(axis, x.ndim)
    impl = implementation_ops(implementation)
    if not _check_flag(rht, "rht"):
        return impl.abs_max(x)
    _check_multiple_of_16(x.shape, axis, "the Random Hadamard Transform")
    x3, cols = _rank3(x, axis)
    return jnp.max(impl.amax(x3, cols=cols)[:, 1])


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
      amax: the global amax to use (a float scalar), e.g. one reduced across
        shards: the max |x| over x's finite elements, so finite and >= 0 (0
        only for an x without a nonzero finite element); computed from x
        when omitted. It sets the scale: elements larger than a given amax
        saturate (decode to at most amax); that is not checked. A concrete
        amax that is not finite and >= 0 raises a ValueError. A
        traced one (under ``jit``) is checked against the result: where it
        is NaN, +-inf or negative, or 0 while x holds a nonzero finite
        element, every block scale is the E4M3 NaN and the tensor's amax NaN
        (its codes mean nothing), so ``dequantize`` gives NaN everywhere and
        so does every ``matmul`` output with it. The check reads the scales
        twice more (x.size / 16 bytes each).
      stream: stochastic-rounding stream id in [0, 255], to draw independent
        bits from one key for several quantizations.
      implementation: ``"ffi"`` (the custom calls) or ``"reference"`` (pure JAX).

    Returns:
      An ``NVFP4Tensor`` with codes ``[..., L/2]`` and scales ``[..., L/16]``,
      ``...`` being x's shape without ``axis``.
    """
    x = _check_input(x)
    stochastic = _is_stochastic(rounding)
    warn_unused_key(key, stochastic)
    return _quantize(
        x,
        axis,
        block=block,
        rounding=rounding,
        rht=rht,
        words=key_words(key, stochastic, x.size),
        amax=amax,
        stream=stream,
        implementation=implementation,
    )


def _quantize(
    x: jax.Array,
    axis: int,
    *,
    block: Block,
    rounding: Rounding,
    rht: bool,
    words: jax.Array | None,
    amax: jax.Array | None,
    stream: int,
    implementation: Implementation,
) -> NVFP4Tensor:
    """``quantize`` after its key became stochastic-rounding words."""
    x = _check_input(x)
    axis = _normalize_axis(axis, x.ndim)
    _check_flag(rht, "rht")
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
        rht=bool(rht),
        stream=_check_stream(stream),
    )
    impl = implementation_ops(implementation)
    words = shard_words(words, spec.stochastic, x.size)
    x3, cols = _rank3(x, axis)
    if amax is None:
        if rht:
            amax = jnp.max(impl.amax(x3, cols=cols)[:, 1])
        else:
            amax = impl.abs_max(x)
        given = GivenAmax(amax, checked=False)
    else:
        given = given_amax(amax, x)
    handler_amax = given.for_handler().reshape(1)
    if cols:
        codes, scales = impl.quantize_cols(x3, handler_amax, words, cols=spec)
    else:
        codes, scales = impl.quantize_rows(x3, handler_amax, words, rows=spec)
    codes, scales, amax = given.mark(codes, scales)
    return wrap_quantized(codes, scales, amax, x.shape, axis, block, rht)


def _check_stream(stream: int, name: str = "stream") -> int:
    if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)):
        raise TypeError(
            f"{name} must be an int in [0, 255], got {type(stream).__name__} {stream!r}"
        )
    if not 0 <= stream <= 255:
        raise ValueError(f"{name} must be in [0, 255], got {stream}")
    return int(stream)


def _check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def wrap_quantized(
    codes, scales, amax, shape, axis, block, rht, decoded=False
) -> NVFP4Tensor | DecodedOperand:
    """codes: packed uint8 codes, or (``decoded``) bfloat16 values."""
    rest = tuple(d for i, d in enumerate(shape) if i != axis)
    length = shape[axis]
    scales = scales.reshape(*rest, length // BLOCK_SIZE)
    if decoded:
        values = codes.reshape(*rest, length)
        return DecodedOperand(values, scales, amax, tuple(shape), axis, block, rht)
    codes = codes.reshape(*rest, length // 2)
    return NVFP4Tensor(codes, scales, amax, tuple(shape), axis, block, rht)


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
) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """Quantizes x [..., M, K] along K (row-wise) and along M (column-wise).

    One pass over x in the fused handler. The results equal
    ``quantize(x, -1, ...)`` and ``quantize(x, -2, ...)`` with the same options
    (and ``stream``); the column-wise copy is stored transposed,
    codes ``[..., K, M/2]``. Leading axes are independent matrices that share
    one global amax. For the training recipe, X and dY are [tokens, features]:
    the column-wise copy (typically with ``col_rht=True``) feeds WGRAD.

    ``row_amax`` / ``col_amax`` are each checked as ``quantize``'s ``amax``
    (an invalid traced one marks its own side only).
    """
    x = _check_input(x)
    stochastic = _is_stochastic(row_rounding, "row_rounding") or _is_stochastic(
        col_rounding, "col_rounding"
    )
    warn_unused_key(key, stochastic)
    return quantize_shard_rows_cols(
        x,
        row_block=row_block,
        row_rounding=row_rounding,
        row_rht=row_rht,
        col_block=col_block,
        col_rounding=col_rounding,
        col_rht=col_rht,
        words=key_words(key, stochastic, x.size),
        row_amax=row_amax,
        col_amax=col_amax,
        row_stream=row_stream,
        col_stream=col_stream,
        implementation=implementation,
    )


def quantize_shard_rows_cols(
    x: jax.Array,
    *,
    row_block: Block = "1x16",
    row_rounding: Rounding = "nearest",
    row_rht: bool = False,
    col_block: Block = "1x16",
    col_rounding: Rounding = "nearest",
    col_rht: bool = False,
    words: jax.Array | None = None,
    row_amax: jax.Array | None = None,
    col_amax: jax.Array | None = None,
    row_stream: int = 0,
    col_stream: int = 1,
    implementation: Implementation = "ffi",
    row_decoded: bool = False,
    col_decoded: bool = False,
    amax_trusted: bool = False,
) -> tuple[NVFP4Tensor | DecodedOperand, NVFP4Tensor | DecodedOperand]:
    """``quantize_rowwise_and_columnwise`` after its key became
    stochastic-rounding ``words``, with what tests and benchmarks of the
    fused kernel ask of it besides: ``amax_trusted`` (a given amax that is a
    reduction over finite values, so not checked) and ``row_decoded`` /
    ``col_decoded``: that side as a ``DecodedOperand``, the bfloat16 values
    the fused kernel writes in place of codes for the options it serves
    (``ops.fused_writes_values``), as the recipe's token step asks for them
    (``recipe.steps.quantize_tokens``)."""
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
        block_rows=_block_rows(row_block, "row_block"),
        stochastic=_is_stochastic(row_rounding, "row_rounding"),
        rht=_check_flag(row_rht, "row_rht"),
        stream=_check_stream(row_stream, "row_stream"),
    )
    col_spec = ops.QuantizeSpec(
        block_rows=_block_rows(col_block, "col_block"),
        stochastic=_is_stochastic(col_rounding, "col_rounding"),
        rht=_check_flag(col_rht, "col_rht"),
        stream=_check_stream(col_stream, "col_stream"),
    )
    impl = implementation_ops(implementation)
    words = shard_words(words, row_spec.stochastic or col_spec.stochastic, x.size)
    x3 = x.reshape(math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])

    plain = None
    if col_amax is None:
        if col_rht:
            both = impl.amax(x3, cols=True)
            plain, col_amax = jnp.max(both[:, 0]), jnp.max(both[:, 1])
        else:
            plain = col_amax = impl.abs_max(x)
        col_given = GivenAmax(col_amax, checked=False)
    else:
        col_given = given_amax(col_amax, x, "col_amax", amax_trusted)
    if row_amax is None:
        if row_rht:
            row_amax = jnp.max(impl.amax(x3, cols=False)[:, 1])
        else:
            row_amax = plain if plain is not None else impl.abs_max(x)
        row_given = GivenAmax(row_amax, checked=False)
    else:
        row_given = given_amax(row_amax, x, "row_amax", amax_trusted)

    if (row_decoded or col_decoded) and ops.fused_writes_values(
        x.dtype, row_spec, col_spec
    ):
        row_spec = dataclasses.replace(row_spec, decoded=row_decoded)
        col_spec = dataclasses.replace(col_spec, decoded=col_decoded)
    row_codes, row_scales, col_codes, col_scales = impl.quantize_rows_cols(
        x3,
        row_given.for_handler().reshape(1),
        col_given.for_handler().reshape(1),
        words,
        rows=row_spec,
        cols=col_spec,
    )
    sides = []
    for given, codes, scales, axis, block, rht, spec in (
        (row_given, row_codes, row_scales, n - 1, row_block, row_rht, row_spec),
        (col_given, col_codes, col_scales, n - 2, col_block, col_rht, col_spec),
    ):
        codes, scales, amax = given.mark(codes, scales, decoded=spec.decoded)
        sides.append(
            wrap_quantized(codes, scales, amax, x.shape, axis, block, rht, spec.decoded)
        )
    return sides[0], sides[1]


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
    if t.batch_ndim:  # returned by vmap: [batch..., *t.shape]
        return jax.vmap(
            functools.partial(dequantize, dtype=dtype, implementation=implementation)
        )(t)
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"dequantize produces float32, bfloat16 or float16, not {dtype!r}"
        ) from None
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
