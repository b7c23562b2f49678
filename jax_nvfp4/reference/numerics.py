"""The numerics of ffi/numerics/nvfp4.h in pure JAX: the float32 arithmetic,
E4M3 and E2M1 rounding, the Random Hadamard Transform and the Philox bits."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_nvfp4.format import BLOCK_SIZE, SCALE_RANGE

_F32 = np.float32
FLT_MAX = _F32(np.finfo(np.float32).max)
ONE_SIXTH = _F32(1.0) / _F32(6.0)
INV_SCALE_RANGE = _F32(1.0) / _F32(SCALE_RANGE)
# Step 3a: a block (tile) holding a NaN or +-inf has the float8_e4m3fn NaN
# as its scale and every code 0 (kNonFiniteScaleByte, kNonFiniteCodes).
NON_FINITE_SCALE_BYTE = np.uint8(0x7F)
NON_FINITE_CODE = np.uint8(0)
RHT_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1])


def _u32(v):
    return jnp.asarray(v, jnp.uint32)


def _bits(x):
    return lax.bitcast_convert_type(x, jnp.uint32)


def _float(bits):
    return lax.bitcast_convert_type(bits, jnp.float32)


def abs_max(x: jax.Array) -> jax.Array:
    """max |x| over the finite elements (NaN and +-inf ignored), float32; 0
    when there is none (step 1 of ``ffi/numerics/nvfp4.h``, MaxAbsFinite).

    Float32 subnormals count as zero, as in all of this package's arithmetic
    (flushed; ``ffi/numerics/nvfp4.h``): XLA flushes them on CPU, and the
    explicit test makes the amax the same where XLA keeps them (GPU)."""
    a = jnp.abs(x.astype(jnp.float32))
    ignored = ~jnp.isfinite(a) | (a < _F32(np.finfo(np.float32).tiny))
    return jnp.max(jnp.where(ignored, _F32(0), a), initial=_F32(0))


def divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """a / b in float32, correctly rounded (IEEE, nearest even) on every backend.

    XLA:GPU lowers float32 division to an approximation that is up to 1-2 ulp
    off (div.full.f32), and one ulp in a scale flips the E2M1 rounding of a
    value at a tie. So the twin divides the significands with integer long
    division: 24 quotient bits, then rounding on the remainder (subnormal
    results rounded at their own bit position).
    """
    a, b = jnp.broadcast_arrays(
        jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    )
    ua, ub = _bits(a), _bits(b)
    sign = (ua ^ ub) & _u32(0x80000000)

    def unpack(u):
        """(significand in [2^23, 2^24), unbiased-by-127 exponent) of u != 0."""
        e = ((u >> 23) & _u32(0xFF)).astype(jnp.int32)
        f = u & _u32(0x7FFFFF)
        shift = lax.clz(f).astype(jnp.int32) - 8  # subnormals: normalize
        m = jnp.where(e == 0, f << shift.astype(jnp.uint32), f | _u32(0x800000))
        return m, jnp.where(e == 0, 1 - shift, e)

    ma, xa = unpack(ua)
    mb, xb = unpack(ub)
    below = ma < mb
    r = jnp.where(below, ma << 1, ma)  # r / mb in [1, 2)
    e = xa - xb + 127 - below.astype(jnp.int32)  # biased exponent, if normal
    q = jnp.zeros_like(r)
    for _ in range(24):
        bit = r >= mb
        q = (q << 1) | bit.astype(jnp.uint32)
        r = (jnp.where(bit, r - mb, r)) << 1  # twice the remainder
    exact = r == 0
    # Normal result: round on the remainder (r vs mb is 2*rem vs mb).
    up = (r > mb) | ((r == mb) & ((q & 1) == 1))
    qn = q + up.astype(jnp.uint32)
    carry = qn >> 24
    e_n = e + carry.astype(jnp.int32)
    qn = jnp.where(carry == 1, qn >> 1, qn)
    normal = (e_n.astype(jnp.uint32) << 23) | (qn & _u32(0x7FFFFF))
    normal = jnp.where(e_n >= 255, _u32(0x7F800000), normal)
    # Subnormal result (e <= 0): keep q >> s, s = 1 - e, round on the dropped
    # bits and the remainder.
    s = jnp.clip(1 - e, 1, 26).astype(jnp.uint32)
    kept = q >> s
    dropped = q & ((_u32(1) << s) - 1)
    half = _u32(1) << (s - 1)
    up_s = (dropped > half) | ((dropped == half) & (~exact | ((kept & 1) == 1)))
    subnormal = kept + up_s.astype(jnp.uint32)
    # Zeros, infinities and NaN, told apart on the bits (XLA:CPU compares
    # subnormals as zero).
    abs_a, abs_b = ua & _u32(0x7FFFFFFF), ub & _u32(0x7FFFFFFF)
    inf_bits = _u32(0x7F800000)
    nan = (abs_a > inf_bits) | (abs_b > inf_bits)
    nan = (
        nan
        | ((abs_a == 0) & (abs_b == 0))
        | ((abs_a == inf_bits) & (abs_b == inf_bits))
    )
    out_bits = sign | jnp.where(e >= 1, normal, subnormal)
    out_bits = jnp.where((abs_a == 0) | (abs_b == inf_bits), sign, out_bits)
    out_bits = jnp.where((abs_a == inf_bits) | (abs_b == 0), sign | inf_bits, out_bits)
    return _float(jnp.where(nan, _u32(0x7FC00000), out_bits))


def global_scale(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(S_enc, S_dec) from a float32 amax: S_enc = 2688 / amax, guarded."""
    s_enc = jnp.fmin(divide(_F32(SCALE_RANGE), amax), FLT_MAX)
    s_enc = jnp.where((amax == 0) | (s_enc == 0), _F32(1), s_enc)
    return s_enc, divide(_F32(1), s_enc)


