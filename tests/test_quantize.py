"""The FFI handlers against the pure-JAX reference: bit-exact, on every
device the test session has (CPU; and the GPU when present)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_same_bytes, on_cpu, outlier_data, rows_cols

import jax_nvfp4 as nv
from jax_nvfp4.decoded_operand import DecodedOperand

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def reference_quantize(x, *args, **kwargs):
    return on_cpu(
        functools.partial(nv.quantize, implementation="reference", **kwargs), x, *args
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", ["1x16", "16x16"])
@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("axis", [-1, 0])
def test_nearest_matches_reference(dtype, block, rht, axis):
    x = outlier_data(1, (48, 96), dtype)
    got = jax.jit(functools.partial(nv.quantize, axis=axis, block=block, rht=rht))(x)
    want = reference_quantize(x, axis=axis, block=block, rht=rht)
    assert_same_bytes(got, want)


@pytest.mark.parametrize("block", ["1x16", "16x16"])
@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("axis", [-1, -2])
def test_stochastic_matches_reference(block, rht, axis):
    x = outlier_data(2, (64, 80), jnp.bfloat16)
    key = jax.random.key(7)
    kwargs = dict(axis=axis, block=block, rht=rht, rounding="stochastic", stream=3)
    got = jax.jit(lambda x, k: nv.quantize(x, key=k, **kwargs))(x, key)
    want = reference_quantize(x, key=key, **kwargs)
    assert_same_bytes(got, want)


@pytest.mark.parametrize(
    "shape,axis", [((32,), 0), ((3, 5, 32), -1), ((4, 32, 3), 1), ((32, 2, 3), 0)]
)
def test_any_rank_and_axis(shape, axis):
    x = outlier_data(3, shape, jnp.float32)
    got = nv.quantize(x, axis=axis)
    want = reference_quantize(x, axis=axis)
    assert_same_bytes(got, want)
    assert got.codes.shape == (*np.delete(shape, axis % len(shape)), shape[axis] // 2)
    # Dequantize returns the logical layout.
    y = nv.dequantize(got, jnp.float32)
    assert y.shape == shape
    np.testing.assert_array_equal(
        y,
        on_cpu(
            functools.partial(nv.dequantize, implementation="reference"),
            want,
            jnp.float32,
        ),
    )


def test_2d_tiles_same_values_either_axis():
    """16x16 scaling gives the transposed copy exactly the same values."""
    w = outlier_data(4, (64, 48), jnp.bfloat16)
    along_rows = nv.dequantize(nv.quantize(w, axis=0, block="16x16"), jnp.float32)
    along_cols = nv.dequantize(nv.quantize(w, axis=1, block="16x16"), jnp.float32)
    np.testing.assert_array_equal(along_rows, along_cols)
    # ... while 1x16 blocks along different axes give different values.
    a = nv.dequantize(nv.quantize(w, axis=0), jnp.float32)
    b = nv.dequantize(nv.quantize(w, axis=1), jnp.float32)
    assert not np.array_equal(a, b)


def stochastic_key(key, **options):
    """key where the options round stochastically, else None (a key with
    round-to-nearest only draws the library's warning)."""
    roundings = (options.get(k) for k in ("rounding", "row_rounding", "col_rounding"))
    return key if "stochastic" in roundings else None


def fused_matches_reference(x, key, **kwargs):
    """The fused quantize under jit (the handlers) against the pure-JAX
    reference on the CPU: the same bytes both ways. Returns the fused pair."""
    key = stochastic_key(key, **kwargs)
    rows, cols = jax.jit(
        lambda x, k: nv.quantize_rowwise_and_columnwise(x, key=k, **kwargs)
    )(x, key)
    ref_rows, ref_cols = on_cpu(
        functools.partial(
            nv.quantize_rowwise_and_columnwise,
            key=key,
            implementation="reference",
            **kwargs,
        ),
        x,
    )
    assert_same_bytes(rows, ref_rows)
    assert_same_bytes(cols, ref_cols)
    return rows, cols


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
    "row_rht,col_rht", [(False, True), (False, False), (True, True)]
)
@pytest.mark.parametrize("col_rounding", ["nearest", "stochastic"])
def test_fused_rowwise_columnwise(dtype, row_rht, col_rht, col_rounding):
    x = outlier_data(5, (2, 64, 48), dtype)
    key = jax.random.key(11)
    kwargs = dict(
        row_rht=row_rht,
        col_rht=col_rht,
        col_rounding=col_rounding,
        row_block="16x16",
        col_block="1x16",
    )
    rows, cols = fused_matches_reference(x, key, **kwargs)
    # Same bytes as the two separate quantizations.
    assert_same_bytes(rows, nv.quantize(x, -1, block="16x16", rht=row_rht))
    assert_same_bytes(
        cols,
        nv.quantize(
            x,
            -2,
            rht=col_rht,
            rounding=col_rounding,
            key=stochastic_key(key, rounding=col_rounding),
            stream=1,
        ),
    )
    assert cols.codes.shape == (2, 48, 32)


