"""The grouped weight-only GEMM of serving (W4A16 ``ragged_dot``):
``ragged_dot(x_bf16, w_nvfp4_experts, group_sizes)`` and its primitive
``ops.ragged_w4a16_matmul``.

Operands built so that every float32 sum is exact (integer activations,
scales 1 or 2, alpha a small integer per expert) make results that may differ
only in summation order bit-identical: the Hopper engine's grouped form and
XLA's twin must then agree exactly. Which CUDA GEMM the primitive lowers to
is checked on any machine by lowering for "cuda" with the handlers' registry
and the devices faked."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import has_gpu
from gemm_cases import fake_device

import jax_nvfp4 as nv
from jax_nvfp4 import config, ops, reference
from jax_nvfp4.backends import devices, library, w4a16_gemm
from jax_nvfp4.format import NVFP4Tensor

E4M3_ONE, E4M3_TWO = 0x38, 0x40


def _experts(groups, n, k, seed=0):
    """NVFP4 expert weights [G, K, N], one tensor per expert stacked: random
    codes, scales 1 or 2, alpha 1, 2, 3, ... (amax 2688 * (g + 1))."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (groups, n, k // 2), dtype=np.uint8)
    scale_bytes = rng.choice([E4M3_ONE, E4M3_TWO], (groups, n, k // 16))
    scales = jax.lax.bitcast_convert_type(
        jnp.asarray(scale_bytes.astype(np.uint8)), jnp.float8_e4m3fn
    )
    amax = 2688.0 * np.arange(1, groups + 1, dtype=np.float32)
    return NVFP4Tensor(
        jnp.asarray(codes), scales, jnp.asarray(amax), shape=(k, n), axis=0
    )


def _integers(shape, seed=1):
    values = np.random.default_rng(seed).integers(-4, 5, shape)
    return jnp.asarray(values, jnp.bfloat16)


def _oracle(x, w: NVFP4Tensor, sizes, dtype):
    """float64 sums (exact here) times each row's alpha in float32, rounded
    once; rows past the sizes' sum zeros."""
    values = np.asarray(reference.decode_bf16(w.codes, w.scales), np.float64)
    x64 = np.asarray(x, np.float64)
    out = np.zeros((x.shape[0], values.shape[1]), np.float32)
    begin = 0
    for g, size in enumerate(np.asarray(sizes)):
        sums = x64[begin : begin + size] @ values[g].T
        alpha = np.float32(np.asarray(w.amax)[g]) / np.float32(2688.0)
        out[begin : begin + size] = sums.astype(np.float32) * alpha
        begin += size
    return np.asarray(jnp.asarray(out).astype(dtype), np.float32)


SIZES = {
    "even": [16, 16, 16, 16],
    "ragged": [5, 0, 17, 1],  # an empty group, tails, padding rows after
    "one": [40, 0, 0, 0],
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("sizes", list(SIZES), ids=list(SIZES))
def test_matches_exact_sums(sizes, dtype):
    sizes = jnp.asarray(SIZES[sizes], jnp.int32)
    w = _experts(4, 48, 256)
    x = _integers((64, 256))
    got = nv.ragged_dot(x, w, sizes, preferred_element_type=dtype)
    assert got.shape == (64, 48) and got.dtype == dtype
    np.testing.assert_array_equal(
        np.asarray(got, np.float32), _oracle(x, w, sizes, dtype)
    )


def _assert_same_product(a: NVFP4Tensor, b: NVFP4Tensor, sizes):
    """Two forms of the same experts (K = 256) give the same ragged_dot."""
    x = jax.random.normal(jax.random.key(7), (sum(sizes) + 3, 256), jnp.bfloat16)
    sizes = jnp.asarray(sizes, jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(nv.ragged_dot(x, a, sizes), np.float32),
        np.asarray(nv.ragged_dot(x, b, sizes), np.float32),
    )


def test_one_tensor_of_all_experts_shares_its_amax():
    """w [G, K, N] quantized along K as one tensor: one amax for all."""
    w = jax.random.normal(jax.random.key(0), (3, 256, 32))
    one = nv.quantize(w, axis=1)
    stacked = NVFP4Tensor(
        one.codes,
        one.scales,
        jnp.broadcast_to(one.amax, (3,)),
        shape=(256, 32),
        axis=0,
    )
    _assert_same_product(one, stacked, [7, 9, 4])


def test_is_the_dequantized_experts_product():
    """On real data: each group's rows times its dequantized expert, up to
    float32 summation order; the padding rows zeros."""
    experts = jax.random.normal(jax.random.key(1), (3, 512, 64))
    w = jax.vmap(lambda e: nv.quantize(e, axis=0, block="16x16"))(experts)
    x = jax.random.normal(jax.random.key(0), (30, 512), jnp.bfloat16)
    sizes = np.array([11, 0, 13])
    got = np.asarray(
        nv.ragged_dot(x, w, jnp.asarray(sizes), preferred_element_type=jnp.float32)
    )
    deq = np.asarray(jax.vmap(lambda e: nv.dequantize(e, jnp.float32))(w), np.float64)
    x64 = np.asarray(x, np.float64)
    group = np.repeat(np.arange(3), sizes)
    for row, g in enumerate(group):
        want = x64[row] @ deq[g]
        bound = 512 * 2**-23 * (np.abs(x64[row]) @ np.abs(deq[g]))
        assert (np.abs(got[row] - want) <= 2 * bound).all(), row
    assert (got[len(group) :] == 0).all()


def test_out_in_tensors_serve_as_stored():
    """A checkpoint's [out, in] tensors (quantized along their last axis)
    are the same stored experts as [in, out] quantized along axis 0."""
    experts = jax.random.normal(jax.random.key(5), (2, 256, 32))
    in_out = jax.vmap(lambda e: nv.quantize(e, axis=0))(experts)
    out_in = jax.vmap(lambda e: nv.quantize(e.T, axis=1))(experts)
    _assert_same_product(in_out, out_in, [4, 5])


def test_imported_experts_stack_into_one_operand():
    """Each expert quantized on its own (as a checkpoint holds them), stacked
    leaf by leaf: the same product as quantizing under vmap."""
    experts = jax.random.normal(jax.random.key(3), (2, 256, 32))
    each = [nv.quantize(e, axis=0, block="16x16") for e in experts]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *each)
    under_vmap = jax.vmap(lambda e: nv.quantize(e, axis=0, block="16x16"))(experts)
    _assert_same_product(stacked, under_vmap, [4, 5])


def test_traced_sizes_under_jit_and_vmap():
    w = _experts(4, 32, 256)
    x = _integers((2, 40, 256))
    sizes = jnp.array([[9, 0, 20, 3], [0, 40, 0, 0]], jnp.int32)
    f = jax.jit(nv.ragged_dot)
    for i in range(2):
        np.testing.assert_array_equal(
            np.asarray(f(x[i], w, sizes[i]), np.float32),
            _oracle(x[i], w, sizes[i], jnp.bfloat16),
        )
    batched = jax.vmap(nv.ragged_dot, in_axes=(0, None, 0))(x, w, sizes)
    for i in range(2):
        np.testing.assert_array_equal(
            np.asarray(batched[i], np.float32),
            _oracle(x[i], w, sizes[i], jnp.bfloat16),
        )


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"x": lambda x: x.astype(jnp.float32)}, TypeError, "takes bfloat16"),
        ({"x": lambda x: x[:, :128]}, ValueError, "K=128 features"),
        ({"x": lambda x: x[None]}, ValueError, r"\[T, K\]"),
        ({"sizes": lambda s: s[:2]}, ValueError, r"shape \(4,\)"),
        ({"sizes": lambda s: s.astype(jnp.float32)}, TypeError, "integers"),
        ({"sizes": lambda s: s.at[1].set(-1)}, ValueError, "non-negative"),
        ({"sizes": lambda s: s.at[1].set(60)}, ValueError, "sum to at most"),
        ({"dtype": jnp.float16}, TypeError, "bfloat16 or float32"),
    ],
)
def test_bad_input_is_refused_with_what_to_change(change, error, match):
    w = _experts(4, 32, 256)
    x = _integers((40, 256))
    sizes = jnp.array([10, 0, 20, 3], jnp.int32)
    x = change.get("x", lambda a: a)(x)
    sizes = change.get("sizes", lambda a: a)(sizes)
    with pytest.raises(error, match=match):
        nv.ragged_dot(x, w, sizes, preferred_element_type=change.get("dtype"))