def e4m3_round_satfinite(v: jax.Array) -> jax.Array:
    """Nearest-even E4M3 value of v >= 0, saturating at 448, as float32."""
    v = jnp.fmin(v, _F32(448))
    subnormal = jnp.round(v * _F32(512)) * _F32(1 / 512)  # round half to even
    bits = _bits(v)
    bits = (bits + _u32(0x7FFFF) + ((bits >> 20) & _u32(1))) & _u32(0xFFF00000)
    return jnp.where(v < _F32(2**-6), subnormal, _float(bits))


def e4m3_encode(v: jax.Array) -> jax.Array:
    """float8_e4m3fn bytes (uint8) of non-negative E4M3-representable values."""
    bits = _bits(v)
    normal = (((bits >> 23) & _u32(0xFF)) - _u32(120)) << 3 | ((bits >> 20) & _u32(7))
    subnormal = (v * _F32(512)).astype(jnp.uint32)
    return jnp.where(v < _F32(2**-6), subnormal, normal).astype(jnp.uint8)


def e4m3_decode(byte: jax.Array) -> jax.Array:
    """float32 values of float8_e4m3fn bytes (uint8)."""
    return lax.bitcast_convert_type(byte, jnp.float8_e4m3fn).astype(jnp.float32)


def _sign_bit(v):
    return ((_bits(v) >> 28) & _u32(8)).astype(jnp.uint8)


