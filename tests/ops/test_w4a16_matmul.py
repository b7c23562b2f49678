"""The weight-only GEMM of serving (W4A16): ``matmul(x_bf16, w_nvfp4)`` and
its primitive ``ops.w4a16_matmul``.

Operands built so that every float32 sum is exact (integer activations, scales
1 or 2) make results that may differ only in summation order bit-identical:
the Hopper engine, the CUDA handler, the cuBLASLt path and XLA's twin must
then agree exactly.
Which CUDA GEMM the primitive lowers to is checked on any machine by lowering
for "cuda" with the handlers' registry and the devices faked."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import has_gpu, on_cpu
from gemm_cases import fake_device

import jax_nvfp4 as nv
from jax_nvfp4 import config, ops, reference
from jax_nvfp4.backends import bf16_gemm, devices, library, w4a16_gemm
from jax_nvfp4.format import NVFP4Tensor
from jax_nvfp4.ops import dispatch

E4M3_ONE, E4M3_TWO = 0x38, 0x40


def _exact_weight(n, k, seed=0, amax=2688.0 * 3):
    """An NVFP4 weight stored [N, K] with random codes and scales 1 or 2."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale_bytes = rng.choice([E4M3_ONE, E4M3_TWO], (n, k // 16)).astype(np.uint8)
    scales = jax.lax.bitcast_convert_type(jnp.asarray(scale_bytes), jnp.float8_e4m3fn)
    return NVFP4Tensor(
        jnp.asarray(codes), scales, jnp.float32(amax), shape=(k, n), axis=0
    )


def _integers(shape, seed=1):
    values = np.random.default_rng(seed).integers(-4, 5, shape)
    return jnp.asarray(values, jnp.bfloat16)


def _oracle(x, w: NVFP4Tensor, dtype):
    """float64 sums (exact here) times alpha in float32, rounded once."""
    n, k = w.stored_shape
    values = reference.decode_bf16(w.codes[None], w.scales[None])[0]
    sums = np.asarray(x, np.float64) @ np.asarray(values, np.float64).T
    alpha = np.float32(w.amax) / np.float32(2688.0)
    return jnp.asarray(sums.astype(np.float32) * alpha).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows", [(1,), (3, 5), (40,)])
def test_matches_exact_sums(rows, dtype):
    w = _exact_weight(48, 192)
    x = _integers((*rows, 192))
    got = nv.matmul(x, w, out_dtype=dtype)
    assert got.shape == (*rows, 48) and got.dtype == dtype
    want = _oracle(x.reshape(-1, 192), w, dtype).reshape(*rows, 48)
    np.testing.assert_array_equal(
        np.asarray(got, np.float32), np.asarray(want, np.float32)
    )


def test_is_the_dequantized_weight_product():
    """On real data: x . dequantize(w) up to float32 summation order."""
    x = jax.random.normal(jax.random.key(0), (8, 256), jnp.bfloat16)
    w = nv.quantize(
        jax.random.normal(jax.random.key(1), (256, 96)), axis=0, block="16x16"
    )
    got = np.asarray(nv.matmul(x, w, out_dtype=jnp.float32))
    deq = np.asarray(nv.dequantize(w, jnp.float32), np.float64)
    x64 = np.asarray(x, np.float64)
    bound = 256 * 2**-23 * (np.abs(x64) @ np.abs(deq)) + 1e-30
    assert (np.abs(got - x64 @ deq) <= bound * 2).all()


def test_bad_input_is_refused_with_what_to_change():
    w = _exact_weight(32, 64)
    with pytest.raises(TypeError, match="bfloat16 activations"):
        nv.matmul(jnp.ones((2, 64), jnp.float32), w)
    with pytest.raises(ValueError, match="K=64"):
        nv.matmul(jnp.ones((2, 48), jnp.bfloat16), w)
    rht = nv.quantize(jnp.ones((64, 32)), axis=0, rht=True)
    with pytest.raises(ValueError, match="rht=True"):
        nv.matmul(jnp.ones((2, 64), jnp.bfloat16), rht)
    stacked = nv.quantize(jnp.ones((2, 64, 32)), axis=1)
    with pytest.raises(ValueError, match=r"stored \[N, K\]"):
        nv.matmul(jnp.ones((2, 64), jnp.bfloat16), stacked)
    with pytest.raises(TypeError, match="out_dtype"):
        nv.matmul(jnp.ones((2, 64), jnp.bfloat16), w, out_dtype=jnp.int8)