def _edge_blocks(x):
    """x with a NaN, +-inf, a -0.0 row block, a -0.0 column block, an
    all-zero 16x16 tile, a block whose scale underflows and a tile of
    bfloat16 subnormals (signs mixed), at places that cut both ways."""
    x = x.at[..., 3, 5].set(jnp.nan)
    x = x.at[..., 40, 17].set(jnp.inf).at[..., 41, 130].set(-jnp.inf)
    x = x.at[..., 20, 32:48].set(-0.0)
    x = x.at[..., 112:128, 33].set(-0.0)
    x = x.at[..., 48:64, 64:80].set(0.0)
    # Subnormal bit patterns 0x0001 .. 0x007F, half of them negative.
    bits = jnp.arange(256, dtype=jnp.uint16).reshape(16, 16)
    bits = (bits % 127 + 1) | ((bits % 2) << 15)
    tiny = jax.lax.bitcast_convert_type(bits, x.dtype)
    x = x.at[..., 128:144, 144:160].set(jnp.broadcast_to(tiny, x[..., :16, :16].shape))
    return x.at[..., 80:96, 96:112].set(1e-30)


@pytest.mark.parametrize(
    "options",
    [
        # X's: rows (FPROP's operand) decoded, columns (WGRAD's residual) not.
        dict(col_rht=True, row_decoded=True),
        # dY's: both decoded, stochastic rounding, RHT on the columns.
        dict(
            row_rounding="stochastic",
            col_rounding="stochastic",
            col_rht=True,
            row_decoded=True,
            col_decoded=True,
        ),
        # 16x16 blocks, the column-wise copy decoded.
        dict(row_block="16x16", col_block="16x16", col_decoded=True),
    ],
)
def test_fused_decoded_outputs_are_the_decoded_codes(options):
    """The fused quantize writing a side's bf16 GEMM operand (on a GPU the
    CUDA kernel's decoded stores) gives exactly decode_bf16 of the codes it
    would have written, the same scales, and the undecoded side unchanged;
    also vmapped (two batch items with their own scales)."""
    from jax_nvfp4.backends.bf16_gemm import decode_bf16

    x = _edge_blocks(outlier_data(19, (2, 144, 160), jnp.bfloat16))
    # The edge data is all there: -inf, the subnormal tile, the 1e-30 block.
    assert bool(jnp.any(jnp.isneginf(x)))
    bits = np.asarray(x).view(np.uint16)  # (XLA:CPU compares flush subnormals)
    assert np.any(((bits & 0x7F80) == 0) & ((bits & 0x7FFF) != 0))
    assert bool(jnp.any(x == jnp.bfloat16(1e-30)))
    key = jax.random.key(4)
    decoded = {k: v for k, v in options.items() if k.endswith("_decoded")}
    plain = {k: v for k, v in options.items() if not k.endswith("_decoded")}

    def both(x, key, **extra):
        return rows_cols(x, key=stochastic_key(key, **plain), **plain, **extra)

    want = jax.jit(both)(x, key)
    got = jax.jit(functools.partial(both, **decoded))(x, key)
    got_vmapped = jax.jit(
        jax.vmap(functools.partial(both, **decoded), in_axes=(0, None))
    )(x, key)
    want_vmapped = jax.jit(jax.vmap(both, in_axes=(0, None)))(x, key)
    for g, w, gv, wv, flag in zip(
        got,
        want,
        got_vmapped,
        want_vmapped,
        (decoded.get("row_decoded", False), decoded.get("col_decoded", False)),
        strict=True,
    ):
        assert isinstance(g, DecodedOperand) == isinstance(gv, DecodedOperand) == flag
        for t, ref in ((g, w), (gv, wv)):
            np.testing.assert_array_equal(t.amax, ref.amax)
            np.testing.assert_array_equal(
                np.asarray(t.scales).view(np.uint8),
                np.asarray(ref.scales).view(np.uint8),
            )
            if not flag:
                assert_same_bytes(t, ref)
                continue
            lead = ref.codes.shape[:-1]
            values = decode_bf16(
                ref.codes.reshape(1, -1, ref.codes.shape[-1]),
                ref.scales.reshape(1, -1, ref.scales.shape[-1]),
            ).reshape(*lead, -1)
            assert t.values.dtype == jnp.bfloat16 and t.values.shape == values.shape
            assert (t.shape, t.axis, t.block, t.rht) == (
                ref.shape,
                ref.axis,
                ref.block,
                ref.rht,
            )
            np.testing.assert_array_equal(
                np.asarray(t.values).view(np.uint16), np.asarray(values).view(np.uint16)
            )
    # The decoded operand is the GEMM's alone: the public functions refuse it.
    decoded_side = got[0] if isinstance(got[0], DecodedOperand) else got[1]
    with pytest.raises(TypeError, match="dequantize takes an NVFP4Tensor"):
        nv.dequantize(decoded_side)
    with pytest.raises(TypeError, match="matmul takes NVFP4Tensors"):
        nv.matmul(decoded_side, decoded_side)


