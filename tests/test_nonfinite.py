"""The non-finite rule (docs/DESIGN.md 2.3, ffi/numerics/nvfp4.h step 3a) on
every backend: the global amax is the max over the finite |x|; a block (or
16x16 tile) holding a NaN or +-inf, after the RHT where it applies, gets the
E4M3 NaN scale byte 0x7F and codes 0, so it dequantizes to NaN and every GEMM
output summing over it is NaN -- where jnp.dot has non-finite values (for
16x16 weight tiles: the whole tile's columns). The handler on the default
device is compared with the pure-JAX twin on the CPU, bit for bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_same_bytes, on_cpu, outlier_data, rows_cols

import jax_nvfp4 as nv
from jax_nvfp4 import ops
from jax_nvfp4 import reference as ref
from jax_nvfp4.decoded_operand import DecodedOperand

NAN_SCALE = 0x7F


def _scale_bytes(t):
    return np.asarray(jax.lax.bitcast_convert_type(t.scales, jnp.uint8))


def bad_blocks(x, axis=-1, block="1x16"):
    """bool [..., L/16] in the stored layout (quantized axis last): whether
    the block (or its 16x16 tile, stored repeated per row) holds a NaN or
    +-inf. The RHT maps a chunk with one to all non-finite values, so this is
    the mask with the RHT too (for data without float32 overflow)."""
    a = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    *lead, length = a.shape
    bad = (~np.isfinite(a)).reshape(*lead, length // 16, 16).any(-1)
    if block == "16x16":
        rows = lead[-1]
        tiles = bad.reshape(*lead[:-1], rows // 16, 16, length // 16).any(-2)
        bad = np.repeat(tiles, 16, axis=-2)
    return bad


def element_mask(bad, axis, ndim):
    """A stored-layout block mask expanded to the logical elements."""
    return np.moveaxis(np.repeat(bad, 16, axis=-1), -1, axis % ndim)


def finite_amax(x):
    a = np.abs(np.asarray(x, np.float32))
    a = a[np.isfinite(a)]
    return np.float32(a.max()) if a.size else np.float32(0)


def with_bad_elements(x):
    """x [..., 48, 64] with NaN, -NaN, +inf, -inf, an inf and a -inf in one
    16-chunk both ways (their RHT gives NaN and inf), and a row block of NaN."""
    x = x.at[..., 3, 5].set(jnp.nan)
    x = x.at[..., 40, 63].set(-jnp.nan)
    x = x.at[..., 20, 40].set(jnp.inf).at[..., 29, 57].set(-jnp.inf)
    x = x.at[..., 10, 16].set(jnp.inf).at[..., 11, 17].set(-jnp.inf)
    x = x.at[..., 10, 17].set(-jnp.inf)
    return x.at[..., 34, 32:48].set(jnp.nan)


def assert_same_values(got, want):
    """Equal values, NaN where the other has NaN (NaN payloads are not part
    of the format: a GPU writes other NaN bits than the CPU)."""
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def check_nonfinite_tensor(t, x, axis, block):
    """t = quantize(x, axis, block=...): NaN scale bytes and zero codes exactly
    on the bad blocks, a finite amax, NaN exactly there when dequantized."""
    bad = bad_blocks(x, axis, block)
    assert bad.any()
    scales = _scale_bytes(t)
    np.testing.assert_array_equal(scales == NAN_SCALE, bad)
    codes = np.asarray(t.codes).reshape(*bad.shape, 8)
    assert not codes[bad].any()
    assert np.isfinite(np.asarray(t.amax)).all()
    y = np.asarray(nv.dequantize(t, jnp.float32))
    np.testing.assert_array_equal(np.isnan(y), element_mask(bad, axis, x.ndim))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("block", ["1x16", "16x16"])
@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_quantize_marks_exactly_the_nonfinite_blocks(dtype, block, rht, rounding, axis):
    x = with_bad_elements(outlier_data(31, (48, 64), dtype))
    kw = dict(axis=axis, block=block, rht=rht, rounding=rounding, stream=2)
    key = jax.random.key(3) if rounding == "stochastic" else None
    got = jax.jit(lambda x, k: nv.quantize(x, key=k, **kw))(x, key)
    want = on_cpu(
        lambda x, k: nv.quantize(x, key=k, implementation="reference", **kw), x, key
    )
    assert_same_bytes(got, want)
    check_nonfinite_tensor(got, x, axis, block)
    if not rht:
        assert np.asarray(got.amax) == finite_amax(x)
    # The other blocks: the bytes of x with its non-finite elements zeroed.
    zeroed = jax.jit(lambda x, k: nv.quantize(x, key=k, **kw))(
        jnp.where(jnp.isfinite(x), x, 0), key
    )
    bad = bad_blocks(x, axis, block)
    np.testing.assert_array_equal(got.amax, zeroed.amax)
    np.testing.assert_array_equal(_scale_bytes(got)[~bad], _scale_bytes(zeroed)[~bad])
    np.testing.assert_array_equal(
        np.asarray(got.codes).reshape(*bad.shape, 8)[~bad],
        np.asarray(zeroed.codes).reshape(*bad.shape, 8)[~bad],
    )
    assert_same_values(
        nv.dequantize(got, jnp.float32),
        on_cpu(
            functools.partial(nv.dequantize, implementation="reference"),
            want,
            jnp.float32,
        ),
    )


def test_amax_is_over_the_finite_values():
    """global_amax, the amax primitive's both outputs (plain, RHT) and
    quantize's own amax ignore NaN and +-inf: one bad element does not
    rescale the tensor."""
    x = outlier_data(32, (48, 64), jnp.bfloat16)
    bad = with_bad_elements(x)
    assert (
        float(nv.global_amax(bad))
        == finite_amax(bad)
        == finite_amax(jnp.where(jnp.isfinite(bad), bad, 0))
    )
    for axis in (-1, 0):
        got = nv.global_amax(bad, axis, rht=True)
        want = on_cpu(
            functools.partial(nv.global_amax, rht=True, implementation="reference"),
            bad,
            axis,
        )
        assert np.asarray(got).view(np.uint32) == np.asarray(want).view(np.uint32)
        assert np.isfinite(float(got)) and float(got) > 0
        assert float(nv.quantize(bad, axis).amax) == finite_amax(bad)
    for cols in (False, True):
        x3 = bad.reshape(1, 48, 64)
        got = np.asarray(jax.jit(functools.partial(ops.amax, cols=cols))(x3))
        want = np.asarray(on_cpu(functools.partial(ref.amax, cols=cols), x3))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        assert got[0, 0] == finite_amax(bad)
        # The RHT amax: the max over the finite transformed values.
        q = np.asarray(jnp.swapaxes(x3, 1, 2) if cols else x3, np.float32)
        y = np.asarray(on_cpu(ref.random_hadamard16, jnp.asarray(q)))
        assert got[0, 1] == finite_amax(y)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rht_overflow_counts_as_nonfinite(dtype):
    """A finite chunk whose transform overflows (|x| near the bfloat16 max:
    a butterfly sum or its bfloat16 rounding is inf) is non-finite after the
    RHT: the NaN scale on that block, its finite transformed values still
    counted by the RHT amax (the CUDA amax kernels' exact slow path)."""
    x = outlier_data(33, (64, 64), dtype)
    big = float(jnp.finfo(jnp.bfloat16).max)
    signs = ref.RHT_SIGNS.astype(np.float32)  # x16 = c * s: y_0 = 4c
    alternating = signs * np.array([1, -1] * 8, np.float32)  # y_1 = 4c
    # A column chunk (the cols' transform), a row chunk (the rows'), and a
    # column chunk that overflows already in the butterfly's third stage.
    x = x.at[16:32, 8].set(jnp.asarray(big * signs, dtype))
    x = x.at[40, 16:32].set(jnp.asarray(big / 2 * signs, dtype))
    x = x.at[48:64, 3].set(jnp.asarray(big * alternating, dtype))
    for cols in (False, True):
        x3 = x.reshape(1, 64, 64)
        got = np.asarray(jax.jit(functools.partial(ops.amax, cols=cols))(x3))
        want = np.asarray(on_cpu(functools.partial(ref.amax, cols=cols), x3))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        assert np.isfinite(got).all()
    for axis in (-1, 0):
        got = nv.quantize(x, axis, rht=True)
        want = on_cpu(
            functools.partial(nv.quantize, rht=True, implementation="reference"),
            x,
            axis,
        )
        assert_same_bytes(got, want)
        assert (_scale_bytes(got) == NAN_SCALE).any()
    rows, cols = rows_cols(x, col_rht=True, row_decoded=True)
    want_cols = on_cpu(
        functools.partial(nv.quantize, rht=True, implementation="reference"), x, 0
    )
    assert_same_bytes(cols, want_cols)


FUSED_OPTIONS = [
    # The recipe's X: rows (FPROP) decoded, the RHT columns (WGRAD) as codes.
    dict(col_rht=True, row_decoded=True),
    # dY: stochastic both ways, RHT on the columns, both decoded.
    dict(
        row_rounding="stochastic",
        col_rounding="stochastic",
        col_rht=True,
        row_decoded=True,
        col_decoded=True,
    ),
    # W: 16x16 tiles both ways, the column copy decoded.
    dict(row_block="16x16", col_block="16x16", col_decoded=True),
    # 16x16 with column RHT (the general tile kernel), codes.
    dict(row_block="16x16", col_block="16x16", col_rht=True),
    # Mixed blocks, RHT on the rows.
    dict(row_rht=True, col_block="16x16", col_rounding="stochastic"),
]


def _compare_fused(got, want):
    """A fused quantize (rows, cols) equals the reference's: the same bytes,
    decoded values equal (NaN where the reference has NaN)."""
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w)
        if isinstance(g, DecodedOperand):
            assert_same_values(g.values, w.values)
            np.testing.assert_array_equal(_scale_bytes(g), _scale_bytes(w))
            np.testing.assert_array_equal(
                np.asarray(g.amax).view(np.uint32), np.asarray(w.amax).view(np.uint32)
            )
        else:
            assert_same_bytes(g, w)