def _stored(x, w: NVFP4Tensor):
    """The primitive's operands: x [1, M, K] and the weight [1, N, ...]."""
    n, k = w.stored_shape
    return (
        x.reshape(1, -1, k),
        w.codes.reshape(1, n, k // 2),
        w.scales.reshape(1, n, k // 16),
        jnp.asarray(w.amax, jnp.float32).reshape(1),
    )


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("n", [33, 48])
@pytest.mark.parametrize("m", [1, 7, 16, 17, 64, 100])
def test_primitive_equals_twin(m, n, dtype):
    """The primitive, eager and jitted, on the default device == the twin
    on the CPU (exact sums: bit for bit whichever GEMM runs); nv.matmul is
    the primitive with x's rows folded."""
    w = _exact_weight(n, 256, seed=m)
    x = _integers((m, 256), seed=n)
    args = _stored(x, w)
    want = on_cpu(functools.partial(reference.w4a16_matmul, dtype=dtype), *args)
    assert want.shape == (1, m, n) and want.dtype == dtype
    np.testing.assert_array_equal(_bits(want[0]), _bits(_oracle(x, w, dtype)))
    prim = functools.partial(ops.w4a16_matmul, dtype=dtype)
    np.testing.assert_array_equal(_bits(prim(*args)), _bits(want))
    np.testing.assert_array_equal(_bits(jax.jit(prim)(*args)), _bits(want))
    got = nv.matmul(x, w, out_dtype=dtype)
    np.testing.assert_array_equal(_bits(got), _bits(want[0]))
    twin = nv.matmul(x, w, out_dtype=dtype, implementation="reference")
    np.testing.assert_array_equal(_bits(twin), _bits(want[0]))


@pytest.mark.parametrize("m", [1, 17, 100])
def test_nan_stays_in_its_row_and_column(m):
    """A NaN in x[r] makes row r NaN; a NaN weight block (scale 0x7F) makes
    its column NaN; every other output is the one without them."""
    w = _exact_weight(40, 256, seed=3)
    x = _integers((m, 256), seed=4)
    clean = np.asarray(nv.matmul(x, w, out_dtype=jnp.float32))
    r = m // 2
    got = np.asarray(nv.matmul(x.at[r, 37].set(jnp.nan), w, out_dtype=jnp.float32))
    assert np.isnan(got[r]).all()
    others = np.arange(m) != r
    np.testing.assert_array_equal(got[others], clean[others])
    scale_bytes = jax.lax.bitcast_convert_type(w.scales, jnp.uint8)
    bad = jax.lax.bitcast_convert_type(
        scale_bytes.at[5, 3].set(0x7F), jnp.float8_e4m3fn
    )
    w_bad = NVFP4Tensor(w.codes, bad, w.amax, shape=w.shape, axis=w.axis)
    got = np.asarray(nv.matmul(x, w_bad, out_dtype=jnp.float32))
    assert np.isnan(got[:, 5]).all()
    np.testing.assert_array_equal(np.delete(got, 5, 1), np.delete(clean, 5, 1))


def _stack(ws):
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *ws)


def test_vmap():
    """vmap over x (folded into the batch), over the weight (one weight per
    item), over both, nested, and over the primitive with a batch of its
    own: the loop of single products, bit for bit (exact sums)."""
    ws = [_exact_weight(34, 128, seed=s) for s in range(3)]
    xs = jnp.stack([_integers((5, 128), seed=10 + s) for s in range(3)])

    def product(x, w):
        return nv.matmul(x, w, out_dtype=jnp.float32)

    def check(got, want):
        np.testing.assert_array_equal(_bits(got), _bits(jnp.stack(want)))

    check(jax.vmap(product, (0, None))(xs, ws[0]), [product(x, ws[0]) for x in xs])
    check(
        jax.vmap(product, (None, 0))(xs[0], _stack(ws)),
        [product(xs[0], w) for w in ws],
    )
    check(
        jax.vmap(product)(xs, _stack(ws)),
        [product(x, w) for x, w in zip(xs, ws, strict=True)],
    )
    check(
        jax.jit(jax.vmap(jax.vmap(product, (0, None)), (None, 0)))(xs, _stack(ws)),
        [jnp.stack([product(x, w) for x in xs]) for w in ws],
    )

    # The primitive on a batch of 3 items (xs) sharing one weight, vmapped
    # over the weight: the weight is repeated for every item.
    prim = functools.partial(ops.w4a16_matmul, dtype=jnp.float32)
    weights = [_stored(xs, w)[1:] for w in ws]  # (codes, scales, amax) [1, ...]
    per_weight = [prim(xs, *weight) for weight in weights]
    stacked = [jnp.stack(parts) for parts in zip(*weights, strict=True)]
    check(jax.vmap(prim, (None, 0, 0, 0))(xs, *stacked), per_weight)
    # One weight per item (item i by weight i), x vmapped.
    per_item = [jnp.concatenate(parts) for parts in zip(*weights, strict=True)]
    one = prim(xs, *per_item)
    check(one, [per_weight[i][i] for i in range(3)])
    check(
        jax.vmap(prim, (0, None, None, None))(jnp.stack([xs, 2 * xs]), *per_item),
        [one, prim(2 * xs, *per_item)],
    )


EXT = library.extension()


@pytest.mark.skipif(EXT is None, reason="needs the compiled extension")
def test_handler_plan_binding():
    """The plan weight_only sizes the handler's workspace with, through the
    extension (the plan's own tests are in tests/cpp): the arrival counts,
    then the partial sums [slices, M, N] float32 where K is split; the
    handler's refusals as ValueError."""
    for m, n, k in ((16, 14336, 4096), (64, 64, 4096), (8, 130, 2048)):
        plan = EXT.plan_w4a16(m, n, k)
        partial = 4 * plan["slices"] * m * n if plan["slices"] > 1 else 0
        assert plan["workspace_bytes"] == plan["partial_offset"] + partial
        assert plan["partial_offset"] >= plan["arrivals_bytes"]
    with pytest.raises(ValueError, match="multiple of 128"):
        EXT.plan_w4a16(8, 64, 200)
    with pytest.raises(ValueError, match="N even"):
        EXT.plan_w4a16(8, 63, 256)


# --- which CUDA GEMM the primitive lowers to (checked on any machine) -------

HANDLER = w4a16_gemm.TARGET
ENGINE = w4a16_gemm.ENGINE_TARGET
DECODE, GRAPH_GEMM = bf16_gemm.DECODE_TARGET, bf16_gemm.GRAPH_TARGET
CUDA_TARGETS = frozenset({HANDLER, DECODE, GRAPH_GEMM, bf16_gemm.TARGET})
# A CPU-only build warns when something is first lowered for "cuda".
lowering_for_cuda = pytest.mark.filterwarnings(
    "ignore::jax_nvfp4.MissingHandlersWarning"
)


@pytest.fixture
def hopper(monkeypatch):
    """Lowering for "cuda" as on an H100 with every handler built; returns
    the registry of targets, which a test may change."""
    registered = {**library.registered_targets(), "cuda": CUDA_TARGETS}
    monkeypatch.setattr(library, "registered_targets", lambda: registered)
    monkeypatch.setattr(devices, "cuda_devices", lambda: (fake_device("gpu", "9.0"),))
    return registered


def _lowered(fn, *args, platform="cuda"):
    """(custom call targets, StableHLO text) of fn lowered for ``platform``."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    return [re.search(r"@(\w+)\(", c).group(1) for c in calls], text


def _serving(lead, k, n, seed=0):
    return _integers((*lead, k), seed=seed), _exact_weight(n, k, seed=seed)


def _product(dtype=jnp.bfloat16):
    return lambda x, w: nv.matmul(x, w, out_dtype=dtype)


CUBLASLT = [DECODE, GRAPH_GEMM]


@lowering_for_cuda
@pytest.mark.parametrize(
    "lead,k,n,switches,want",
    [
        ((8,), 256, 64, {}, [HANDLER]),
        ((3, 5), 256, 64, {}, [HANDLER]),  # 15 rows
        ((w4a16_gemm.MAX_HANDLER_ROWS,), 256, 64, {}, [HANDLER]),
        ((w4a16_gemm.MAX_HANDLER_ROWS + 1,), 256, 64, {}, CUBLASLT),
        ((9, 8), 256, 64, {}, CUBLASLT),  # 72 rows
        ((8,), 80, 64, {}, CUBLASLT),  # K not a multiple of 128
        ((8,), 256, 65, {}, CUBLASLT),  # N odd
        ((8,), 256, 64, {"w4a16_gemm": False}, CUBLASLT),
        ((8,), 256, 64, {"cublaslt_gemm": False}, [HANDLER]),
        ((100,), 256, 64, {"gemm_graphs": False}, [DECODE, bf16_gemm.TARGET]),
        ((100,), 256, 64, {"cublaslt_gemm": False}, []),
        ((8,), 256, 64, {"w4a16_gemm": False, "cublaslt_gemm": False}, []),
    ],
)
def test_lowers_to_the_chosen_gemm(hopper, lead, k, n, switches, want):
    x, w = _serving(lead, k, n)
    with config.override(**switches):
        calls, text = _lowered(_product(), x, w)
    assert calls == want, text
    if not want:
        assert "dot_general" in text  # XLA's GEMM, the twin's


@lowering_for_cuda
@pytest.mark.skipif(EXT is None, reason="needs the compiled extension")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_handler_call_takes_the_folded_rows(hopper, dtype):
    """x's rows folded into one [M, K] operand, the stored weight, and the
    workspace its plan asks for."""
    x, w = _serving((3, 5), 256, 64)
    _, text = _lowered(_product(dtype), x, w)
    (call,) = [line for line in text.splitlines() if f"@{HANDLER}(" in line]
    out = "bf16" if dtype == jnp.bfloat16 else "f32"
    ws = EXT.plan_w4a16(15, 64, 256)["workspace_bytes"]
    assert (
        "(tensor<15x256xbf16>, tensor<64x128xui8>, tensor<64x16xf8E4M3FN>, "
        f"tensor<1xf32>) -> (tensor<15x64x{out}>, tensor<{ws}xui8>)"
    ) in call


@lowering_for_cuda
def test_cublaslt_path_is_one_gemm_over_all_rows(hopper):
    x, w = _serving((2, 50), 256, 64)
    _, text = _lowered(_product(jnp.float32), x, w)
    (decode,) = [line for line in text.splitlines() if f"@{DECODE}(" in line]
    (gemm,) = [line for line in text.splitlines() if f"@{GRAPH_GEMM}(" in line]
    assert "-> tensor<1x64x256xbf16>" in decode
    assert "(tensor<1x100x256xbf16>, tensor<1x64x256xbf16>" in gemm
    assert "-> (tensor<1x100x64xf32>" in gemm


@lowering_for_cuda
def test_the_path_is_chosen_when_lowered(hopper):
    """One trace, lowered in two configurations: the choice follows the
    configuration in effect when lowering, not when tracing."""
    x, w = _serving((8,), 256, 64)
    traced = jax.jit(_product()).trace(x, w)

    def calls():
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        return [HANDLER in line for line in text.splitlines() if "custom_call" in line]

    assert calls() == [True]
    with config.override(w4a16_gemm=False):
        assert calls() == [False, False]


@lowering_for_cuda
def test_lowering_follows_the_devices_and_handlers(hopper, monkeypatch):
    x, w = _serving((8,), 256, 64)
    for capability, want in [("8.0", [HANDLER]), ("10.0", [HANDLER]), ("7.5", [])]:
        gpu = fake_device("gpu", capability)
        monkeypatch.setattr(devices, "cuda_devices", lambda gpu=gpu: (gpu,))
        assert _lowered(_product(), x, w)[0] == want, capability
    monkeypatch.setattr(devices, "cuda_devices", lambda: ())  # lowered without a GPU
    assert _lowered(_product(), x, w)[0] == []
    monkeypatch.setattr(devices, "cuda_devices", lambda: (fake_device("gpu", "9.0"),))
    hopper["cuda"] = CUDA_TARGETS - {HANDLER}
    assert _lowered(_product(), x, w)[0] == CUBLASLT
    hopper["cuda"] = CUDA_TARGETS - {HANDLER, DECODE}  # XLA decodes the weight
    assert _lowered(_product(), x, w)[0] == [GRAPH_GEMM]


@lowering_for_cuda
def test_cpu_lowering_is_the_twin(hopper):
    x, w = _serving((8,), 256, 64)
    calls, text = _lowered(_product(), x, w, platform="cpu")
    assert calls == [] and "dot_general" in text


@lowering_for_cuda
def test_one_weight_per_item_never_takes_the_handler(hopper):
    """vmap over the weight: one GEMM per item by cuBLASLt, decoded as one
    [items, N, K] operand."""
    x = _integers((8, 256))
    ws = _stack([_exact_weight(64, 256, seed=s) for s in range(3)])
    calls, text = _lowered(jax.vmap(_product(), (None, 0)), x, ws)
    assert calls == CUBLASLT
    assert "(tensor<3x8x256xbf16>, tensor<3x64x256xbf16>" in text


@lowering_for_cuda
def test_explicit_path(hopper):
    """ops.w4a16_matmul(path=...) lowers to the GEMM named, whatever the
    dispatcher would choose."""
    few, many = _stored(*_serving((8,), 256, 64)), _stored(*_serving((100,), 256, 64))

    def lowered(args, path):
        fn = functools.partial(ops.w4a16_matmul, dtype=jnp.float32, path=path)
        return _lowered(fn, *args)[0]

    assert lowered(few, "auto") == [HANDLER] and lowered(many, "auto") == CUBLASLT
    assert lowered(many, "handler") == [HANDLER]
    assert lowered(few, "cublaslt") == CUBLASLT
    assert lowered(few, "xla") == []
    with pytest.raises(ValueError, match="path must be one of"):
        ops.w4a16_matmul(*few, dtype=jnp.float32, path="native")
    per_item = (
        jnp.concatenate([few[0]] * 2),
        *(jnp.concatenate([a] * 2) for a in few[1:]),
    )
    with pytest.raises(ValueError, match="one weight"):
        lowered(per_item, "handler")


def test_w4a16_path(monkeypatch):
    """The dispatcher's rule, by rows, alignment, devices and switches."""
    registered = {"cuda": CUDA_TARGETS}
    monkeypatch.setattr(library, "registered_targets", lambda: registered)
    path = dispatch.w4a16_path
    h100 = [fake_device("gpu", "9.0")]
    assert path(1, 256, 64, h100) == "handler"
    assert path(w4a16_gemm.MAX_HANDLER_ROWS, 4096, 14336, h100) == "handler"
    assert path(w4a16_gemm.MAX_HANDLER_ROWS + 1, 256, 64, h100) == "cublaslt"
    assert path(8, 256 + 16, 64, h100) == "cublaslt"
    assert path(8, 256, 63, h100) == "cublaslt"
    assert path(8, 256, 64, h100, weights=2) == "cublaslt"
    assert path(8, 256, 64, [*h100, fake_device("gpu", "7.5")]) == "xla"
    assert path(8, 256, 64, jax.devices("cpu")) == "xla"
    assert path(8, 256, 64, []) == "xla"
    for empty in [(0, 256, 64), (8, 0, 64), (8, 256, 0)]:
        assert path(*empty, h100) == "xla"
    with config.override(w4a16_gemm=False):
        assert path(8, 256, 64, h100) == "cublaslt"
        with config.override(cublaslt_gemm=False):
            assert path(8, 256, 64, h100) == "xla"
    registered["cuda"] = frozenset({HANDLER})
    assert path(8, 256, 64, h100) == "handler"
    assert path(100, 256, 64, h100) == "xla"
    registered["cuda"] = frozenset({HANDLER, ENGINE})
    assert path(1, 256, 64, h100) == "engine"
    assert path(16, 256, 64, h100) == "engine"
    assert path(17, 256, 64, h100) == "engine"
    assert path(16, 256, 63, h100) == "engine"
    assert path(16, 384, 64, h100) == "handler"  # K off 256: no engine
    with config.override(gemm_engine=False):
        assert path(16, 256, 64, h100) == "handler"
    assert path(w4a16_gemm.MAX_ENGINE_ROWS, 256, 64, h100) == "engine"
    assert path(w4a16_gemm.MAX_ENGINE_ROWS + 1, 256, 64, h100) == "xla"


@lowering_for_cuda
@pytest.mark.parametrize(
    "lead,k,n,capability,switches,want",
    [
        ((17,), 256, 64, "9.0", {}, [ENGINE]),
        ((3, 6), 512, 64, "9.0", {}, [ENGINE]),  # 18 rows
        ((512,), 256, 64, "9.0", {}, [ENGINE]),
        ((513,), 256, 64, "9.0", {}, CUBLASLT),  # the decode pays off
        ((1,), 256, 64, "9.0", {}, [ENGINE]),
        ((16,), 256, 65, "9.0", {}, [ENGINE]),
        ((40,), 384, 64, "9.0", {}, [HANDLER]),  # K off 256: no engine
        ((40,), 256, 64, "10.0", {}, [HANDLER]),  # sm_90a code: 9.0 only
        ((40,), 256, 64, "9.0", {"gemm_engine": False}, [HANDLER]),
        ((40,), 256, 64, "9.0", {"w4a16_gemm": False}, CUBLASLT),
    ],
)
def test_engine_is_chosen_on_hopper(
    hopper, monkeypatch, lead, k, n, capability, switches, want
):
    hopper["cuda"] = CUDA_TARGETS | {ENGINE}
    gpu = fake_device("gpu", capability)
    monkeypatch.setattr(devices, "cuda_devices", lambda: (gpu,))
    x, w = _serving(lead, k, n)
    with config.override(**switches):
        calls, text = _lowered(_product(), x, w)
    assert calls == want, text


@lowering_for_cuda
def test_engine_call_takes_the_folded_rows(hopper):
    """x's rows folded into one [M, K] operand, the stored weight, no
    workspace."""
    hopper["cuda"] = CUDA_TARGETS | {ENGINE}
    x, w = _serving((3, 6), 256, 64)
    _, text = _lowered(_product(jnp.float32), x, w)
    (call,) = [line for line in text.splitlines() if f"@{ENGINE}(" in line]
    assert (
        "(tensor<18x256xbf16>, tensor<64x128xui8>, tensor<64x16xf8E4M3FN>, "
        "tensor<1xf32>) -> tensor<18x64xf32>"
    ) in call


@lowering_for_cuda
def test_engine_path_refuses_k_it_cannot_read(hopper):
    hopper["cuda"] = CUDA_TARGETS | {ENGINE}
    args = _stored(*_serving((20,), 384, 64))
    fn = functools.partial(ops.w4a16_matmul, dtype=jnp.float32, path="engine")
    with pytest.raises(ValueError, match="K a multiple of 256, got K = 384"):
        _lowered(fn, *args)
    one = _stored(*_serving((20,), 256, 64))
    per_item = tuple(jnp.concatenate([a] * 2) for a in one)
    with pytest.raises(ValueError, match="one weight"):
        _lowered(fn, *per_item)


def test_engine_supported(monkeypatch):
    monkeypatch.setattr(library, "registered_targets", lambda: {"cuda": {ENGINE}})
    hopper, blackwell = [fake_device("gpu", "9.0")], [fake_device("gpu", "10.0")]
    assert w4a16_gemm.engine_supported(256, hopper)
    assert w4a16_gemm.engine_supported(14336, hopper)
    assert not w4a16_gemm.engine_supported(128, hopper)
    assert not w4a16_gemm.engine_supported(0, hopper)
    assert not w4a16_gemm.engine_supported(256, blackwell)
    assert not w4a16_gemm.engine_supported(256, [*hopper, *blackwell])
    assert not w4a16_gemm.engine_supported(256, [])
    monkeypatch.setattr(library, "registered_targets", lambda: {"cuda": set()})
    assert not w4a16_gemm.engine_supported(256, hopper)


needs_handler = pytest.mark.skipif(
    not (has_gpu() and w4a16_gemm.handler_supported(256, 2)),
    reason="needs the CUDA W4A16 handler on a GPU",
)


def _paths(x, w, dtype):
    """{path: the primitive lowered to that GEMM} on x [M, K] (or [b, M, K])."""
    args = _stored(x, w)
    if x.ndim == 3:
        args = (x, *args[1:])
    paths = ["xla", "handler"]
    if bf16_gemm.cublaslt_gemm_supported():
        paths.append("cublaslt")
    if w4a16_gemm.engine_supported(x.shape[-1]):
        paths.append("engine")
    out = {}
    for path in paths:
        fn = functools.partial(ops.w4a16_matmul, dtype=dtype, path=path)
        out[path] = jax.jit(fn)(*args).reshape(*x.shape[:-1], -1)
    return out


@needs_handler
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m", [1, 16, 17, 40, 64, 100, 300])
@pytest.mark.parametrize(
    "n,k",
    [(64, 256), (130, 512), (512, 4096), (130, 128), (66, 2176)],
    ids=["one-slice", "n-tail", "slices", "one-chunk", "short-last-slice"],
)
def test_handler_equals_twin_exactly(m, n, k, dtype):
    w = _exact_weight(n, k, seed=m)
    x = _integers((m, k), seed=n)
    out = _paths(x, w, dtype)
    want = np.asarray(_oracle(x, w, dtype), np.float32)
    for path, got in out.items():
        np.testing.assert_array_equal(np.asarray(got, np.float32), want, err_msg=path)


needs_engine = pytest.mark.skipif(
    not (has_gpu() and w4a16_gemm.engine_supported(256)),
    reason="needs the Hopper engine's W4A16 handler on an H100/H200",
)


@needs_engine
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m", [1, 7, 16, 17, 64, 100, 256, 2048])
@pytest.mark.parametrize(
    "n,k",
    [(64, 256), (130, 512), (1024, 4096), (300, 1024), (2, 14336)],
    ids=["one-block", "n-tail", "split-k", "n-quad-tail", "two-rows"],
)
def test_engine_equals_twin_exactly(m, n, k, dtype):
    """Every configuration (16 to 128 tokens a tile), K split over a cluster
    or not, N past whole tiles and quads."""
    w = _exact_weight(n, k, seed=m)
    x = _integers((m, k), seed=n)
    fn = functools.partial(ops.w4a16_matmul, dtype=dtype, path="engine")
    got = jax.jit(fn)(*_stored(x, w))[0]
    want = np.asarray(_oracle(x, w, dtype), np.float32)
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)