@pytest.mark.parametrize(
    "options",
    [
        dict(dtype=jnp.float32),
        dict(row_rht=True),
        dict(row_block="16x16", col_block="16x16", col_rht=True),
        dict(row_block="16x16"),
    ],
)
def test_decoded_request_the_kernel_cannot_serve_gives_codes(options):
    """Options the fused kernel does not write decoded operands for (float32
    x, RHT on the rows, 16x16 with column RHT, mixed block shapes): both
    sides come as codes, the same bytes as without the request."""
    options = dict(options)
    x = outlier_data(23, (64, 96), options.pop("dtype", jnp.bfloat16))
    plain = nv.quantize_rowwise_and_columnwise(x, **options)
    asked = rows_cols(x, row_decoded=True, col_decoded=True, **options)
    for t, ref in zip(asked, plain, strict=True):
        assert isinstance(t, nv.NVFP4Tensor)
        assert_same_bytes(t, ref)


@pytest.mark.gpu
def test_decoded_handler_refuses_what_the_kernel_cannot_serve():
    """Called directly with a float32 x, the CUDA handler for decoded outputs
    refuses with what to do (the Python wrapper never asks it to)."""
    from jax_nvfp4 import ops
    from jax_nvfp4.backends import library

    if "jax_nvfp4_quantize_rows_cols" not in library.targets_on("cuda"):
        pytest.skip("the CUDA handlers are not built")
    x = jnp.ones((1, 32, 32), jnp.float32)
    one = jnp.ones(1, jnp.float32)
    with pytest.raises(Exception, match="decoded outputs need a bfloat16 x"):
        jax.block_until_ready(
            ops.quantize_rows_cols(
                x,
                one,
                one,
                jnp.zeros((1, 2), jnp.uint32),
                rows=ops.QuantizeSpec(decoded=True),
                cols=ops.QuantizeSpec(stream=1),
            )
        )


