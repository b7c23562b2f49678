"""Element-level numerics: rounding against ml_dtypes, the generator against
Philox-4x32-10's published known answers, the Random Hadamard Transform, and
the documented edge cases (through the handlers, compared with the
reference)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import assert_same_bytes, on_cpu

import jax_nvfp4 as nv
from jax_nvfp4 import reference as ref


def neighbourhoods(values):
    """Each value, its midpoints with its neighbours, and 1-2 ulps either side."""
    values = np.unique(np.asarray(values, np.float32))
    mids = (values[:-1] + values[1:]) / 2
    pts = np.concatenate([values, mids]).astype(np.float32)
    out = [pts]
    for _k in (1, 2):
        out.append(np.nextafter(pts, np.float32(np.inf)))
        out.append(np.nextafter(pts, np.float32(-np.inf)))
        pts = out[-2]
    allpts = np.concatenate(out)
    return np.concatenate([allpts, -allpts]).astype(np.float32)


def test_e2m1_nearest_agrees_with_ml_dtypes():
    v = neighbourhoods(nv.E2M1_VALUES)
    v = v[np.abs(v) <= 6]
    codes = np.asarray(ref.e2m1_round_nearest(jnp.asarray(v)))
    got = nv.format.e2m1_decode_table()[codes]
    want = v.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_e2m1_saturates_and_special_values():
    v = jnp.asarray([7.0, -100.0, np.inf, -np.inf, np.nan, -np.nan, -0.0, 0.0, -0.1])
    codes = np.asarray(ref.e2m1_round_nearest(v)).tolist()
    assert codes == [7, 15, 7, 15, 7, 7, 8, 0, 8]


def test_e4m3_agrees_with_ml_dtypes():
    all_bytes = np.arange(0x7F, dtype=np.uint8)  # every finite non-negative E4M3
    values = all_bytes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    v = neighbourhoods(values)
    v = v[(v >= 0) & (v <= 448)]
    got = np.asarray(ref.e4m3_round_satfinite(jnp.asarray(v)))
    want = v.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    # Encoding round-trips every value; above 448 saturates (not NaN).
    enc = np.asarray(ref.e4m3_encode(jnp.asarray(values)))
    np.testing.assert_array_equal(enc, all_bytes)
    big = np.asarray(ref.e4m3_round_satfinite(jnp.asarray([449.0, 470.0, 3e38])))
    np.testing.assert_array_equal(big, [448, 448, 448])


def test_every_scale_byte_decodes_as_float8_e4m3fn():
    """Dequantize through the handlers with every scale byte (incl. the NaN
    bytes 0x7F and 0xFF, which no quantize writes) and every code: the values
    of the pure-JAX reference (ml_dtypes' float8_e4m3fn), NaN where it is."""
    codes = np.tile(
        np.array([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], np.uint8), (256, 1)
    )
    scales = np.arange(256, dtype=np.uint8).reshape(256, 1)
    t = nv.NVFP4Tensor(
        codes=jnp.asarray(codes),
        scales=jnp.asarray(scales).view(jnp.float8_e4m3fn),
        amax=jnp.float32(2688.0),  # decode multiplier = the scale itself
        shape=(256, 16),
        axis=1,
    )
    got = np.asarray(jax.jit(functools.partial(nv.dequantize, dtype=jnp.float32))(t))
    want = np.asarray(
        on_cpu(
            functools.partial(
                nv.dequantize, dtype=jnp.float32, implementation="reference"
            ),
            t,
        )
    )
    nan = np.isnan(want)
    assert nan.any()
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])


