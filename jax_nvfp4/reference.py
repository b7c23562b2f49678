"""Pure-JAX twin of the FFI handlers: the oracle of the tests and the fallback.

Every function here has the signature of the primitive of the same name in
``jax_nvfp4.ops`` and follows ``ffi/numerics/nvfp4.h`` step by step, in
float32, so that the results are bit-identical to the CPU and CUDA handlers.
Inputs use the handlers' rank-3 layout ``[batch, m, k]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_nvfp4.format import BLOCK_SIZE, SCALE_RANGE, e2m1_decode_table, holds_values

__all__ = [
    "abs_max",
    "amax",
    "decode_bf16",
    "dequantize",
    "divide",
    "global_scale",
    "grouped_matmul_rows",
    "grouped_matmul_tokens",
    "matmul",
    "matmul_dequantize_bf16",
    "philox4x32",
    "quantize_cols",
    "quantize_rows",
    "quantize_rows_cols",
    "random_bytes",
    "random_hadamard16",
    "rht_matrix",
    "w4a16_matmul",
]

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


def _gemm_alpha(a_amax, b_amax):
    """alpha [b or 1, 1, 1] = (amax_a / 2688) * (amax_b / 2688), float32."""
    r = _F32(SCALE_RANGE)
    return (divide(a_amax, r) * divide(b_amax, r)).reshape(-1, 1, 1)


def decode_bf16(codes, scales):
    """e2m1(code) * s_b as bfloat16 [b, r, l] (exact: E2M1 values have at
    most 2 significant bits and E4M3 scales 4, so every product fits the 8
    bits of bfloat16's significand and its exponent range): the operands of
    the bf16 GEMM, the twin of the CUDA handler jax_nvfp4_decode_bf16."""
    return _decode_unscaled(codes, scales).astype(jnp.bfloat16)


def operand_bf16(codes, scales):
    """A GEMM operand as bfloat16 e2m1 * s_b [b, r, l]: decoded from its
    codes, or ``codes`` itself where it already holds those values."""
    return codes if holds_values(codes) else decode_bf16(codes, scales)


def matmul(
    a_codes,
    a_scales,
    a_amax,
    b_codes,
    b_scales,
    b_amax,
    *,
    dtype,
):
    """out [b, m, n] = alpha * sum_k a[b, m, k] b[b', n, k] (float32 products).
    An operand's codes may be its bfloat16 values (``operand_bf16``)."""
    a = operand_bf16(a_codes, a_scales).astype(jnp.float32)
    b = operand_bf16(b_codes, b_scales).astype(jnp.float32)
    b = jnp.broadcast_to(b, (a.shape[0], *b.shape[1:]))
    acc = jnp.einsum("bmk,bnk->bmn", a, b, precision=lax.Precision.HIGHEST)
    return (acc * _gemm_alpha(a_amax, b_amax)).astype(dtype)


def matmul_dequantize_bf16(
    a_codes,
    a_scales,
    a_amax,
    b_codes,
    b_scales,
    b_amax,
    *,
    dtype,
):
    """The GPU path without FP4 tensor cores (Hopper): e2m1 * s_b is exact in
    bfloat16, so a bf16 GEMM with float32 accumulation and alpha applied after
    computes the format's exact products."""
    a = operand_bf16(a_codes, a_scales)
    b = operand_bf16(b_codes, b_scales)
    if b.shape[0] == 1 and b_amax.size == 1:
        acc = lax.dot_general(
            a, b[0], (((2,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
    else:
        b = jnp.broadcast_to(b, (a.shape[0], *b.shape[1:]))
        acc = lax.dot_general(
            a, b, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32
        )
    return (acc * _gemm_alpha(a_amax, b_amax)).astype(dtype)


def _group_of(sizes, positions):
    """The group of each position of a buffer whose groups hold ``sizes``
    [G] consecutive positions, in order (G past the groups), int32."""
    ends = jnp.cumsum(sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, positions, side="right").astype(jnp.int32)


def _buffer_start(origin):
    return jnp.int32(0) if origin is None else origin.reshape(-1)[0]


def _in_order_sums(a, b):
    """sum_k a[m, k] * b[n, k] for float32 a [m, L], b [n, L] (exact
    products), added in order k = 0, 1, ... from +0 in one float32
    accumulator: the CPU handler's sums, where an XLA dot may add in another
    order. One fused pass over the accumulator per 16 k."""
    m, length = a.shape
    blocks = (length // BLOCK_SIZE, BLOCK_SIZE)
    a = jnp.moveaxis(a.reshape(m, *blocks), 1, 0)
    b = jnp.moveaxis(b.reshape(b.shape[0], *blocks), 1, 0)

    def add_block(acc, block):
        a16, b16 = block
        for j in range(BLOCK_SIZE):
            acc = acc + a16[:, j, None] * b16[None, :, j]
        return acc, None

    # The first block outside the scan: its accumulator then carries the
    # operands' shard_map variance (a constant zero carry would not).
    acc = add_block(jnp.zeros((m, b.shape[1]), jnp.float32), (a[0], b[0]))[0]
    return lax.scan(add_block, acc, (a[1:], b[1:]))[0]


def grouped_matmul_rows(
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin=None, *, dtype
):
    """The rows form of the grouped GEMM (FPROP, DGRAD): out [R, n], row r of
    a [1, R, L] (codes [1, R, L/2] or values) in group g times b[g] (stored
    [G, n, L]): alpha_g * sum_k in order, alpha_g = (A_a[g] / 2688) *
    (A_b[g] / 2688), one rounding. ``sizes`` [G]: the groups' rows of the
    buffer, in order; ``origin`` [1]: the buffer row of a's first row (a
    shard's). Rows outside every group are zeros."""
    rows = a_codes.shape[1]
    count = sizes.shape[0]
    positions = _buffer_start(origin) + jnp.arange(rows, dtype=jnp.int32)
    row_group = _group_of(sizes, positions)
    a = operand_bf16(a_codes, a_scales)[0].astype(jnp.float32)

    def one_group(g, acc):
        b = operand_bf16(
            lax.dynamic_index_in_dim(b_codes, g), lax.dynamic_index_in_dim(b_scales, g)
        )
        sums = _in_order_sums(a, b[0].astype(jnp.float32))
        return jnp.where((row_group == g)[:, None], sums, acc)

    # Group 0 outside the loop: the carry then has the operands' variance
    # inside shard_map (a constant zero carry would not).
    acc = one_group(0, jnp.zeros((rows, b_codes.shape[1]), jnp.float32))
    acc = lax.fori_loop(1, count, one_group, acc)
    alpha = _gemm_alpha(a_amax, b_amax).reshape(-1)
    row_alpha = alpha.at[row_group].get(mode="fill", fill_value=0)
    return (acc * row_alpha[:, None]).astype(dtype)


def grouped_matmul_tokens(
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin=None, *, dtype
):
    """The tokens form of the grouped GEMM (WGRAD): out [G, m, n] = alpha_g *
    sum over group g's tokens of a^T b, in token order. a [items, m, 16]
    and b [items, n, 16] hold 16 tokens per item along their last axis
    (codes [items, rows, 8], scales [items, rows, 1], or values); ``sizes``
    [G]: the groups' tokens of the buffer (multiples of 16), in order;
    ``origin`` [1]: the buffer item of the first item (a shard's). An empty
    group gives zeros."""
    items = a_codes.shape[0]
    positions = _buffer_start(origin) + jnp.arange(items, dtype=jnp.int32)
    item_group = _group_of(sizes // BLOCK_SIZE, positions)

    def stored(codes, scales):  # [items, F, 16] -> [F, items * 16]: tokens last
        values = operand_bf16(codes, scales).astype(jnp.float32)
        return jnp.swapaxes(values, 0, 1).reshape(values.shape[1], -1)

    a = stored(a_codes, a_scales)
    b = stored(b_codes, b_scales)
    token_group = jnp.repeat(item_group, BLOCK_SIZE)

    def one_group(g):
        # Other groups' tokens become zeros in both operands, so that their
        # NaN blocks add nothing; zeros leave an in-order sum from +0
        # unchanged.
        keep = (token_group == g)[None, :]
        return _in_order_sums(jnp.where(keep, a, 0.0), jnp.where(keep, b, 0.0))

    acc = lax.map(one_group, jnp.arange(sizes.shape[0], dtype=jnp.int32))
    alpha = _gemm_alpha(a_amax, b_amax).reshape(-1)
    return (acc * alpha[:, None, None]).astype(dtype)


def w4a16_matmul(x, codes, scales, amax, *, dtype):
    """The weight-only GEMM of serving (W4A16): x bfloat16 [b, m, k] times a
    weight stored quantized along k (codes uint8 [b', n, k/2], scales
    float8_e4m3fn [b', n, k/16], amax float32 [b'], b' 1 or b) -> [b, m, n]
    of dtype: (amax / 2688) * sum_k x * e2m1(code) * s_b.

    The products are exact (``decode_bf16``) and summed in float32 by XLA's
    dot, in XLA's order, then scaled and rounded once: within the float32
    summation bound of the CUDA handler's sums (and equal to them wherever
    every partial sum is exact), not bit-equal in general."""
    w = decode_bf16(codes, scales)
    alpha = divide(amax.reshape(-1), _F32(SCALE_RANGE))
    batch, m, k = x.shape
    if w.shape[0] == 1:  # one weight: the batch is more rows
        acc = jnp.dot(x.reshape(batch * m, k), w[0].T, preferred_element_type=_F32)
        return (acc * alpha).astype(dtype).reshape(batch, m, -1)
    acc = lax.dot_general(
        x, w, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32
    )
    return (acc * alpha[:, None, None]).astype(dtype)