def _flush_subnormals(x):
    """x with every float32-subnormal element replaced by a zero of its sign
    (bitwise, whatever the device's float mode)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    exponent, magnitude, sign = (
        jnp.uint32(m) for m in (0x7F800000, 0x7FFFFFFF, 0x80000000)
    )
    subnormal = ((bits & exponent) == 0) & ((bits & magnitude) != 0)
    flushed = jax.lax.bitcast_convert_type(bits & sign, jnp.float32)
    return jnp.where(subnormal, flushed, x.astype(jnp.float32)).astype(x.dtype)


@pytest.mark.parametrize("scale", ["normal", "tiny"])
@pytest.mark.parametrize("block", ["1x16", "16x16"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_subnormal_inputs_quantize_as_signed_zeros(scale, block, rounding):
    """The documented behaviour (ffi/numerics/nvfp4.h): float32 subnormals -- here
    bfloat16 subnormals of both signs, in blocks of their own and next to
    normal values -- are flushed to zero with their sign, on every backend:
    the fused quantize (rows; columns with RHT) of x equals that of x with
    them zeroed, and the pure-JAX reference on the CPU. "tiny": the whole
    tensor scaled by 2^-130 (amax ~2^-119), so that S_enc = 2688 / amax
    saturates at FLT_MAX and S_dec = 1 / FLT_MAX is itself subnormal: flushed,
    it makes every block's multiplier FLT_MAX and every normal element +-6 or +-4."""
    x = outlier_data(17, (64, 96), jnp.bfloat16)
    if scale == "tiny":
        x = (x.astype(jnp.float32) * 2.0**-130).astype(jnp.bfloat16)
    bits = jnp.arange(32 * 32, dtype=jnp.uint16).reshape(32, 32)
    bits = (bits % 127 + 1) | ((bits % 3 == 0).astype(jnp.uint16) << 15)
    tiny = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
    x = x.at[16:48, 32:64].set(tiny)  # whole 16x16 tiles of subnormals
    x = x.at[0:16:3, 0:96:5].set(tiny[0:6, 0:20])  # mixed into normal blocks
    flushed = _flush_subnormals(x)
    assert not np.array_equal(  # the test data does hold subnormals
        np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16)),
        np.asarray(jax.lax.bitcast_convert_type(flushed, jnp.uint16)),
    )
    kwargs = dict(
        row_rounding=rounding,
        col_rounding=rounding,
        col_rht=True,
        row_block=block,
        col_block=block,
    )
    key = jax.random.key(2)
    rows, cols = fused_matches_reference(x, key, **kwargs)
    zero_rows, zero_cols = fused_matches_reference(flushed, key, **kwargs)
    assert_same_bytes(rows, zero_rows)
    assert_same_bytes(cols, zero_cols)
    if scale == "tiny":  # 2688 / amax saturates: S_enc = FLT_MAX
        assert float(rows.amax) < 2688.0 / float(np.finfo(np.float32).max)