def test_weights_it_cannot_serve_are_refused():
    x = _integers((8, 256))
    sizes = jnp.array([8, 0], jnp.int32)
    experts = jax.random.normal(jax.random.key(0), (2, 256, 32))
    along_n = jax.vmap(lambda e: nv.quantize(e, axis=1))(experts)
    with pytest.raises(ValueError, match="quantize each expert along its input"):
        nv.ragged_dot(x, along_n, sizes)
    groups_quantized = nv.quantize(jnp.swapaxes(experts, 0, 2), axis=0)
    with pytest.raises(ValueError, match="one tensor per expert, stacked"):
        nv.ragged_dot(x, groups_quantized, sizes)
    rht = jax.vmap(lambda e: nv.quantize(e, axis=0, rht=True))(experts)
    with pytest.raises(ValueError, match="Random-Hadamard"):
        nv.ragged_dot(x, rht, sizes)
    empty = jax.tree.map(lambda a: a[:0], _experts(2, 32, 256))
    with pytest.raises(ValueError, match="no group"):
        nv.ragged_dot(x, empty, jnp.zeros((0,), jnp.int32))
    with pytest.raises(ValueError, match="path must be one of"):
        ops.ragged_w4a16_matmul(
            x, *_stored(_experts(2, 32, 256)), sizes, dtype=jnp.float32, path="x"
        )