def test_handler_element_rounding_at_unit_scale():
    """A block holding 6 next to a block holding 2688 has scale exactly 1, so
    the handler's codes are the plain E2M1 rounding of the inputs."""
    v = neighbourhoods(nv.E2M1_VALUES)
    v = v[np.abs(v) <= 6]
    n = -(-v.size // 15) * 15
    vals = np.resize(v, n).reshape(-1, 15)
    blocks = np.concatenate([np.full((vals.shape[0], 1), 6.0, np.float32), vals], 1)
    x = np.concatenate([blocks.reshape(-1), np.full(16, 2688.0, np.float32)])
    t = nv.quantize(jnp.asarray(x))
    decoded = np.asarray(nv.dequantize(t, jnp.float32))[: blocks.size]
    want = blocks.reshape(-1).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(decoded, want)


def _float32_bit_patterns(rng, n):
    """Random float32 bit patterns, rich in subnormals, zeros and extremes."""
    u = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    kind = rng.integers(0, 6, n)
    u = np.where(kind == 0, u & np.uint32(0x807FFFFF), u)  # subnormal
    u = np.where(kind == 1, (u & np.uint32(0x80FFFFFF)) | np.uint32(0x800000), u)
    u = np.where(kind == 2, u & np.uint32(0x80000000), u)  # +-0
    u = np.where(kind == 3, (u & np.uint32(0x807FFFFF)) | np.uint32(0x7F000000), u)
    return u.view(np.float32)


def test_reference_division_is_correctly_rounded():
    """The twin's division is IEEE on the default backend (XLA:GPU's own
    float32 division is not), so its scales match the handlers' everywhere."""
    rng = np.random.default_rng(0)
    a = _float32_bit_patterns(rng, 1 << 18)
    b = _float32_bit_patterns(rng, 1 << 18)
    a[:4], b[:4] = [2688, 1, 1, np.inf], [418, 6.219_047_6, np.inf, np.inf]
    with np.errstate(all="ignore"):
        want = a / b
    got = np.asarray(jax.jit(ref.divide)(a, b))
    same = (got.view(np.uint32) == want.view(np.uint32)) | (
        np.isnan(got) & np.isnan(want)
    )
    assert same.all(), (a[~same][:4], b[~same][:4], got[~same][:4], want[~same][:4])


# Random123's known-answer vectors for Philox-4x32-10: (counter, key, output).
PHILOX_KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF,) * 4,
        (0xFFFFFFFF,) * 2,
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter,key,want", PHILOX_KNOWN_ANSWERS)
def test_philox_matches_known_answers(counter, key, want):
    words = [jnp.uint32(v) for v in (*key, *counter)]
    got = jax.jit(ref.philox4x32)(*words)
    assert [int(w) for w in got] == list(want)


def _philox_numpy(key, counter):
    """Philox-4x32-10 in numpy uint64 arithmetic (an independent form)."""
    k = [np.uint64(v) for v in key]
    c = [np.asarray(v, np.uint64) for v in counter]
    mask = np.uint64(0xFFFFFFFF)
    for round_ in range(10):
        if round_:
            k = [
                (k[0] + np.uint64(0x9E3779B9)) & mask,
                (k[1] + np.uint64(0xBB67AE85)) & mask,
            ]
        p0 = c[0] * np.uint64(0xD2511F53)
        p1 = c[2] * np.uint64(0xCD9E8D57)
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k[0], p1 & mask,
             (p0 >> np.uint64(32)) ^ c[3] ^ k[1], p0 & mask]  # fmt: skip
    return c