def _check_fused(got, want, x, options):
    """One fused quantize (rows, cols) against the reference's, and the NaN
    scale bytes / NaN decoded values on exactly the bad blocks."""
    _compare_fused(got, want)
    for side, g, axis in (("row", got[0], -1), ("col", got[1], -2)):
        bad = bad_blocks(x, axis, options.get(f"{side}_block", "1x16"))
        assert bad.any()
        np.testing.assert_array_equal(_scale_bytes(g) == NAN_SCALE, bad)
        assert np.isfinite(np.asarray(g.amax)).all()
        if isinstance(g, DecodedOperand):  # e2m1 * s_b: NaN on the bad blocks
            np.testing.assert_array_equal(
                np.isnan(np.asarray(g.values, np.float32)), np.repeat(bad, 16, axis=-1)
            )
        else:
            codes = np.asarray(g.codes).reshape(*bad.shape, 8)
            assert not codes[bad].any()


@pytest.mark.parametrize("options", FUSED_OPTIONS)
def test_fused_rows_cols_mark_exactly_the_nonfinite_blocks(options):
    x = with_bad_elements(outlier_data(34, (48, 64), jnp.bfloat16))
    stochastic = "stochastic" in options.values()
    key = jax.random.key(5) if stochastic else None
    fused = functools.partial(rows_cols, **options)
    got = jax.jit(lambda x, k: fused(x, key=k))(x, key)
    want = on_cpu(lambda x, k: fused(x, key=k, implementation="reference"), x, key)
    _check_fused(got, want, x, options)


