"""The matmul primitive's CUDA dispatch (jax_nvfp4.ops.matmul) and the cuBLASLt
bf16 GEMM handler with alpha in the epilogue (jax_nvfp4.backends.hopper).

On CPU: which GEMM is chosen for which devices, registrations and switches;
the one custom call the primitive lowers to for "cuda"; the exact bf16 decode;
the operands handed to the handler (with the custom call replaced by a float64
emulation of its contract); the handler's shape checks and call plan (C++,
through the extension). On a GPU: the real handler against the CPU handler
within float32 accumulation error -- batched, shared and per-item b, per-item
amaxes, bfloat16 and float32 output, odd shapes, empty problems -- and its
errors."""

import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import on_cpu

from jax_nvfp4 import ops, reference
from jax_nvfp4.backends import blackwell, devices, hopper, library
from jax_nvfp4.format import e2m1_decode_table
from jax_nvfp4.ops import matmul as ops_matmul

BOTH = {"cuda": frozenset({hopper.TARGET, blackwell.TARGET})}
MIB32 = 32 * 1024 * 1024

# (batch, M, N, K, b batch, per-item a amax, per-item b amax): M and N odd or
# unaligned, K a multiple of 16. Together they cover the handler's three call
# plans: items stacked along M (one alpha, shared b), a strided batch (one
# alpha, b per item) and one call per item (one alpha per item).
CASES = [
    (1, 37, 53, 48, 1, False, False),
    (3, 29, 71, 80, 1, False, False),
    (3, 29, 71, 80, 3, False, False),
    (2, 33, 17, 64, 1, True, False),
    (4, 19, 45, 32, 4, True, True),
    (2, 128, 256, 256, 2, False, True),
]


def _device(platform, capability):
    return types.SimpleNamespace(platform=platform, compute_capability=capability)


