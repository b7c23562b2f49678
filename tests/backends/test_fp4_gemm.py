"""The Blackwell FP4 GEMM's host-side logic, on CPU: the padded codes and
swizzled scales handed to the handler (against the layout's definition), the
handler's plan for them (C++, through jax_nvfp4._ffi_testing), the custom call
it lowers to, and a float64 emulation of the handler's contract against the
reference and the CPU handler, on shapes that are not multiples of the tiles.
GPU tests run the real handler: against the CPU handler on a Blackwell GPU,
and its clean refusal on an older one (e.g. Hopper)."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import on_cpu
from gemm_cases import alpha64, decode64, random_operands

from jax_nvfp4 import config, reference
from jax_nvfp4 import ops as primitives
from jax_nvfp4.backends import fp4_gemm, library
from jax_nvfp4.ops import dispatch

# (batch, M, N, K, b batch, per-item a amax, per-item b amax); M, N, K are odd
# multiples of 16, so every operand is padded.
CASES = [
    (1, 16, 16, 16, 1, False, False),
    (3, 48, 80, 112, 1, True, False),
    (2, 144, 16, 208, 2, True, True),
    (2, 16, 272, 48, 2, False, True),
]


@jax.jit
def _prepare_arrays(*args):
    return fp4_gemm.native_operands(*args)[:6]


def _prepare(args) -> fp4_gemm.NativeOperands:
    """native_operands, jitted (the arrays; m and n are static)."""
    return fp4_gemm.NativeOperands(
        *_prepare_arrays(*args), m=args[0].shape[1], n=args[3].shape[1]
    )


def _unswizzle(flat, rows, cols):
    """The swizzled layout read back by its definition: byte
    tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4 of tile
    (r // 128, c // 4) holds scale (r, c)."""
    r, c = np.indices((rows, cols))
    tile = (r // 128) * (cols // 4) + c // 4
    return np.asarray(flat)[tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4]


def _emulate_handler(ops: fp4_gemm.NativeOperands):
    """What jax_nvfp4_matmul_fp4_sm100 computes, from exactly its operands, in
    float64 (exact products of <= 12-bit significands): [batch, Mp, Np]."""
    batch, mp, half = ops.a_codes.shape
    b_batch, np_ = ops.b_codes.shape[:2]
    kp = 2 * half
    a_scales = np.stack([_unswizzle(s, mp, kp // 16) for s in ops.a_scales])
    b_scales = np.stack([_unswizzle(s, np_, kp // 16) for s in ops.b_scales])
    a = decode64(ops.a_codes, a_scales)
    b = np.broadcast_to(decode64(ops.b_codes, b_scales), (batch, np_, kp))
    alpha = alpha64(ops.a_amax, ops.b_amax, batch)
    acc = np.einsum("bmk,bnk->bmn", a, b)
    return acc * alpha[:, None, None]


def _exact(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax):
    """The spec in float64 on the unpadded operands (alpha as float32)."""
    a = decode64(a_codes, np.asarray(a_scales).view(np.uint8))
    b = decode64(b_codes, np.asarray(b_scales).view(np.uint8))
    b = np.broadcast_to(b, (a.shape[0], *b.shape[1:]))
    alpha = alpha64(a_amax, b_amax, a.shape[0])
    return np.einsum("bmk,bnk->bmn", a, b) * alpha.reshape(-1, 1, 1), (a, b, alpha)


def _float32_bound(a, b, alpha):
    """Float32 accumulation in any order is within 2 K 2^-24 sum|a b| alpha
    of the exact sum (plus the rounding of the final product by alpha)."""
    k = a.shape[-1]
    mag = np.einsum("bmk,bnk->bmn", np.abs(a), np.abs(b)) * alpha.reshape(-1, 1, 1)
    return 2 * k * 2.0**-24 * mag


@pytest.mark.parametrize("case", CASES)
def test_operands_are_padded_and_swizzled(case):
    batch, m, n, k, b_batch = case[:5]
    args = random_operands(1, *case)
    ops = _prepare(args)
    mp, np_, kp = (-(-v // t) * t for v, t in ((m, 128), (n, 128), (k, 64)))
    assert (ops.m, ops.n) == (m, n)
    assert ops.a_codes.shape == (batch, mp, kp // 2)
    assert ops.b_codes.shape == (b_batch, np_, kp // 2)
    assert ops.a_scales.shape == (batch, mp * kp // 16)
    assert ops.b_scales.shape == (b_batch, np_ * kp // 16)
    for codes, scales, want_codes, want_scales, rows, padded in (
        (ops.a_codes, ops.a_scales, args[0], args[1], m, mp),
        (ops.b_codes, ops.b_scales, args[3], args[4], n, np_),
    ):
        codes = np.asarray(codes)
        np.testing.assert_array_equal(codes[:, :rows, : k // 2], want_codes)
        pad = np.ones(codes.shape, bool)
        pad[:, :rows, : k // 2] = False
        assert not codes[pad].any(), "padded codes must be zero"
        for item in range(codes.shape[0]):
            grid = _unswizzle(scales[item], padded, kp // 16)
            np.testing.assert_array_equal(
                grid[:rows, : k // 16], np.asarray(want_scales[item]).view(np.uint8)
            )
            grid[:rows, : k // 16] = 0
            assert not grid.any(), "padded scales must be zero"
    for got, want in ((ops.a_amax, args[2]), (ops.b_amax, args[5])):
        assert got.dtype == jnp.float32 and got.ndim == 1
        np.testing.assert_array_equal(got, np.asarray(want).reshape(-1))


@pytest.mark.parametrize("case", CASES)
def test_handler_plans_the_prepared_operands(case):
    """The handler's plan (ffi/gemm/cublaslt/fp4_gemm_plan.h, tested in
    tests/cpp) accepts the operands and workspace that matmul_native hands it,
    and launch i reads item i of each at the offsets of Python's arrays."""
    testing = pytest.importorskip("jax_nvfp4._ffi_testing")
    ops = _prepare(random_operands(2, *case))
    batch, mp, half = ops.a_codes.shape
    np_ = ops.b_codes.shape[1]
    shapes = {name: list(getattr(ops, name).shape) for name in ops._fields[:6]}
    plan = testing.plan_fp4_gemm(
        **shapes,
        out=[batch, mp, np_],
        workspace=[fp4_gemm.workspace_bytes(batch)],
    )
    kp = 2 * half
    assert (plan["batch"], plan["m"], plan["n"], plan["k"]) == (batch, mp, np_, kp)
    assert plan["workspace_bytes"] == fp4_gemm.WORKSPACE_BYTES
    assert plan["workspace_head_bytes"] == (
        fp4_gemm.workspace_bytes(batch) - fp4_gemm.WORKSPACE_BYTES
    )
    one_alpha = ops.a_amax.shape[0] == ops.b_amax.shape[0] == 1
    assert plan["alphas"] == (1 if one_alpha else batch)
    assert plan["zeros"] == []
    shared = ops.b_codes.shape[0] == 1
    b_item = 0 if shared else 1
    assert [
        (x["a"], x["b"], x["a_scales"], x["b_scales"], x["out"], x["alpha"])
        for x in plan["launches"]
    ] == [
        (
            i * mp * half,
            i * b_item * np_ * half,
            i * ops.a_scales.shape[1],
            i * b_item * ops.b_scales.shape[1],
            i * mp * np_,
            0 if one_alpha else i,
        )
        for i in range(batch)
    ]
    assert all(
        (x["m"], x["n"], x["k"], x["ld"]) == (mp, np_, kp, kp) for x in plan["launches"]
    )


@pytest.mark.parametrize("case", CASES)
def test_handler_contract_matches_reference_and_cpu_handler(case):
    args = random_operands(3, *case)
    ops = _prepare(args)
    got = _emulate_handler(ops)[:, : ops.m, : ops.n]
    exact, (a, b, alpha) = _exact(*args)
    # The padded problem is the same sum: zeros add nothing.
    np.testing.assert_allclose(got, exact, rtol=1e-12, atol=1e-300)
    bound = _float32_bound(a, b, alpha) * 1.01 + np.abs(exact) * 2.0**-23
    for name, fn in (
        ("reference", reference.matmul),
        ("CPU handler", primitives.matmul),
    ):
        want = on_cpu(jax.jit(functools.partial(fn, dtype=jnp.float32)), *args)
        assert want.shape == exact.shape, name
        assert np.all(np.abs(np.asarray(want, np.float64) - got) <= bound), name


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_matmul_native_slices_the_handler_result(monkeypatch, dtype):
    """matmul_native end to end on CPU, with the custom call replaced by the
    handler's emulation: the result is the unpadded block, of dtype."""

    def fake_handler(ops, out_dtype):
        batch, mp = ops.a_codes.shape[:2]
        shape = jax.ShapeDtypeStruct((batch, mp, ops.b_codes.shape[1]), out_dtype)
        return jax.pure_callback(
            lambda o: _emulate_handler(o).astype(np.float32).astype(out_dtype),
            shape,
            ops,
            vmap_method="sequential",
        )

    monkeypatch.setattr(fp4_gemm, "_call_handler", fake_handler)
    args = random_operands(4, *CASES[2])
    got = jax.jit(functools.partial(fp4_gemm.matmul_native, dtype=dtype))(*args)
    exact, (a, b, alpha) = _exact(*args)
    assert got.shape == exact.shape and got.dtype == dtype
    want = on_cpu(primitives.matmul, *args, dtype=jnp.float32)
    bound = _float32_bound(a, b, alpha) * 1.01 + np.abs(exact) * 2.0**-23
    assert np.all(np.abs(np.asarray(want, np.float64) - exact) <= bound)
    if dtype == jnp.float32:
        assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= bound)
    else:  # one rounding of the float32 result, as on every backend
        np.testing.assert_array_equal(got, exact.astype(np.float32).astype(dtype))


def test_lowers_to_the_custom_call_with_padded_operands():
    args = random_operands(5, *CASES[1])  # batch 3, M=48, N=80, K=112, shared b
    text = (
        jax.jit(functools.partial(fp4_gemm.matmul_native, dtype=jnp.bfloat16))
        .lower(*args)
        .as_text()
    )
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and "@jax_nvfp4_matmul_fp4_sm100(" in calls[0]
    workspace = fp4_gemm.workspace_bytes(3)
    assert (
        "(tensor<3x128x64xui8>, tensor<3x1024xui8>, tensor<3xf32>, "
        "tensor<1x128x64xui8>, tensor<1x1024xui8>, tensor<1xf32>) -> "
        f"(tensor<3x128x128xbf16>, tensor<{workspace}xui8>)"
    ) in calls[0]


def test_empty_problems_skip_the_handler():
    args = random_operands(6, 2, 16, 16, 16, 1, False, False)
    empty_m = (args[0][:, :0], args[1][:, :0], *args[2:])
    out = fp4_gemm.matmul_native(*empty_m, dtype=jnp.float32)
    assert out.shape == (2, 0, 16)
    zero_k = (args[0][..., :0], args[1][..., :0], args[2], args[3][..., :0])
    out = fp4_gemm.matmul_native(*zero_k, args[4][..., :0], args[5], dtype=jnp.bfloat16)
    assert out.shape == (2, 16, 16) and not np.asarray(out, np.float32).any()


def test_operand_errors_say_what_to_change():
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax = random_operands(
        7, 2, 16, 16, 32, 2, True, True
    )
    with pytest.raises(ValueError, match="both must be the same multiple of 16"):
        fp4_gemm.native_operands(
            a_codes, a_scales, a_amax, b_codes[..., :8], b_scales[..., :1], b_amax
        )
    with pytest.raises(ValueError, match="b's batch must be 1 or a's"):
        fp4_gemm.native_operands(
            a_codes,
            a_scales,
            a_amax,
            jnp.concatenate([b_codes] * 2),
            jnp.concatenate([b_scales] * 2),
            jnp.ones(1),
        )
    with pytest.raises(ValueError, match="a_amax must have 1 or 2"):
        fp4_gemm.native_operands(
            a_codes, a_scales, jnp.ones(3), b_codes, b_scales, b_amax
        )
    with pytest.raises(TypeError, match="a_scales must be float8_e4m3fn"):
        fp4_gemm.native_operands(
            a_codes, a_scales.view(jnp.uint8), a_amax, b_codes, b_scales, b_amax
        )
    with pytest.raises(TypeError, match="dtype must be bfloat16 or float32"):
        fp4_gemm.matmul_native(
            a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, dtype=jnp.float16
        )


def _device(platform, capability):
    return types.SimpleNamespace(platform=platform, compute_capability=capability)


def test_native_fp4_supported_on_cpu_is_false():
    assert not fp4_gemm.native_fp4_supported()
    assert not fp4_gemm.native_fp4_supported(jax.devices("cpu")[0])
    ctx = types.SimpleNamespace(
        platforms=None, module_context=types.SimpleNamespace(platforms=("cpu",))
    )
    assert not fp4_gemm.native_fp4_supported(ctx)


def test_native_fp4_supported_decides_by_capability_and_registration(monkeypatch):
    registered = {"cuda": frozenset({fp4_gemm.TARGET})}
    monkeypatch.setattr(library, "registered_targets", lambda: registered)
    assert fp4_gemm.native_fp4_supported(_device("gpu", "10.0"))
    assert fp4_gemm.native_fp4_supported(
        [_device("gpu", "10.3"), _device("gpu", "12.0")]
    )
    assert not fp4_gemm.native_fp4_supported(_device("gpu", "9.0"))
    assert not fp4_gemm.native_fp4_supported(
        [_device("gpu", "10.0"), _device("gpu", "9.0")]
    )
    assert not fp4_gemm.native_fp4_supported(_device("gpu", None))  # e.g. ROCm
    assert not fp4_gemm.native_fp4_supported([])
    # Several lowering platforms (export): the portable bf16 GEMM.
    ctx = types.SimpleNamespace(platforms=("cuda", "cpu"), module_context=None)
    assert not fp4_gemm.native_fp4_supported(ctx)
    with config.override(native_gemm=False):  # the dispatcher's switch
        assert dispatch.dense_path([_device("gpu", "10.0")]) != "native_fp4"
    assert dispatch.dense_path([_device("gpu", "10.0")]) == "native_fp4"
    monkeypatch.setattr(library, "registered_targets", lambda: {"cuda": frozenset()})
    assert not fp4_gemm.native_fp4_supported(_device("gpu", "10.0"))
    with pytest.raises(TypeError, match="target must be"):
        fp4_gemm.native_fp4_supported(3.0)


def _blackwell_gpu():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    return gpus[0] if gpus and fp4_gemm.native_fp4_supported(gpus) else None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("case", CASES)
def test_native_gemm_on_blackwell_matches_cpu_handler(case, dtype):
    gpu = _blackwell_gpu()
    if gpu is None:
        pytest.skip("needs a GPU of compute capability >= 10.0 with the handler built")
    args = random_operands(9, *case)
    on_gpu = [jax.device_put(x, gpu) for x in args]
    got = jax.jit(functools.partial(fp4_gemm.matmul_native, dtype=dtype))(*on_gpu)
    exact, (a, b, alpha) = _exact(*args)
    bound = _float32_bound(a, b, alpha) * 1.01 + np.abs(exact) * 2.0**-23
    want = on_cpu(primitives.matmul, *args, dtype=jnp.float32)
    assert np.all(np.abs(np.asarray(want, np.float64) - exact) <= bound)
    if dtype == jnp.float32:
        assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= bound)
    else:  # within one bf16 rounding of a float32 result inside the bound
        tol = bound + np.abs(exact) * 2.0**-8
        assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= tol)


def _pre_blackwell_gpu_with_handler():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    registered = library.registered_targets().get("cuda", frozenset())
    if not gpus or fp4_gemm.TARGET not in registered:
        return None
    return None if fp4_gemm.native_fp4_supported(gpus[0]) else gpus[0]


@pytest.mark.gpu
def test_handler_on_an_older_gpu_fails_cleanly():
    """On a GPU without FP4 tensor cores (Hopper) the real handler decodes its
    operands, passes its shape checks and returns an error that says what to
    do -- no crash."""
    gpu = _pre_blackwell_gpu_with_handler()
    if gpu is None:
        pytest.skip("needs a GPU of compute capability < 10.0 with the handler built")
    args = [jax.device_put(x, gpu) for x in random_operands(10, *CASES[1])]
    with pytest.raises(jax.errors.JaxRuntimeError, match="compute capability 10.0"):
        jax.block_until_ready(
            jax.jit(functools.partial(fp4_gemm.matmul_native, dtype=jnp.bfloat16))(
                *args
            )
        )
    # The primitive itself keeps the exact bf16 GEMM there.
    assert not fp4_gemm.native_fp4_supported(gpu)