@pytest.mark.parametrize("options", FUSED_OPTIONS[:3])
def test_vmapped_quantize_marks_each_items_blocks(options):
    """Under vmap each item has its own finite amax and NaN scales exactly on
    its own bad blocks; items without a bad element are untouched."""
    xs = outlier_data(35, (3, 48, 64), jnp.bfloat16)
    xs = xs.at[1].set(with_bad_elements(xs[1]))
    key = jax.random.key(6) if "stochastic" in options.values() else None
    fused = functools.partial(rows_cols, key=key, **options)
    got = jax.jit(jax.vmap(fused))(xs)
    for i in range(3):
        want = on_cpu(functools.partial(fused, implementation="reference"), xs[i])
        item = jax.tree_util.tree_map(lambda a, i=i: a[i], got)
        if i == 1:
            _check_fused(item, want, xs[i], options)
        else:
            _compare_fused(item, want)
            for g in item:
                assert not (_scale_bytes(g) == NAN_SCALE).any()
    plain = jax.jit(jax.vmap(lambda x: nv.quantize(x, rht=True)))(xs)
    for i in range(3):
        one = nv.quantize(xs[i], rht=True)
        item = jax.tree_util.tree_map(lambda a, i=i: a[i], plain)
        assert_same_bytes(item, one)