def e2m1_round_nearest(v: jax.Array) -> jax.Array:
    """4-bit codes (uint8) of v rounded to nearest-even E2M1, saturating at 6."""
    a = jnp.abs(v)
    index = (
        (a > 0.25).astype(jnp.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).astype(jnp.uint8)
    return jnp.where(jnp.isnan(v), jnp.uint8(7), index | _sign_bit(v))


def _e2m1_step(a):
    return jnp.where(a < 2, _F32(0.5), jnp.where(a < 4, _F32(1), _F32(2)))


def e2m1_round_stochastic(v: jax.Array, random_byte: jax.Array) -> jax.Array:
    """4-bit codes of v stochastically rounded with 8 random bits per element."""
    a = jnp.abs(v)
    u = random_byte.astype(jnp.float32) * _F32(1 / 256)
    t = a + u * _e2m1_step(a)
    step_t = _e2m1_step(t)
    inv_step_t = jnp.where(t < 2, _F32(2), jnp.where(t < 4, _F32(1), _F32(0.5)))
    q = jnp.fmin(jnp.floor(t * inv_step_t) * step_t, _F32(6))
    index = jnp.where(
        q < 2, q * 2, jnp.where(q < 4, q + 2, jnp.where(q == 4, _F32(6), _F32(7)))
    ).astype(jnp.uint8)
    return jnp.where(jnp.isnan(v), jnp.uint8(7), index | _sign_bit(v))


@functools.cache
def rht_matrix() -> np.ndarray:
    """R = diag(s) H16 / 4, float32 [16, 16]; y = x16 @ R."""
    i = np.arange(16)
    parity = np.vectorize(lambda v: bin(v).count("1") % 2)(i[:, None] & i[None, :])
    hadamard = np.where(parity == 1, -1.0, 1.0)
    return (RHT_SIGNS[:, None] * hadamard * 0.25).astype(np.float32)


def random_hadamard16(q: jax.Array) -> jax.Array:
    """RHT of each 16-chunk along the last axis, rounded to bfloat16 (float32).

    z_j = q_j * s_j / 4 (exact), then z H16 by the fast Walsh-Hadamard
    butterfly: stages h = 1, 2, 4, 8 replace each pair (z_i, z_{i+h}),
    i & h == 0, by (z_i + z_{i+h}, z_i - z_{i+h}), in float32.
    """
    signs = (RHT_SIGNS * 0.25).astype(np.float32)
    z = q.reshape(*q.shape[:-1], q.shape[-1] // BLOCK_SIZE, BLOCK_SIZE) * signs
    lead = z.shape[:-1]
    for h in (1, 2, 4, 8):
        pairs = z.reshape(*lead, BLOCK_SIZE // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        z = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, BLOCK_SIZE)
    return z.astype(jnp.bfloat16).astype(jnp.float32).reshape(q.shape)


def _mulhilo(a, multiplier: int):
    """(high, low) 32-bit words of the 64-bit product of uint32 ``a`` and a
    constant, in uint32 arithmetic (16-bit limbs; no uint64 without x64)."""
    m_lo, m_hi = _u32(multiplier & 0xFFFF), _u32(multiplier >> 16)
    a_lo, a_hi = a & _u32(0xFFFF), a >> _u32(16)
    p0, p1, p2 = a_lo * m_lo, a_lo * m_hi, a_hi * m_lo
    mid = (p0 >> _u32(16)) + (p1 & _u32(0xFFFF)) + (p2 & _u32(0xFFFF))
    high = a_hi * m_hi + (p1 >> _u32(16)) + (p2 >> _u32(16)) + (mid >> _u32(16))
    return high, a * _u32(multiplier)


def philox4x32(key0, key1, c0, c1, c2, c3):
    """Philox-4x32-10 (Random123's, cuRAND's), uint32 words in and out."""
    for round_ in range(10):
        if round_:
            key0, key1 = key0 + _u32(0x9E3779B9), key1 + _u32(0xBB67AE85)
        hi0, lo0 = _mulhilo(c0, 0xD2511F53)
        hi1, lo1 = _mulhilo(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = hi1 ^ c1 ^ key0, lo1, hi0 ^ c3 ^ key1, lo0
    return c0, c1, c2, c3


def random_bytes(
    key: jax.Array,
    shape: tuple[int, int, int],
    stream: int,
    origin=None,
    global_shape: tuple[int, int] | None = None,
    example_batch: int = 0,
):
    """uint8 random bytes for a quantized layout [batch, rows, len].

    The 16-element block B = f // 16 holding element f = (b * rows + r) * len
    + l gives it byte f % 4 of word (f % 16) // 4 of Philox-4x32-10 keyed by
    key[b // (batch // n_key)] at counter (B, 0, stream, 0) (B < 2^32 here).
    For one shard of a larger tensor, ``origin`` = (b0, r0, l0) places it in
    the whole tensor of ``global_shape`` = (rows, len), and f is the flat
    index there (so every shard draws what one device would).
    ``example_batch`` > 0: the batch folds vmap examples of that many matrices
    each, and b counts within the example (b0 + b modulo example_batch), so
    each example draws what it would outside vmap.
    """
    batch, rows, length = shape
    g_rows, g_len = global_shape or (rows, length)
    o = jnp.zeros(3, jnp.uint32) if origin is None else origin.astype(jnp.uint32)
    n_key = key.shape[0]
    # B = row * (len / 16) + (l0 + l) // 16 (len and l0 are multiples of 16).
    matrix = o[0] + lax.iota(jnp.uint32, batch)[:, None]
    if example_batch:
        matrix = matrix % _u32(example_batch)
    row = matrix * _u32(g_rows) + (o[1] + lax.iota(jnp.uint32, rows)[None, :])
    col = o[2] // _u32(16) + lax.iota(jnp.uint32, length // 16)[None, None, :]
    block = (row[:, :, None] * _u32(g_len // 16) + col).reshape(batch, -1)
    k = jnp.repeat(key, batch // n_key, axis=0)
    zero = jnp.zeros_like(block)
    words = philox4x32(k[:, 0:1], k[:, 1:2], block, zero, zero + _u32(stream), zero)
    shifts = _u32(np.arange(4) * 8)
    return (
        jnp.concatenate([(w[..., None] >> shifts) & _u32(0xFF) for w in words], -1)
        .astype(jnp.uint8)
        .reshape(shape)
    )