@needs_engine
@pytest.mark.gpu
def test_engine_keeps_nans_in_their_row_and_column():
    """A NaN in x's row i and in weight row j's scale: row i and column j
    are NaN, nothing else."""
    w = _exact_weight(200, 512, seed=3)
    scale_bytes = np.array(jax.lax.bitcast_convert_type(w.scales, jnp.uint8))
    scale_bytes[150, 7] = 0x7F  # E4M3 NaN
    scales = jax.lax.bitcast_convert_type(jnp.asarray(scale_bytes), jnp.float8_e4m3fn)
    w = NVFP4Tensor(w.codes, scales, w.amax, shape=(512, 200), axis=0)
    x = np.array(_integers((20, 512), seed=4))
    x[5, 300] = np.nan
    fn = functools.partial(ops.w4a16_matmul, dtype=jnp.float32, path="engine")
    got = np.asarray(jax.jit(fn)(*_stored(jnp.asarray(x, jnp.bfloat16), w))[0])
    nan = np.isnan(got)
    assert nan[5].all() and nan[:, 150].all()
    nan[5], nan[:, 150] = False, False
    assert not nan.any()


@needs_handler
@pytest.mark.gpu
def test_handler_on_real_values_within_summation_order():
    x = jax.random.normal(jax.random.key(2), (24, 4096), jnp.bfloat16)
    w = nv.quantize(jax.random.normal(jax.random.key(3), (4096, 256)), axis=0)
    out = _paths(x, w, jnp.float32)
    deq = np.asarray(nv.dequantize(w, jnp.float32), np.float64)
    x64 = np.asarray(x, np.float64)
    bound = 4096 * 2**-23 * (np.abs(x64) @ np.abs(deq))
    for path, got in out.items():
        assert (np.abs(np.asarray(got) - x64 @ deq) <= bound).all(), path