@pytest.mark.parametrize("fill", ["nan", "inf", "mixed"])
@pytest.mark.parametrize("rht", [False, True])
def test_all_nonfinite_tensor(fill, rht):
    """No finite element: A = 0 (S_enc = 1), every scale byte 0x7F, every
    code 0, all NaN when dequantized; the fused quantize too."""
    shape = (32, 48)
    if fill == "nan":
        x = jnp.full(shape, jnp.nan, jnp.bfloat16)
    elif fill == "inf":
        x = jnp.full(shape, -jnp.inf, jnp.bfloat16)
    else:
        x = jnp.where(jnp.arange(32 * 48).reshape(shape) % 3 == 0, jnp.nan, jnp.inf)
        x = x.astype(jnp.bfloat16)
    assert float(nv.global_amax(x)) == 0.0
    assert float(nv.global_amax(x, rht=True)) == 0.0
    for axis in (-1, 0):
        for block in ("1x16", "16x16"):
            t = nv.quantize(x, axis, block=block, rht=rht)
            want = on_cpu(
                functools.partial(
                    nv.quantize, block=block, rht=rht, implementation="reference"
                ),
                x,
                axis,
            )
            assert_same_bytes(t, want)
            assert float(t.amax) == 0.0
            assert (_scale_bytes(t) == NAN_SCALE).all()
            assert not np.asarray(t.codes).any()
            assert np.isnan(np.asarray(nv.dequantize(t, jnp.float32))).all()
    rows, cols = rows_cols(x, col_rht=rht, row_decoded=True, col_decoded=True)
    for t in (rows, cols):
        assert float(t.amax) == 0.0 and (_scale_bytes(t) == NAN_SCALE).all()
        if isinstance(t, DecodedOperand):
            assert np.isnan(np.asarray(t.values, np.float32)).all()


def test_finite_tensors_have_no_nan_scale():
    """The rule leaves finite data alone (the byte-exact tests against
    Transformer Engine's reference check the bytes themselves)."""
    x = outlier_data(36, (64, 96), jnp.bfloat16)
    for kw in (dict(), dict(block="16x16"), dict(rht=True), dict(axis=0, rht=True)):
        assert not (_scale_bytes(nv.quantize(x, **kw)) == NAN_SCALE).any()


def _dot_mask(a, b):
    """Where jnp.dot(a, b) (float32) is not finite."""
    with np.errstate(all="ignore"):
        out = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    return ~np.isfinite(out)