def _stored(w: NVFP4Tensor):
    groups = w.codes.shape[0]
    n, k = w.stored_shape
    return (
        w.codes.reshape(groups, n, k // 2),
        w.scales.reshape(groups, n, k // 16),
        jnp.asarray(w.amax, jnp.float32).reshape(groups),
    )


# --- which CUDA GEMM the primitive lowers to (checked on any machine) -------

RAGGED = w4a16_gemm.RAGGED_ENGINE_TARGET
lowering_for_cuda = pytest.mark.filterwarnings(
    "ignore::jax_nvfp4.MissingHandlersWarning"
)


@pytest.fixture
def hopper(monkeypatch):
    """Lowering for "cuda" as on an H100 with the grouped engine built."""
    registered = {**library.registered_targets(), "cuda": frozenset({RAGGED})}
    monkeypatch.setattr(library, "registered_targets", lambda: registered)
    monkeypatch.setattr(devices, "cuda_devices", lambda: (fake_device("gpu", "9.0"),))
    return registered


def _lowered(fn, *args):
    """(custom call targets, StableHLO text) of fn lowered for "cuda"; a
    fresh function each time, so that no cached lowering answers."""
    text = (
        jax.jit(lambda *a: fn(*a))
        .trace(*args)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    return [re.search(r"@(\w+)\(", c).group(1) for c in calls], text


@lowering_for_cuda
@pytest.mark.parametrize(
    "k,capability,switches,want",
    [
        (256, "9.0", {}, [RAGGED]),
        (4096, "9.0", {}, [RAGGED]),
        (384, "9.0", {}, []),  # K off 256: XLA's ragged_dot
        (256, "10.0", {}, []),  # sm_90a code: 9.0 only
        (256, "9.0", {"gemm_engine": False}, []),
        (256, "9.0", {"w4a16_gemm": False}, []),
    ],
)
def test_lowers_to_the_chosen_gemm(hopper, monkeypatch, k, capability, switches, want):
    gpu = fake_device("gpu", capability)
    monkeypatch.setattr(devices, "cuda_devices", lambda: (gpu,))
    x, w = _integers((40, k)), _experts(4, 64, k)
    sizes = jnp.array([10, 0, 20, 3], jnp.int32)
    with config.override(**switches):
        calls, text = _lowered(nv.ragged_dot, x, w, sizes)
    assert calls == want, text
    if not want:
        assert "ragged_dot" in text or "dot_general" in text


@lowering_for_cuda
def test_engine_call_takes_the_stacked_experts(hopper):
    x, w = _integers((40, 256)), _experts(4, 64, 256)
    sizes = jnp.array([10, 0, 20, 3], jnp.int32)
    f = functools.partial(nv.ragged_dot, preferred_element_type=jnp.float32)
    _, text = _lowered(f, x, w, sizes)
    (call,) = [line for line in text.splitlines() if f"@{RAGGED}(" in line]
    assert (
        "(tensor<40x256xbf16>, tensor<4x64x128xui8>, tensor<4x64x16xf8E4M3FN>, "
        "tensor<4xf32>, tensor<4xi32>) -> tensor<40x64xf32>"
    ) in call


@lowering_for_cuda
def test_engine_path_refuses_k_it_cannot_read(hopper):
    x, w = _integers((20, 384)), _experts(2, 64, 384)
    fn = functools.partial(ops.ragged_w4a16_matmul, dtype=jnp.float32, path="engine")
    with pytest.raises(ValueError, match="K a multiple of 256, got K = 384"):
        _lowered(fn, x, *_stored(w), jnp.array([10, 10], jnp.int32))


def test_grouped_engine_supported(monkeypatch):
    monkeypatch.setattr(library, "registered_targets", lambda: {"cuda": {RAGGED}})
    hopper, blackwell = [fake_device("gpu", "9.0")], [fake_device("gpu", "10.0")]
    assert w4a16_gemm.engine_supported(256, hopper, grouped=True)
    assert not w4a16_gemm.engine_supported(256, hopper)  # the dense target
    assert not w4a16_gemm.engine_supported(128, hopper, grouped=True)
    assert not w4a16_gemm.engine_supported(256, blackwell, grouped=True)


# --- on the GPU --------------------------------------------------------------

needs_engine = pytest.mark.skipif(
    not (has_gpu() and w4a16_gemm.engine_supported(256, grouped=True)),
    reason="needs the Hopper engine's grouped W4A16 handler on an H100/H200",
)

GPU_SIZES = {
    "decode": ([16] * 8, 128),  # 8 experts x 16 rows: 16-token tiles
    "ragged": ([1, 0, 7, 17, 33, 0, 2, 20], 100),  # tails, padding rows
    "one-row": ([0, 0, 0, 1, 0, 0, 0, 0], 3),
    "mean-30": ([40, 0, 63, 17, 100, 0, 1, 19], 240),  # 32-token tiles
    "mean-50": ([90, 33, 0, 64, 150, 0, 40, 20], 400),  # 64-token tiles
    "prefill": ([300, 0, 513, 40, 0, 0, 100, 71], 1100),  # 128-token tiles
    "empty": ([0] * 8, 16),
}


@needs_engine
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("sizes", list(GPU_SIZES), ids=list(GPU_SIZES))
@pytest.mark.parametrize(
    "n,k", [(64, 256), (130, 512), (256, 4096)], ids=["one-block", "n-tail", "split-k"]
)
def test_engine_equals_exact_sums(sizes, n, k, dtype):
    """Every token tile (16 to 128 rows), groups off 16, empty groups, rows
    past the groups, N past whole tiles, K split over a cluster."""
    sizes, rows = GPU_SIZES[sizes]
    sizes = jnp.asarray(sizes, jnp.int32)
    w = _experts(8, n, k, seed=n)
    x = _integers((rows, k), seed=k)
    fn = functools.partial(ops.ragged_w4a16_matmul, dtype=dtype, path="engine")
    got = np.asarray(jax.jit(fn)(x, *_stored(w), sizes), np.float32)
    np.testing.assert_array_equal(got, _oracle(x, w, sizes, dtype))
    twin = functools.partial(ops.ragged_w4a16_matmul, dtype=dtype, path="xla")
    np.testing.assert_array_equal(
        got, np.asarray(jax.jit(twin)(x, *_stored(w), sizes), np.float32)
    )


@needs_engine
@pytest.mark.gpu
def test_engine_keeps_nans_in_their_row_and_group():
    """A NaN in x's row 20 (group 2) and in expert 1's row 40 scale: row 20
    is NaN, and column 40 of group 1's rows only."""
    w = _experts(3, 64, 512, seed=5)
    scale_bytes = np.array(jax.lax.bitcast_convert_type(w.scales, jnp.uint8))
    scale_bytes[1, 40, 3] = 0x7F  # E4M3 NaN
    scales = jax.lax.bitcast_convert_type(jnp.asarray(scale_bytes), jnp.float8_e4m3fn)
    w = NVFP4Tensor(w.codes, scales, w.amax, shape=(512, 64), axis=0)
    x = np.array(_integers((40, 512), seed=6))
    x[20, 100] = np.nan
    sizes = jnp.array([10, 8, 12], jnp.int32)  # group 1: rows 10..17
    fn = functools.partial(ops.ragged_w4a16_matmul, dtype=jnp.float32, path="engine")
    got = np.asarray(jax.jit(fn)(jnp.asarray(x, jnp.bfloat16), *_stored(w), sizes))
    nan = np.isnan(got)
    assert nan[20].all() and nan[10:18, 40].all()
    nan[20], nan[10:18, 40] = False, False
    assert not nan.any()
    assert (got[30:] == 0).all()