@needs_handler
@pytest.mark.gpu
def test_handler_is_deterministic():
    """K split over CTAs: repeated calls agree bit for bit. (The kernel adds
    the slices in slice order; on an idle GPU the CTAs also finish in a
    nearly fixed order, so this catches gross nondeterminism only.)"""
    x = jax.random.normal(jax.random.key(4), (16, 8192), jnp.bfloat16)
    w = nv.quantize(jax.random.normal(jax.random.key(5), (8192, 1024)), axis=0)
    args = _stored(x, w)
    call = jax.jit(
        functools.partial(ops.w4a16_matmul, dtype=jnp.float32, path="handler")
    )
    first = np.asarray(call(*args))
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(call(*args)), first)


@needs_handler
@pytest.mark.gpu
def test_handler_folds_the_batch_into_rows():
    w = _exact_weight(130, 512, seed=7)
    x = _integers((3, 5, 512), seed=8)
    want = np.asarray(_oracle(x.reshape(15, 512), w, jnp.float32)).reshape(3, 5, 130)
    for path, got in _paths(x, w, jnp.float32).items():
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=path)


@needs_handler
@pytest.mark.gpu
def test_matmul_dispatch_on_gpu():
    """On an H100/H200 up to 512 rows take the engine; elsewhere few rows the
    handler and more than 64 the cuBLASLt path; K off 128 the cuBLASLt path,
    one weight per item the cuBLASLt batch: all equal the exact sums."""
    cublaslt = [DECODE, GRAPH_GEMM] if bf16_gemm.cublaslt_gemm_supported() else []
    engine = w4a16_gemm.engine_supported(256)
    cases = [
        (8, 256, [ENGINE] if engine else [HANDLER]),
        (w4a16_gemm.MAX_HANDLER_ROWS + 16, 256, [ENGINE] if engine else cublaslt),
        (w4a16_gemm.MAX_ENGINE_ROWS + 16, 256, cublaslt),
        (8, 80, cublaslt),
    ]
    for m, k, calls in cases:
        w = _exact_weight(64, k, seed=k)
        x = _integers((m, k), seed=m)
        assert _lowered(_product(jnp.float32), x, w)[0] == calls, (m, k)
        got = jax.jit(_product(jnp.float32))(x, w)
        want = _oracle(x, w, jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    ws = [_exact_weight(64, 256, seed=s) for s in range(3)]
    x = _integers((8, 256), seed=9)
    got = jax.jit(jax.vmap(_product(jnp.float32), (None, 0)))(x, _stack(ws))
    for w, g in zip(ws, got, strict=True):
        np.testing.assert_array_equal(np.asarray(g), _oracle(x, w, jnp.float32))