@pytest.mark.parametrize("b_block", ["1x16", "16x16"])
def test_matmul_is_nan_where_the_dot_is_not_finite(b_block):
    """matmul(quantize(x), quantize(w, 0)): rows of x and columns of w that
    hold a NaN or inf give NaN outputs; 1x16 blocks: exactly jnp.dot's
    non-finite outputs, 16x16 tiles: the tile's 16 columns."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((48, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 64)), jnp.bfloat16)
    x = x.at[5, 7].set(jnp.nan).at[30, 50].set(jnp.inf)
    w = w.at[20, 3].set(-jnp.inf).at[63, 45].set(jnp.nan)
    a = nv.quantize(x, -1)
    b = nv.quantize(w, 0, block=b_block)
    got = np.asarray(jax.jit(functools.partial(nv.matmul, out_dtype=jnp.float32))(a, b))
    want = np.asarray(
        on_cpu(
            functools.partial(
                nv.matmul, out_dtype=jnp.float32, implementation="reference"
            ),
            a,
            b,
        )
    )
    mask = _dot_mask(x, w)
    if b_block == "16x16":
        mask = np.zeros_like(mask)
        mask[[5, 30], :] = True
        mask[:, 0:16] = True  # w's tile (16:32, 0:16) holds the -inf
        mask[:, 32:48] = True  # tile (48:64, 32:48) holds the NaN
    np.testing.assert_array_equal(np.isnan(got), mask)
    np.testing.assert_array_equal(np.isnan(want), mask)
    np.testing.assert_allclose(got[~mask], want[~mask], rtol=1e-5, atol=1e-5)


RECIPES = {
    "nvfp4": nv.NVFP4,
    "no_rht": nv.NVFP4_NO_RHT,
    "no_sr": nv.NVFP4_NO_SR,
    "1x16_weights": nv.Recipe(weight_2d=False),
}


def _dot_vjp(x, w, ct, recipe):
    key = jax.random.key(9) if recipe.stochastic_rounding else None

    def run(x, w, ct):
        y, pullback = jax.vjp(lambda x, w: nv.dot(x, w, key=key, recipe=recipe), x, w)
        return y, *pullback(ct)

    return [np.asarray(a, np.float32) for a in jax.jit(run)(x, w, ct)]


def _jnp_vjp(x, w, ct):
    """jnp.dot's y, dx, dw in float32 (numpy, NaN-safe)."""
    x, w, ct = (np.asarray(a, np.float64) for a in (x, w, ct))
    with np.errstate(all="ignore"):
        return x @ w, ct @ w.T, x.T @ ct


def _operands(tokens=40, k=64, n=48):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    ct = rng.standard_normal((tokens, n)).astype(np.float32)
    return x, w, ct


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_dot_nonfinite_x_rows(recipe):
    """A NaN / inf in token r of x: y's row r (FPROP, 1x16 along K) and dW's
    row k (WGRAD: x's column k along the tokens, its 16-token block poisoned)
    are non-finite, exactly where jnp.dot's are; dx stays finite."""
    x, w, ct = _operands()
    x[5, 20] = np.nan
    x[33, 3] = np.inf  # in the zero-padded last token block (40 -> 48)
    x[34, 3] = -np.inf
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    y, dx, dw = _dot_vjp(bf(x), bf(w), bf(ct), RECIPES[recipe])
    jy, jdx, jdw = _jnp_vjp(bf(x), bf(w), bf(ct))
    for got, want in ((y, jy), (dx, jdx), (dw, jdw)):
        np.testing.assert_array_equal(~np.isfinite(got), ~np.isfinite(want))
        np.testing.assert_array_equal(~np.isfinite(got), np.isnan(got))
    assert (~np.isfinite(y)).any(1).tolist() == [r in (5, 33, 34) for r in range(40)]
    assert (~np.isfinite(dw)).any(1).tolist() == [k in (3, 20) for k in range(64)]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_dot_nonfinite_dy_rows(recipe):
    """A NaN / inf in dY[t, n]: dx's row t (DGRAD, dY 1x16 along N) and dW's
    column n (WGRAD: dY's column n along the tokens) are non-finite, exactly
    where jnp.dot's gradients are."""
    x, w, ct = _operands()
    ct[7, 9] = np.nan
    ct[38, 30] = -np.inf
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    y, dx, dw = _dot_vjp(bf(x), bf(w), bf(ct), RECIPES[recipe])
    jy, jdx, jdw = _jnp_vjp(bf(x), bf(w), bf(ct))
    assert np.isfinite(y).all()
    for got, want in ((dx, jdx), (dw, jdw)):
        np.testing.assert_array_equal(~np.isfinite(got), ~np.isfinite(want))
    assert (~np.isfinite(dx)).any(1).tolist() == [t in (7, 38) for t in range(40)]
    assert (~np.isfinite(dw)).any(0).tolist() == [n in (9, 30) for n in range(48)]