@pytest.mark.parametrize("row_rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("col_rht", [False, True])
@pytest.mark.parametrize("col_rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("amax", [None, 0.5, "distinct"])
@pytest.mark.parametrize("block", ["1x16", "16x16"])
def test_fused_recipe_options_match_reference(
    row_rounding, col_rht, col_rounding, amax, block
):
    """The recipe's fused quantize of bfloat16 (on a GPU the CUDA
    QuantizePrivateTileKernel; 16x16 blocks with column RHT take the general
    QuantizeTileKernel) for each rounding/RHT option and both block shapes
    (1x16: X and dY; 16x16: the 2D weights), on a shape that is a multiple of
    16 but not of the kernel's 128 x 64 CTA tile, with NaN, inf and all-zero
    blocks. amax: None computes it (over the finite values; the NaN and inf
    blocks get the NaN scale byte),
    0.5 (below the data's) saturates the block scales, "distinct" gives rows
    and columns different finite global scales that leave most blocks
    unsaturated."""
    x = _edge_blocks(outlier_data(13, (2, 272, 176), jnp.bfloat16))
    key = jax.random.key(5)
    kwargs = dict(
        row_rounding=row_rounding,
        col_rht=col_rht,
        col_rounding=col_rounding,
        row_stream=2,
        col_stream=3,
        row_block=block,
        col_block=block,
    )
    if amax == "distinct":
        finite = float(jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0)))
        kwargs.update(
            row_amax=jnp.float32(1.5 * finite), col_amax=jnp.float32(3.0 * finite)
        )
    elif amax is not None:
        kwargs.update(row_amax=jnp.float32(amax), col_amax=jnp.float32(amax))
    fused_matches_reference(x, key, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("col_rounding", ["nearest", "stochastic"])
def test_fused_kernel_batch_items_with_their_own_scales(col_rounding):
    """The vmapped fused quantize (one QuantizePrivateTileKernel launch over 4
    batch items whose global scales differ by 16x, 2048 tiles: more than a
    GPU holds CTAs at once) equals the items quantized one by one."""
    xs = jax.random.normal(jax.random.key(3), (4, 1024, 4096), jnp.bfloat16)
    xs = xs * (16.0 ** jnp.arange(4, dtype=jnp.bfloat16))[:, None, None]
    key = jax.random.key(4)

    def fused(x):
        return nv.quantize_rowwise_and_columnwise(
            x,
            key=stochastic_key(key, col_rounding=col_rounding),
            col_rht=True,
            col_rounding=col_rounding,
        )

    rows, cols = jax.jit(jax.vmap(fused))(xs)
    one = jax.jit(fused)
    for i in range(xs.shape[0]):
        one_rows, one_cols = one(xs[i])
        for got, want in ((rows, one_rows), (cols, one_cols)):
            np.testing.assert_array_equal(got.codes[i], want.codes)
            np.testing.assert_array_equal(
                np.asarray(got.scales[i]).view(np.uint8),
                np.asarray(want.scales).view(np.uint8),
            )
            np.testing.assert_array_equal(got.amax[i], want.amax)


def test_dequantize_matches_reference_and_dtypes():
    x = outlier_data(6, (32, 64), jnp.float32)
    t = nv.quantize(x)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        got = jax.jit(nv.dequantize, static_argnums=1)(t, dtype)
        want = on_cpu(
            functools.partial(nv.dequantize, implementation="reference"), t, dtype
        )
        assert got.dtype == dtype
        np.testing.assert_array_equal(
            np.asarray(got, np.float32), np.asarray(want, np.float32)
        )


def test_quantization_error_is_small():
    x = jax.random.normal(jax.random.key(0), (256, 256), jnp.float32)
    y = nv.dequantize(nv.quantize(x), jnp.float32)
    rel = float(jnp.linalg.norm(y - x) / jnp.linalg.norm(x))
    assert 0.02 < rel < 0.15, rel  # E2M1 with E4M3 block scales: ~9%


def test_rht_values_are_the_transform():
    x = outlier_data(8, (16, 64), jnp.float32)
    t = nv.quantize(x, rht=True)
    y = x.reshape(16, 4, 16) @ nv.reference.rht_matrix()
    y = np.asarray(y.reshape(16, 64).astype(jnp.bfloat16), np.float32)
    np.testing.assert_allclose(float(t.amax), np.abs(y).max(), rtol=1e-2)
    rel = np.linalg.norm(nv.dequantize(t, jnp.float32) - y) / np.linalg.norm(y)
    assert rel < 0.15


def test_vmap_matches_loop_and_folds_batch():
    xs = outlier_data(9, (3, 32, 48), jnp.bfloat16)
    batched = jax.vmap(lambda x: nv.quantize(x, axis=0, block="16x16"))(xs)
    for i in range(3):
        one = nv.quantize(xs[i], axis=0, block="16x16")
        np.testing.assert_array_equal(batched.codes[i], one.codes)
        np.testing.assert_array_equal(batched.amax[i], one.amax)
    jaxpr = str(jax.make_jaxpr(jax.vmap(lambda x: nv.quantize(x)))(xs))
    assert jaxpr.count("nvfp4_quantize_rows") == 1  # one call, not a loop
    deq = jax.vmap(lambda t: nv.dequantize(t, jnp.float32))(batched)
    for i in range(3):
        np.testing.assert_array_equal(
            deq[i],
            nv.dequantize(nv.quantize(xs[i], axis=0, block="16x16"), jnp.float32),
        )


def test_vmap_of_fused_and_amax():
    xs = outlier_data(10, (2, 32, 32), jnp.bfloat16)
    f = lambda x: nv.quantize_rowwise_and_columnwise(x, col_rht=True)  # noqa: E731
    rows, cols = jax.vmap(f)(xs)
    for i in range(2):
        r, c = f(xs[i])
        np.testing.assert_array_equal(rows.codes[i], r.codes)
        np.testing.assert_array_equal(cols.codes[i], c.codes)
        np.testing.assert_array_equal(cols.amax[i], c.amax)


def test_explicit_amax_is_used():
    x = outlier_data(12, (16, 32), jnp.float32)
    t = nv.quantize(x, amax=jnp.float32(1000.0))
    assert float(t.amax) == 1000.0
    assert_same_bytes(t, reference_quantize(x, amax=jnp.float32(1000.0)))


def test_handlers_are_used():
    """The default path is the custom call, not the reference fallback, and
    on a GPU machine the CUDA handlers are loaded (a package imported from a
    source tree without the built extension silently runs the twin)."""
    from conftest import has_gpu

    from jax_nvfp4.backends import library

    assert "cpu" in nv.available_platforms(), library.handler_source()
    if has_gpu():
        assert "cuda" in nv.available_platforms(), (
            f"a GPU is present but the CUDA handlers are not loaded from "
            f"{library.handler_source()}: build with JAX_NVFP4_CUDA=ON and "
            "run pytest outside the source tree (python -P -m pytest, or the "
            "pytest command)"
        )
    x = jnp.ones((16, 32), jnp.float32)
    hlo = jax.jit(nv.quantize).lower(x).compile().as_text()
    assert "jax_nvfp4_quantize_rows" in hlo