def test_random_bytes_follow_the_documented_counters():
    """Element f of stream s takes byte f % 4 of word (f % 16) // 4 of
    Philox(key, (f // 16, 0, s, 0)), f its flat index in the whole tensor."""
    key = jax.random.key_data(jax.random.key(7))[None]
    rows, length, stream = 6, 48, 3
    origin = jnp.array([0, 2, 16], jnp.uint32)
    got = np.asarray(
        ref.random_bytes(key, (1, 3, 32), stream, origin, global_shape=(rows, length))
    )
    row, col = np.meshgrid(np.arange(2, 5), np.arange(16, 48), indexing="ij")
    f = (row * length + col).astype(np.uint64)
    zero = np.zeros_like(f)
    words = _philox_numpy(
        np.asarray(key[0]), (f // np.uint64(16), zero, zero + np.uint64(stream), zero)
    )
    word = np.choose(((f % np.uint64(16)) // np.uint64(4)).astype(int), words)
    want = (word >> (np.uint64(8) * (f % np.uint64(4)))) & np.uint64(0xFF)
    np.testing.assert_array_equal(got[0], want.astype(np.uint8))


def test_rht_matrix_is_orthogonal_and_as_specified():
    r = ref.rht_matrix().astype(np.float64)
    np.testing.assert_allclose(r @ r.T, np.eye(16), atol=1e-12)
    h2 = np.array([[1, 1], [1, -1]])
    h16 = functools.reduce(np.kron, [h2] * 4)
    signs = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1])
    np.testing.assert_array_equal(r, np.diag(signs) @ h16 * 0.25)


def _edge_case(name):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    if name == "zeros":
        x[:] = 0
    elif name == "zero_blocks":
        x[:, :16] = 0
        x[5, 32:48] = -0.0
    elif name == "scale_underflow":
        x[0, 0] = 1e6  # other blocks' scales round to 0 or to E4M3 subnormals
        x[1:4] *= 1e-3
    elif name == "saturating_scale":
        pass  # amax passed smaller than max |x|: block scales clamp to 448
    elif name == "inf":
        x[3, 7] = np.inf
        x[9, 20] = -np.inf
    elif name == "nan":
        x[2, 2] = np.nan
        x[4, 40] = -np.nan
        x[6, 16:32] = np.nan
        x[10, 5] = np.uint32(0x7F800001).view(np.float32)  # signaling NaN
        x[10, 6] = 3.0
    elif name == "negative_zero":
        x[7, :] = -0.0
        x[8, ::2] = -1e-30
    return jnp.asarray(x)


EDGE_CASES = [
    "zeros",
    "zero_blocks",
    "scale_underflow",
    "saturating_scale",
    "inf",
    "nan",
    "negative_zero",
]


@pytest.mark.parametrize("case", EDGE_CASES)
@pytest.mark.parametrize("block", ["1x16", "16x16"])
@pytest.mark.parametrize("rht", [False, True])
def test_edge_cases_match_reference(case, block, rht):
    x = _edge_case(case)
    amax = jnp.float32(0.5) if case == "saturating_scale" else None
    kw = dict(block=block, rht=rht, amax=amax)
    got = nv.quantize(x, **kw)
    want = on_cpu(functools.partial(nv.quantize, implementation="reference", **kw), x)
    assert_same_bytes(got, want)
    got_c = nv.quantize(x, axis=0, **kw)
    want_c = on_cpu(
        functools.partial(nv.quantize, axis=0, implementation="reference", **kw), x
    )
    assert_same_bytes(got_c, want_c)


def test_documented_edge_behaviour():
    # Zero tensor: amax 0 -> S_enc = 1, all codes and scales 0.
    t = nv.quantize(jnp.zeros((2, 32)))
    assert float(t.amax) == 0 and not np.asarray(t.codes).any()
    assert not np.asarray(t.scales.astype(jnp.float32)).any()
    # Non-finite (the rule, numerics/nvfp4.h step 3a): the amax is the max
    # over the finite |x|; the block holding an inf or a NaN gets the NaN
    # scale byte 0x7F and codes 0, the other blocks are untouched.
    for case, bad in (
        ("inf", [(3, 0), (9, 1)]),
        ("nan", [(2, 0), (4, 2), (6, 1), (10, 0)]),
    ):
        x = _edge_case(case)
        t = nv.quantize(x)
        finite = np.asarray(x)[np.isfinite(np.asarray(x))]
        assert float(t.amax) == float(np.abs(finite).max())
        scales = np.asarray(jax.lax.bitcast_convert_type(t.scales, jnp.uint8))
        want = np.zeros(scales.shape, bool)
        want[tuple(np.array(bad).T)] = True
        np.testing.assert_array_equal(scales == 0x7F, want)
        codes = np.asarray(t.codes).reshape(32, 4, 8)
        assert not codes[want].any()
    # -0.0 keeps its sign (code 8) and dequantizes to -0.0.
    t = nv.quantize(_edge_case("negative_zero"))
    assert (np.asarray(t.codes)[7] == 0x88).all()
    y = np.asarray(nv.dequantize(t, jnp.float32))
    assert np.signbit(y[7]).all() and (y[7] == 0).all()
    # Scale underflow: those blocks dequantize to zero.
    t = nv.quantize(_edge_case("scale_underflow"))
    scales = np.asarray(t.scales.astype(jnp.float32))
    assert (scales[1:4] == 0).any()
    y = np.asarray(nv.dequantize(t, jnp.float32))
    assert (y[1:4][np.repeat(scales[1:4] == 0, 16, axis=1)] == 0).all()
    # Saturating scale: an amax below max|x| clamps block scales at 448.
    t = nv.quantize(_edge_case("saturating_scale"), amax=0.5)
    assert float(jnp.max(t.scales.astype(jnp.float32))) == 448.0