@pytest.mark.parametrize("weight_2d", [True, False])
def test_dot_nonfinite_weight(weight_2d):
    """A NaN in w[k, n]: with 1x16 weight blocks, y's column n and dx's column
    k exactly as jnp.dot; with 16x16 tiles (the default) the whole tile is
    poisoned, so y's columns of n's 16-column group and dx's columns of k's
    16-row group are NaN (a superset of jnp.dot's); dW stays finite."""
    x, w, ct = _operands()
    w[12, 17] = np.nan
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    y, dx, dw = _dot_vjp(bf(x), bf(w), bf(ct), nv.Recipe(weight_2d=weight_2d))
    jy, jdx, jdw = _jnp_vjp(bf(x), bf(w), bf(ct))
    assert np.isfinite(dw).all() and np.isfinite(jdw).all()
    if weight_2d:
        want_y = np.zeros(y.shape, bool)
        want_y[:, 16:32] = True
        want_dx = np.zeros(dx.shape, bool)
        want_dx[:, 0:16] = True
        assert (want_y >= ~np.isfinite(jy)).all()
        assert (want_dx >= ~np.isfinite(jdx)).all()
    else:
        want_y, want_dx = ~np.isfinite(jy), ~np.isfinite(jdx)
    np.testing.assert_array_equal(np.isnan(y), want_y)
    np.testing.assert_array_equal(np.isnan(dx), want_dx)
    np.testing.assert_array_equal(np.isfinite(y), ~want_y)


def test_dot_reference_recipe_agrees_on_nonfinite():
    """The handlers' recipe and the pure-JAX recipe give the same NaN masks
    (and values elsewhere within accumulation order)."""
    x, w, ct = _operands()
    x[5, 20] = np.nan
    ct[38, 30] = np.inf
    w[50, 40] = -np.inf
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    got = _dot_vjp(bf(x), bf(w), bf(ct), nv.NVFP4)
    want = on_cpu(_dot_vjp, bf(x), bf(w), bf(ct), nv.Recipe(implementation="reference"))
    for g, r in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(r))
        assert np.isnan(g).any() and not np.isinf(g).any()
        finite = ~np.isnan(g)
        np.testing.assert_allclose(g[finite], r[finite], rtol=2e-2, atol=2e-2)


def _debug_nans_case():
    x, w, _ = _operands()
    key = jax.random.key(0)
    forward = jax.jit(lambda x, w: nv.dot(x, w, key=key))
    loss_grad = jax.jit(
        jax.grad(lambda x, w: jnp.sum(nv.dot(x, w, key=key).astype(jnp.float32)), 1)
    )
    return (
        jnp.asarray(x, jnp.bfloat16),
        jnp.asarray(w, jnp.bfloat16),
        forward,
        loss_grad,
    )


def test_debug_nans_catches_a_nan_entering_dot():
    """jax_debug_nans sees a NaN that enters an NVFP4 layer (its output is
    NaN), forward and backward; finite data raises nothing."""
    x, w, forward, loss_grad = _debug_nans_case()
    x_bad = x.at[3, 4].set(jnp.nan)  # made outside debug_nans
    with jax.debug_nans(True):
        jax.block_until_ready(forward(x, w))
        jax.block_until_ready(loss_grad(x, w))
        with pytest.raises(FloatingPointError):
            jax.block_until_ready(forward(x_bad, w))
        with pytest.raises(FloatingPointError):
            jax.block_until_ready(loss_grad(x_bad, w))


@pytest.mark.xfail(
    raises=RecursionError,
    strict=False,
    reason="ops/primitive.py's def_impl re-jits the primitive, which "
    "jax_debug_nans's de-optimized re-run calls again without end; "
    "dispatch.apply_primitive as the impl raises FloatingPointError",
)
def test_debug_nans_catches_an_inf_made_nan_by_quantize():
    """An inf entering the layer (not a NaN, so no jnp op flags it) becomes
    the NaN scale of its block: debug_nans flags the quantize primitive."""
    x, w, forward, _ = _debug_nans_case()
    w_bad = w.at[3, 4].set(jnp.inf)
    with jax.debug_nans(True), pytest.raises(FloatingPointError):
        jax.block_until_ready(forward(x, w_bad))
