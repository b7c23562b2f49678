"""The quantize, amax, dequantize and bf16 decode twins."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_nvfp4.format import e2m1_decode_table
from jax_nvfp4.reference.numerics import (
    _F32,
    FLT_MAX,
    INV_SCALE_RANGE,
    NON_FINITE_CODE,
    NON_FINITE_SCALE_BYTE,
    ONE_SIXTH,
    abs_max,
    divide,
    e2m1_round_nearest,
    e2m1_round_stochastic,
    e4m3_decode,
    e4m3_encode,
    e4m3_round_satfinite,
    global_scale,
    random_bytes,
    random_hadamard16,
)


def _quantize_oriented(q, amax, key, spec, *, origin, global_shape, example_batch):
    """Quantizes q [batch, rows, len] (float32) along len as ``spec`` says;
    ``origin`` and ``global_shape`` place it in the whole tensor (see
    ``random_bytes``)."""
    batch, rows, length = q.shape
    block_rows = spec.block_rows
    if spec.rht:
        q = random_hadamard16(q)
    a = jnp.repeat(amax.reshape(-1), batch // amax.size)
    s_enc, s_dec = global_scale(a)
    tiles = q.reshape(batch, rows // block_rows, block_rows, length // 16, 16)
    # Step 3: the block (tile) amax, a NaN or +-inf counting as +inf; 3a: such
    # a block gets the NaN scale byte and codes 0 (below).
    block_amax = jnp.max(
        jnp.where(jnp.isfinite(tiles), jnp.abs(tiles), _F32(np.inf)), axis=(2, 4)
    )
    non_finite = block_amax == _F32(np.inf)
    bcast = (slice(None), None, None)
    scale = e4m3_round_satfinite(
        jnp.fmin(block_amax * (s_enc * ONE_SIXTH)[bcast], FLT_MAX)
    )
    multiplier = jnp.fmin(divide(_F32(1), scale * s_dec[bcast]), FLT_MAX)
    v = tiles * multiplier[:, :, None, :, None]
    if spec.stochastic:
        rnd = random_bytes(
            key, q.shape, spec.stream, origin, global_shape, example_batch
        )
        codes = e2m1_round_stochastic(v, rnd.reshape(v.shape))
    else:
        codes = e2m1_round_nearest(v)
    codes = jnp.where(non_finite[:, :, None, :, None], NON_FINITE_CODE, codes)
    codes = codes.reshape(batch, rows, length)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scale_bytes = jnp.where(non_finite, NON_FINITE_SCALE_BYTE, e4m3_encode(scale))
    scale_bytes = jnp.repeat(scale_bytes, block_rows, axis=1)
    scales = lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn)
    if spec.decoded:
        return decode_bf16(packed, scales), scales
    return packed, scales


def _quantize_placed(x, amax, key, origin, transposed, spec, place):
    """x [b, m, k] quantized along k (or, ``transposed``, along m), placed at
    ``origin`` (int32 [3]: b0, m0, k0) in a tensor of ``place``'s global m and
    k for the stochastic-rounding index (defaults: x is the whole tensor)."""
    _, m, k = x.shape
    o = jnp.zeros(3, jnp.int32) if origin is None else origin
    q = x.astype(jnp.float32)
    global_shape = (m, k)
    if place is not None:  # a global size of 0 is this call's own (see Place)
        global_shape = (place.global_m or m, place.global_k or k)
    if transposed:
        q, o, global_shape = (
            jnp.swapaxes(q, 1, 2),
            o[jnp.array([0, 2, 1])],
            global_shape[::-1],
        )
    return _quantize_oriented(
        q,
        amax,
        key,
        spec,
        origin=o,
        global_shape=global_shape,
        example_batch=0 if place is None else place.example_batch,
    )


def quantize_rows(x, amax, key, origin=None, *, rows, place=None):
    """x [b, m, k] -> (codes [b, m, k/2], scales [b, m, k/16]) along k.

    ``rows``: a ``jax_nvfp4.ops.QuantizeSpec``. ``origin`` and ``place``
    (``jax_nvfp4.ops.Place``) put x in a larger tensor (see ``random_bytes``).
    """
    return _quantize_placed(x, amax, key, origin, False, rows, place)


def quantize_cols(x, amax, key, origin=None, *, cols, place=None):
    """x [b, m, k] -> (codes [b, k, m/2], scales [b, k, m/16]) along m."""
    return _quantize_placed(x, amax, key, origin, True, cols, place)


def quantize_rows_cols(
    x, row_amax, col_amax, key, origin=None, *, rows, cols, place=None
):
    """Both quantizations of x [b, m, k]: along k (row-wise) and along m; a
    side with ``decoded`` comes as its bfloat16 values [b, rows, len]."""
    return (
        *_quantize_placed(x, row_amax, key, origin, False, rows, place),
        *_quantize_placed(x, col_amax, key, origin, True, cols, place),
    )


def amax(x, *, cols):
    """[b, 2]: (max |x[b]|, max |bf16(RHT(x[b]))|) over the finite values
    (``abs_max``), the RHT along m if ``cols`` else along k."""
    q = x.astype(jnp.float32)
    if cols:
        q = jnp.swapaxes(q, 1, 2)
    batch = q.shape[0]
    plain = jax.vmap(abs_max)(q.reshape(batch, -1))
    transformed = jax.vmap(abs_max)(random_hadamard16(q).reshape(batch, -1))
    return jnp.stack([plain, transformed], axis=1)


def _e2m1_values(codes):
    """Packed codes [..., l/2] -> float32 E2M1 values [..., l] (low nibble first)."""
    nibbles = jnp.stack([codes & 0xF, codes >> 4], axis=-1)
    values = jnp.asarray(e2m1_decode_table())[nibbles]
    return values.reshape(*codes.shape[:-1], 2 * codes.shape[-1])


def dequantize(codes, scales, amax, *, dtype):
    """codes [b, r, l/2], scales [b, r, l/16] -> values [b, r, l] of dtype."""
    batch, rows, half = codes.shape
    a = jnp.repeat(amax.reshape(-1), batch // amax.size)
    scale = lax.bitcast_convert_type(scales, jnp.uint8)
    multiplier = (e4m3_decode(scale) * a[:, None, None]) * INV_SCALE_RANGE
    values = _e2m1_values(codes)
    blocks = values.reshape(batch, rows, half * 2 // 16, 16)
    out = (blocks * multiplier[..., None]).reshape(batch, rows, half * 2)
    return out.astype(dtype)


def _decode_unscaled(codes, scales):
    """e2m1(code) * s_b as float32 [b, r, l] (exact; the amax not applied)."""
    batch, rows, half = codes.shape
    values = _e2m1_values(codes)
    scale = e4m3_decode(lax.bitcast_convert_type(scales, jnp.uint8))
    blocks = values.reshape(batch, rows, half * 2 // 16, 16) * scale[..., None]
    return blocks.reshape(batch, rows, half * 2)


def decode_bf16(codes, scales):
    """e2m1(code) * s_b as bfloat16 [b, r, l] (exact: E2M1 values have at
    most 2 significant bits and E4M3 scales 4, so every product fits the 8
    bits of bfloat16's significand and its exponent range): the operands of
    the bf16 GEMM, the twin of the CUDA handler jax_nvfp4_decode_bf16."""
    return _decode_unscaled(codes, scales).astype(jnp.bfloat16)