def _operands(seed, batch, m, n, k, b_batch, a_per_item, b_per_item):
    """Random codes, non-negative E4M3 scale bytes (0x00-0x7E) and amaxes."""
    rng = np.random.default_rng(seed)

    def side(items, rows, per_item):
        codes = rng.integers(0, 256, (items, rows, k // 2), dtype=np.uint8)
        scales = rng.integers(0, 0x7F, (items, rows, k // 16), dtype=np.uint8)
        amax = rng.uniform(0.5, 40.0, items if per_item else 1).astype(np.float32)
        return (
            jnp.asarray(codes),
            jnp.asarray(scales).view(jnp.float8_e4m3fn),
            jnp.asarray(amax),
        )

    return (*side(batch, m, a_per_item), *side(b_batch, n, b_per_item))


def _decode64(codes, scales):
    """e2m1(code) * block scale in float64: [.., rows, K]."""
    codes = np.asarray(codes)
    nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(
        *codes.shape[:-1], -1
    )
    values = e2m1_decode_table().astype(np.float64)[nibbles]
    scales = np.asarray(scales).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return values * np.repeat(scales, 16, axis=-1)


def _alpha(a_amax, b_amax, batch):
    """alpha per item as the handlers compute it: float32 IEEE division in the
    spec's order, broadcast over the batch."""
    r = np.float32(2688.0)
    a = np.broadcast_to(np.asarray(a_amax, np.float32).reshape(-1), (batch,))
    b = np.broadcast_to(np.asarray(b_amax, np.float32).reshape(-1), (batch,))
    return (a / r) * (b / r)


def _exact(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax):
    """The spec in float64 (alpha as float32), and a bound on the error of any
    float32 accumulation order: 2 K 2^-24 sum_k |a b| alpha, with a margin,
    plus the rounding of alpha * acc to float32."""
    a = _decode64(a_codes, a_scales)
    b = _decode64(b_codes, b_scales)
    b = np.broadcast_to(b, (a.shape[0], *b.shape[1:]))
    alpha = _alpha(a_amax, b_amax, a.shape[0]).astype(np.float64)[:, None, None]
    exact = np.einsum("bmk,bnk->bmn", a, b) * alpha
    mag = np.einsum("bmk,bnk->bmn", np.abs(a), np.abs(b)) * alpha
    bound = 2 * a.shape[-1] * 2.0**-24 * mag * 1.01 + np.abs(exact) * 2.0**-23
    return exact, bound


def _assert_within(got, exact, bound, dtype):
    """float32: |got - exact| <= bound. bfloat16: got is the rounding of a
    float32 within the bound, so (rounding being monotonic) it lies between
    the roundings of exact - bound and exact + bound."""
    got = np.asarray(got).astype(np.float64)
    if np.dtype(dtype) == np.float32:
        assert np.all(np.abs(got - exact) <= bound)
        return

    def to_bf16(x):
        return x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)

    assert np.all(to_bf16(exact - bound) <= got)
    assert np.all(got <= to_bf16(exact + bound))


# --- dispatch ------------------------------------------------------------------


def test_gemm_path_by_capability_registration_and_switch(monkeypatch):
    registered = dict(BOTH)
    monkeypatch.setattr(library, "registered_targets", lambda: registered)
    path = ops_matmul.gemm_path
    assert path([_device("gpu", "10.0")]) == "native_fp4"
    assert path([_device("gpu", "12.0")]) == "native_fp4"
    assert path([_device("gpu", "9.0")]) == "cublaslt_bf16"
    assert path([_device("gpu", "8.0"), _device("gpu", "8.9")]) == "cublaslt_bf16"
    # Every device must qualify.
    assert path([_device("gpu", "10.0"), _device("gpu", "9.0")]) == "cublaslt_bf16"
    assert path([_device("gpu", "9.0"), _device("gpu", "7.5")]) == "xla_bf16"
    assert path([_device("gpu", "7.5")]) == "xla_bf16"
    assert path([_device("gpu", None)]) == "xla_bf16"  # e.g. ROCm
    assert path([_device("gpu", "gfx90a")]) == "xla_bf16"
    assert path(jax.devices("cpu")) == "xla_bf16"
    assert path([]) == "xla_bf16"  # lowering for "cuda" without a GPU
    # The switches, read at each decision.
    for off in ("0", "false", " OFF ", "no"):
        monkeypatch.setenv("JAX_NVFP4_CUBLASLT_GEMM", off)
        assert path([_device("gpu", "9.0")]) == "xla_bf16"
        assert path([_device("gpu", "10.0")]) == "native_fp4"
    monkeypatch.setenv("JAX_NVFP4_CUBLASLT_GEMM", "1")
    monkeypatch.setenv("JAX_NVFP4_NATIVE_GEMM", "0")
    assert path([_device("gpu", "10.0")]) == "cublaslt_bf16"
    monkeypatch.setenv("JAX_NVFP4_CUBLASLT_GEMM", "0")
    assert path([_device("gpu", "10.0")]) == "xla_bf16"
    monkeypatch.delenv("JAX_NVFP4_NATIVE_GEMM")
    monkeypatch.delenv("JAX_NVFP4_CUBLASLT_GEMM")
    # Handlers that were not built.
    registered["cuda"] = frozenset({hopper.TARGET})
    assert path([_device("gpu", "10.0")]) == "cublaslt_bf16"
    registered["cuda"] = frozenset({blackwell.TARGET})
    assert path([_device("gpu", "9.0")]) == "xla_bf16"
    del registered["cuda"]
    assert path([_device("gpu", "9.0")]) == "xla_bf16"
    assert not hopper.cublaslt_gemm_supported([_device("gpu", "9.0")])


def test_gemm_path_defaults_to_the_cuda_backend(monkeypatch):
    monkeypatch.setattr(library, "registered_targets", lambda: BOTH)
    monkeypatch.setattr(devices, "cuda_devices", lambda: ())
    assert ops_matmul.gemm_path() == "xla_bf16"
    monkeypatch.setattr(devices, "cuda_devices", lambda: (_device("gpu", "9.0"),))
    assert ops_matmul.gemm_path() == "cublaslt_bf16"
    assert hopper.cublaslt_gemm_supported()


@pytest.mark.parametrize("decoded", [False, True])
@pytest.mark.parametrize("path", ["native_fp4", "cublaslt_bf16", "xla_bf16"])
def test_matmul_cuda_calls_the_chosen_gemm(monkeypatch, path, decoded):
    """Each path's GEMM gets the operands; a decoded operand (bf16 values,
    not codes) takes the bf16 GEMM on Blackwell too."""
    called = []

    def fake(name):
        def fn(*args, dtype, **options):
            called.append((name, len(args), np.dtype(dtype), options))
            return name

        return fn

    monkeypatch.setattr(ops_matmul, "gemm_path", lambda: path)
    monkeypatch.setattr(blackwell, "matmul_native", fake("native_fp4"))
    monkeypatch.setattr(hopper, "matmul_bf16", fake("cublaslt_bf16"))
    monkeypatch.setattr(reference, "matmul_dequantize_bf16", fake("xla_bf16"))
    chosen = "cublaslt_bf16" if path == "native_fp4" and decoded else path
    args = [np.zeros(1, np.uint8)] * 6
    if decoded:  # b's codes hold its bfloat16 values
        args[3] = np.zeros(2, jnp.bfloat16)
    assert ops_matmul.matmul_cuda(*args, dtype=jnp.float32) == chosen
    cuda = library.registered_targets().get("cuda", frozenset())
    options = {
        "native_fp4": {},
        "cublaslt_bf16": {"decode_handler": hopper.DECODE_TARGET in cuda},
        "xla_bf16": {},
    }[chosen]
    assert called == [(chosen, 6, np.dtype(np.float32), options)]


def test_matmul_cuda_without_a_gpu_is_xla_bf16_gemm(monkeypatch):
    monkeypatch.setattr(devices, "cuda_devices", lambda: ())
    args = _operands(1, *CASES[3])
    got = jax.jit(functools.partial(ops_matmul.matmul_cuda, dtype=jnp.float32))(*args)
    want = jax.jit(
        functools.partial(reference.matmul_dequantize_bf16, dtype=jnp.float32)
    )(*args)
    np.testing.assert_array_equal(got, want)


def _lowered_for_cuda(args, dtype):
    """StableHLO text of the matmul primitive lowered for "cuda" (a fresh jit,
    so that nothing is reused from an earlier lowering)."""

    def f(*xs):
        return ops.matmul(*xs, dtype=dtype)

    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _custom_calls(text):
    return [line for line in text.splitlines() if "stablehlo.custom_call" in line]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("case", [CASES[1], CASES[4]])
def test_lowers_to_one_handler_call_on_hopper(monkeypatch, case, dtype):
    monkeypatch.setattr(library, "registered_targets", lambda: BOTH)
    monkeypatch.setattr(devices, "cuda_devices", lambda: (_device("gpu", "9.0"),))
    monkeypatch.delenv("JAX_NVFP4_GEMM_GRAPHS", raising=False)
    batch, m, n, k, b_batch, a_per_item, b_per_item = case
    args = _operands(2, *case)
    # JAX_NVFP4_GEMM_GRAPHS=0: the same handler, kept out of CUDA graphs.
    monkeypatch.setenv("JAX_NVFP4_GEMM_GRAPHS", "0")
    calls = _custom_calls(_lowered_for_cuda(args, dtype))
    assert len(calls) == 1 and f"@{hopper.TARGET}(" in calls[0], calls
    monkeypatch.delenv("JAX_NVFP4_GEMM_GRAPHS")
    text = _lowered_for_cuda(args, dtype)
    calls = _custom_calls(text)
    assert len(calls) == 1 and f"@{hopper.GRAPH_TARGET}(" in calls[0], calls
    out = "bf16" if dtype == jnp.bfloat16 else "f32"
    ws = hopper.workspace_bytes(batch)
    a_n, b_n = (batch if a_per_item else 1), (b_batch if b_per_item else 1)
    assert (
        f"(tensor<{batch}x{m}x{k}xbf16>, tensor<{b_batch}x{n}x{k}xbf16>, "
        f"tensor<{a_n}xf32>, tensor<{b_n}xf32>) -> "
        f"(tensor<{batch}x{m}x{n}x{out}>, tensor<{ws}xui8>)"
    ) in calls[0]
    assert "dot_general" not in text  # the GEMM is the handler's
    # Switched off: XLA's GEMM, no custom call.
    monkeypatch.setenv("JAX_NVFP4_CUBLASLT_GEMM", "0")
    text = _lowered_for_cuda(args, dtype)
    assert not _custom_calls(text) and "dot_general" in text


def test_hopper_lowering_decodes_with_the_handler_when_built(monkeypatch):
    """With jax_nvfp4_decode_bf16 built, the two operand decodes are its custom
    calls (bf16 out, the codes' shape with K doubled) ahead of the GEMM's."""
    targets = {"cuda": BOTH["cuda"] | {hopper.DECODE_TARGET}}
    monkeypatch.setattr(library, "registered_targets", lambda: targets)
    monkeypatch.setattr(devices, "cuda_devices", lambda: (_device("gpu", "9.0"),))
    batch, m, n, k, b_batch, _, _ = CASES[1]
    calls = _custom_calls(_lowered_for_cuda(_operands(2, *CASES[1]), jnp.bfloat16))
    assert len(calls) == 3, calls
    decodes = [c for c in calls if f"@{hopper.DECODE_TARGET}(" in c]
    assert len(decodes) == 2 and f"@{hopper.GRAPH_TARGET}(" in calls[2]
    assert f"-> tensor<{batch}x{m}x{k}xbf16>" in decodes[0]
    assert f"-> tensor<{b_batch}x{n}x{k}xbf16>" in decodes[1]


def test_decode_bf16_cuda_checks_shapes():
    codes = jnp.zeros((2, 4, 8), jnp.uint8)
    with pytest.raises(ValueError, match="scales"):
        hopper.decode_bf16_cuda(codes, jnp.zeros((2, 4, 2), jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="multiple of 16"):
        hopper.decode_bf16_cuda(
            jnp.zeros((2, 4, 4), jnp.uint8), jnp.zeros((2, 4, 0), jnp.float8_e4m3fn)
        )


def test_lowering_without_a_gpu_keeps_xla_gemm(monkeypatch):
    monkeypatch.setattr(library, "registered_targets", lambda: BOTH)
    monkeypatch.setattr(devices, "cuda_devices", lambda: ())
    text = _lowered_for_cuda(_operands(3, *CASES[0]), jnp.bfloat16)
    assert not _custom_calls(text) and "dot_general" in text


# --- the operands handed to the handler ------------------------------------------


def test_decode_bf16_is_exact():
    """Every code with every finite scale byte, both signs."""
    codes = np.arange(256, dtype=np.uint8)
    scale_bytes = np.array(
        [s for s in range(256) if s & 0x7F != 0x7F], np.uint8
    )  # all but the NaNs
    grid_codes = np.broadcast_to(codes[None, :, None], (len(scale_bytes), 256, 8))
    grid_scales = np.broadcast_to(
        scale_bytes[:, None, None], (len(scale_bytes), 256, 1)
    )
    got = hopper.decode_bf16(
        jnp.asarray(grid_codes), jnp.asarray(grid_scales).view(jnp.float8_e4m3fn)
    )
    assert got.dtype == jnp.bfloat16 and got.shape == (len(scale_bytes), 256, 16)
    want = _decode64(grid_codes, grid_scales)
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "codes_shape", [(256, 256, 8), (3, 5, 24), (1, 7, 8), (2, 1, 4104)]
)
def test_decode_bf16_cuda_matches_twin(codes_shape):
    """The CUDA decode handler == the pure-JAX decode_bf16, bit for bit: every
    code byte with every scale byte (NaN bytes: NaN in both), then random
    codes and scales in shapes whose element count is no multiple of the
    kernel's 8 x 256 x 4 elements per CTA step."""
    assert hopper.DECODE_TARGET in library.registered_targets()["cuda"]
    if codes_shape == (256, 256, 8):
        codes = np.broadcast_to(
            np.arange(256, dtype=np.uint8)[None, :, None], codes_shape
        )
        scales = np.broadcast_to(
            np.arange(256, dtype=np.uint8)[:, None, None], (256, 256, 1)
        )
    else:
        rng = np.random.default_rng(sum(codes_shape))
        codes = rng.integers(0, 256, codes_shape, dtype=np.uint8)
        scales = rng.integers(0, 256, (*codes_shape[:-1], codes_shape[-1] // 8))
        scales = scales.astype(np.uint8)
    codes = jnp.asarray(codes)
    scales = jnp.asarray(scales).view(jnp.float8_e4m3fn)
    got = np.asarray(jax.jit(hopper.decode_bf16_cuda)(codes, scales))
    want = np.asarray(jax.jit(hopper.decode_bf16)(codes, scales))
    assert got.dtype == want.dtype == jnp.bfloat16 and got.shape == want.shape
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


def _emulated_handler(a, b, a_amax, b_amax, dtype):
    """What jax_nvfp4_matmul_bf16 computes from exactly its operands, in
    float64, rounded as the handler rounds: alpha * acc to float32, then to
    dtype. Checks the operands against the handler's binding."""
    batch, m, k = a.shape
    b_batch, n, _ = b.shape
    assert a.dtype == b.dtype == jnp.bfloat16 and b.shape[2] == k
    assert b_batch in (1, batch)
    assert a_amax.dtype == b_amax.dtype == jnp.float32
    assert a_amax.shape in ((1,), (batch,)) and b_amax.shape in ((1,), (b_batch,))

    def compute(a, b, a_amax, b_amax):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        alpha = _alpha(a_amax, b_amax, batch).astype(np.float64)[:, None, None]
        b = np.broadcast_to(b, (batch, n, k))
        acc = np.einsum("bmk,bnk->bmn", a, b)
        return (acc * alpha).astype(np.float32).astype(dtype)

    shape = jax.ShapeDtypeStruct((batch, m, n), dtype)
    return jax.pure_callback(
        compute, shape, a, b, a_amax, b_amax, vmap_method="sequential"
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("case", CASES[1:5])
def test_matmul_bf16_hands_the_handler_its_operands(monkeypatch, case, dtype):
    monkeypatch.setattr(hopper, "_call_handler", _emulated_handler)
    args = _operands(4, *case)
    got = jax.jit(functools.partial(hopper.matmul_bf16, dtype=dtype))(*args)
    exact, bound = _exact(*args)
    assert got.shape == exact.shape and got.dtype == dtype
    _assert_within(got, exact, bound, dtype)
    want = on_cpu(ops.matmul, *args, dtype=jnp.float32)  # the CPU handler
    _assert_within(want, exact, bound, jnp.float32)


def test_matmul_bf16_skips_empty_problems(monkeypatch):
    def fail(*args):
        raise AssertionError("the handler must not be called")

    monkeypatch.setattr(hopper, "_call_handler", fail)
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax = _operands(5, *CASES[3])
    out = hopper.matmul_bf16(
        a_codes[:, :0], a_scales[:, :0], a_amax, b_codes, b_scales, b_amax,
        dtype=jnp.float32,
    )  # fmt: skip
    assert out.shape == (2, 0, 17)
    out = hopper.matmul_bf16(
        a_codes, a_scales, a_amax, b_codes[:, :0], b_scales[:, :0], b_amax,
        dtype=jnp.bfloat16,
    )  # fmt: skip
    assert out.shape == (2, 33, 0)
    out = hopper.matmul_bf16(
        a_codes[..., :0], a_scales[..., :0], a_amax,
        b_codes[..., :0], b_scales[..., :0], b_amax, dtype=jnp.bfloat16,
    )  # fmt: skip
    assert out.shape == (2, 33, 17) and out.dtype == jnp.bfloat16
    assert not np.asarray(out, np.float32).any()


def test_matmul_bf16_errors_say_what_to_change():
    args = _operands(6, *CASES[4])
    with pytest.raises(TypeError, match="dtype must be bfloat16 or float32"):
        hopper.matmul_bf16(*args, dtype=jnp.float16)
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax = args
    with pytest.raises(ValueError, match="both must be the same multiple of 16"):
        hopper.matmul_bf16(
            a_codes, a_scales, a_amax, b_codes[..., :8], b_scales[..., :1], b_amax,
            dtype=jnp.float32,
        )  # fmt: skip
    with pytest.raises(ValueError, match="b_amax must have 1 or 4"):
        hopper.matmul_bf16(
            a_codes, a_scales, a_amax, b_codes, b_scales, b_amax[:2],
            dtype=jnp.float32,
        )  # fmt: skip


# --- the handler's checks and call plan (C++) -----------------------------------


def _plan_bf16_gemm():
    ffi = pytest.importorskip("jax_nvfp4._ffi")
    plan = getattr(ffi, "plan_bf16_gemm", None)
    if plan is None:
        pytest.skip("the built extension predates plan_bf16_gemm; rebuild it")
    return plan


@pytest.mark.parametrize(
    "b_batch, a_amax, b_amax, calls, call_batch, call_m",
    [
        (1, 1, 1, 1, 1, 3 * 29),  # one alpha, shared b: stacked along M
        (3, 1, 1, 1, 3, 29),  # one alpha, b per item: a strided batch
        (1, 3, 1, 3, 1, 29),  # one alpha per item: one call per item
        (3, 1, 3, 3, 1, 29),
        (3, 3, 3, 3, 1, 29),
    ],
)
def test_handler_call_plan(b_batch, a_amax, b_amax, calls, call_batch, call_m):
    batch, m, n, k = 3, 29, 71, 80
    plan = _plan_bf16_gemm()(
        a=[batch, m, k],
        b=[b_batch, n, k],
        a_amax=[a_amax],
        b_amax=[b_amax],
        out=[batch, m, n],
        workspace=[hopper.workspace_bytes(batch)],
    )
    assert plan == {
        "batch": batch,
        "m": m,
        "n": n,
        "k": k,
        "a_stride": m * k,
        "b_stride": 0 if b_batch == 1 else n * k,
        "out_stride": m * n,
        "a_amax_stride": int(a_amax != 1),
        "b_amax_stride": int(b_amax != 1),
        "alphas": 1 if a_amax == b_amax == 1 else batch,
        "calls": calls,
        "call_batch": call_batch,
        "call_m": call_m,
        "workspace_head_bytes": 256,
        "workspace_bytes": MIB32,
    }


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(a=[2, 16]), "rank 3"),
        (dict(a_amax=[1, 2]), "rank 1"),
        (dict(b=[1, 48, 48]), "same K"),
        (dict(b=[3, 48, 32]), "b's batch"),
        (dict(a_amax=[3]), "each amax"),
        (dict(b_amax=[2]), "each amax"),
        (dict(out=[2, 16, 47]), "out must be"),
        (dict(workspace=[8]), "at least 256 bytes"),
        (dict(a=[1, 2**31, 32], a_amax=[1], out=[1, 2**31, 48]), "below 2\\^31"),
        # Stacking 4 items of 2^30 rows along M would pass 2^31.
        (dict(a=[4, 2**30, 32], a_amax=[1], out=[4, 2**30, 48]), "below 2\\^31"),
    ],
)
def test_handler_rejects_inconsistent_shapes(change, message):
    good = dict(
        a=[2, 16, 32],
        b=[1, 48, 32],
        a_amax=[2],
        b_amax=[1],
        out=[2, 16, 48],
        workspace=[4096],
    )
    plan_bf16_gemm = _plan_bf16_gemm()
    plan_bf16_gemm(**good)
    with pytest.raises(ValueError, match=message):
        plan_bf16_gemm(**{**good, **change})


def test_handler_stacks_items_only_within_int32():
    """4 items of 2^30 rows with one alpha each are 4 calls, not one of 2^32."""
    plan = _plan_bf16_gemm()(
        a=[4, 2**30, 32],
        b=[1, 48, 32],
        a_amax=[4],
        b_amax=[1],
        out=[4, 2**30, 48],
        workspace=[4096],
    )
    assert (plan["calls"], plan["call_batch"], plan["call_m"]) == (4, 1, 2**30)


# --- on a GPU --------------------------------------------------------------------


def _bf16_gemm_gpu():
    """The first GPU if the handler can run there (else the test skips)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus or not hopper.cublaslt_gemm_supported(gpus):
        pytest.skip("needs a CUDA GPU of compute capability >= 8.0 with the "
                    "jax_nvfp4_matmul_bf16 handler built")  # fmt: skip
    return gpus[0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("case", CASES)
def test_handler_matches_cpu_handler(case, dtype):
    gpu = _bf16_gemm_gpu()
    args = _operands(7, *case)
    on_gpu = [jax.device_put(x, gpu) for x in args]
    got = jax.jit(functools.partial(hopper.matmul_bf16, dtype=dtype))(*on_gpu)
    exact, bound = _exact(*args)
    assert got.shape == exact.shape and got.dtype == dtype
    _assert_within(got, exact, bound, dtype)
    want = on_cpu(ops.matmul, *args, dtype=jnp.float32)  # the CPU handler
    _assert_within(want, exact, bound, jnp.float32)
    # Run again: the cached algorithm gives the same bytes.
    again = jax.jit(functools.partial(hopper.matmul_bf16, dtype=dtype))(*on_gpu)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(got))


@pytest.mark.gpu
def test_primitive_lowers_to_the_handler_on_gpu(monkeypatch):
    gpu = _bf16_gemm_gpu()
    if ops_matmul.gemm_path([gpu]) != "cublaslt_bf16":
        pytest.skip("this GPU uses another GEMM (e.g. native FP4)")
    args = [jax.device_put(x, gpu) for x in _operands(8, *CASES[4])]

    def f(*xs):
        return ops.matmul(*xs, dtype=jnp.bfloat16)

    text = jax.jit(f).lower(*args).as_text()
    assert f"@{hopper.GRAPH_TARGET}(" in text  # the graph-safe default
    got = jax.jit(f)(*args)
    monkeypatch.setenv("JAX_NVFP4_CUBLASLT_GEMM", "0")

    def g(*xs):  # a new function: lowered anew, with the switch off
        return ops.matmul(*xs, dtype=jnp.bfloat16)

    assert hopper.TARGET not in jax.jit(g).lower(*args).as_text()
    exact, bound = _exact(*_operands(8, *CASES[4]))
    _assert_within(got, exact, bound, jnp.bfloat16)
    _assert_within(jax.jit(g)(*args), exact, bound, jnp.bfloat16)


def _raw_call(a, b, a_amax, b_amax, out_shape, dtype=jnp.float32):
    """The custom call with operands and result shapes as given."""
    out, _ = jax.ffi.ffi_call(
        hopper.TARGET,
        (
            jax.ShapeDtypeStruct(out_shape, dtype),
            jax.ShapeDtypeStruct((hopper.workspace_bytes(a.shape[0]),), jnp.uint8),
        ),
    )(a, b, a_amax, b_amax)
    return out


@pytest.mark.gpu
def test_handler_on_empty_problems():
    gpu = _bf16_gemm_gpu()
    with jax.default_device(gpu):
        amax = jnp.ones(1, jnp.float32)
        zero_k = jax.jit(_raw_call, static_argnums=(4,))(
            jnp.ones((2, 5, 0), jnp.bfloat16),
            jnp.ones((1, 7, 0), jnp.bfloat16),
            amax,
            amax,
            (2, 5, 7),
        )
        assert zero_k.shape == (2, 5, 7) and not np.asarray(zero_k).any()
        zero_m = jax.jit(_raw_call, static_argnums=(4,))(
            jnp.ones((2, 0, 16), jnp.bfloat16),
            jnp.ones((1, 7, 16), jnp.bfloat16),
            amax,
            amax,
            (2, 0, 7),
        )
        assert zero_m.shape == (2, 0, 7)
        args = [
            jax.device_put(x, gpu) for x in _operands(9, 2, 0, 7, 16, 1, False, False)
        ]
        out = jax.jit(functools.partial(hopper.matmul_bf16, dtype=jnp.bfloat16))(*args)
        assert out.shape == (2, 0, 7)


@pytest.mark.gpu
def test_handler_rejects_inconsistent_shapes_on_gpu():
    gpu = _bf16_gemm_gpu()
    with jax.default_device(gpu):
        a = jnp.ones((2, 5, 16), jnp.bfloat16)
        b = jnp.ones((1, 7, 16), jnp.bfloat16)
        amax = jnp.ones(1, jnp.float32)
        with pytest.raises(Exception, match=r"jax_nvfp4 \(matmul_bf16\): out must"):
            call = jax.jit(_raw_call, static_argnums=(4,))
            jax.block_until_ready(call(a, b, amax, amax, (2, 5, 8)))
        with pytest.raises(Exception, match=r"jax_nvfp4 \(matmul_bf16\): each amax"):
            call = jax.jit(_raw_call, static_argnums=(4,))
            jax.block_until_ready(call(a, b, jnp.ones(3, jnp.float32), amax, (2, 5, 7)))


# Run in a fresh process, with XLA putting even a single custom call into a
# command buffer. Phase 1: first calls (XLA may run the handler once outside
# the capture before it records the graph, so cuBLASLt's setup can happen
# there). Phase 2: the handler forgets its
# handles and algorithms, and new operands (new addresses) make XLA capture
# the handler again: the setup then runs inside the capture
# (CaptureSafeSetup).
_CAPTURE_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import jax, jax.numpy as jnp, numpy as np
import test_cuda_gemm as t
from jax_nvfp4 import _ffi
from jax_nvfp4.backends import hopper

gpu = jax.devices("gpu")[0]
f = jax.jit(lambda *xs: hopper.matmul_bf16(*xs, dtype=jnp.float32))
results, alive = [], []  # phase 1's operands stay alive: new addresses below
for seed, case in enumerate(t.CASES[:3]):
    args = t._operands(20 + seed, *case)
    on_gpu = [jax.device_put(x, gpu) for x in args]
    alive.append(on_gpu)
    first = np.asarray(f(*on_gpu))
    again = np.asarray(f(*on_gpu))  # replayed
    exact, bound = t._exact(*args)
    t._assert_within(first, exact, bound, jnp.float32)
    results.append(bool(np.array_equal(first, again)))
phase1 = _ffi.gemm_capture_counts()
_ffi.forget_gemm_setup()
for seed, case in enumerate(t.CASES[:3]):
    args = t._operands(40 + seed, *case)
    got = np.asarray(f(*[jax.device_put(x, gpu) for x in args]))
    exact, bound = t._exact(*args)
    t._assert_within(got, exact, bound, jnp.float32)
print(json.dumps({{"replay_equal": results, "phase1": phase1,
                  "phase2": _ffi.gemm_capture_counts()}}))
"""


@pytest.mark.gpu
def test_handler_runs_inside_cuda_graph_capture():
    gpu = _bf16_gemm_gpu()
    if ops_matmul.gemm_path([gpu]) != "cublaslt_bf16":
        pytest.skip("this GPU uses another GEMM (e.g. native FP4)")
    env = dict(os.environ)
    env.pop("JAX_NVFP4_GEMM_GRAPHS", None)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_gpu_graph_min_graph_size=1"
    ).strip()
    script = _CAPTURE_SCRIPT.format(tests=str(pathlib.Path(__file__).parent))
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tempfile.gettempdir(),  # the installed package, not the tree
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["replay_equal"] == [True] * 3, data
    # Phase 1: the handler ran while XLA captured its graph, and the graph's
    # replay gave the same results.
    assert data["phase1"]["captured_calls"] >= 3, data
    # Phase 2: re-captured for new operands after forgetting its setup, the
    # handler created its handle and ran the heuristic inside the capture,
    # and its results were right (asserted in the script).
    new_setups = data["phase2"]["captured_setups"] - data["phase1"]["captured_setups"]
    assert new_setups >= 1, (
        "XLA did not capture the GEMM again for new operands, so the setup "
        f"inside a capture was not exercised: {data}"
    )
