"""The cuBLASLt bf16 GEMM handler with alpha in the epilogue
(jax_nvfp4.backends.bf16_gemm).

On CPU: the exact bf16 decode; the operands handed to the handler (with the
custom call replaced by a float64 emulation of its contract); the workspace
against the handler's plan (C++, through jax_nvfp4._ffi_testing; the plan's
own tests are in tests/cpp). On a GPU: the real
handler against the CPU handler within float32 accumulation error -- batched,
shared and per-item b, per-item amaxes, bfloat16 and float32 output, odd
shapes, empty problems -- its errors, and its capture into CUDA graphs."""

import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import on_cpu
from gemm_cases import (
    CASES,
    MIB32,
    alpha64,
    assert_within,
    decode64,
    exact_result,
    random_operands,
)

from jax_nvfp4 import config, ops
from jax_nvfp4.backends import bf16_gemm, library
from jax_nvfp4.ops import dispatch

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
    got = bf16_gemm.decode_bf16(
        jnp.asarray(grid_codes), jnp.asarray(grid_scales).view(jnp.float8_e4m3fn)
    )
    assert got.dtype == jnp.bfloat16 and got.shape == (len(scale_bytes), 256, 16)
    want = decode64(grid_codes, grid_scales)
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
    assert bf16_gemm.DECODE_TARGET in library.registered_targets()["cuda"]
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
    got = np.asarray(jax.jit(bf16_gemm.decode_bf16_cuda)(codes, scales))
    want = np.asarray(jax.jit(bf16_gemm.decode_bf16)(codes, scales))
    assert got.dtype == want.dtype == jnp.bfloat16 and got.shape == want.shape
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


def _emulated_handler(a, b, a_amax, b_amax, dtype, *, graphs=True):
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
        alpha = alpha64(a_amax, b_amax, batch).astype(np.float64)[:, None, None]
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
    monkeypatch.setattr(bf16_gemm, "matmul_values", _emulated_handler)
    args = random_operands(4, *case)
    got = jax.jit(functools.partial(bf16_gemm.matmul_bf16, dtype=dtype))(*args)
    exact, bound = exact_result(*args)
    assert got.shape == exact.shape and got.dtype == dtype
    assert_within(got, exact, bound, dtype)
    want = on_cpu(ops.matmul, *args, dtype=jnp.float32)  # the CPU handler
    assert_within(want, exact, bound, jnp.float32)


def test_matmul_bf16_skips_empty_problems(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the handler must not be called")

    monkeypatch.setattr(bf16_gemm, "matmul_values", fail)
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax = random_operands(5, *CASES[3])
    out = bf16_gemm.matmul_bf16(
        a_codes[:, :0], a_scales[:, :0], a_amax, b_codes, b_scales, b_amax,
        dtype=jnp.float32,
    )  # fmt: skip
    assert out.shape == (2, 0, 17)
    out = bf16_gemm.matmul_bf16(
        a_codes, a_scales, a_amax, b_codes[:, :0], b_scales[:, :0], b_amax,
        dtype=jnp.bfloat16,
    )  # fmt: skip
    assert out.shape == (2, 33, 0)
    out = bf16_gemm.matmul_bf16(
        a_codes[..., :0], a_scales[..., :0], a_amax,
        b_codes[..., :0], b_scales[..., :0], b_amax, dtype=jnp.bfloat16,
    )  # fmt: skip
    assert out.shape == (2, 33, 17) and out.dtype == jnp.bfloat16
    assert not np.asarray(out, np.float32).any()


def test_matmul_bf16_errors_say_what_to_change():
    args = random_operands(6, *CASES[4])
    with pytest.raises(TypeError, match="dtype must be bfloat16 or float32"):
        bf16_gemm.matmul_bf16(*args, dtype=jnp.float16)
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax = args
    with pytest.raises(ValueError, match="both must be the same multiple of 16"):
        bf16_gemm.matmul_bf16(
            a_codes, a_scales, a_amax, b_codes[..., :8], b_scales[..., :1], b_amax,
            dtype=jnp.float32,
        )  # fmt: skip
    with pytest.raises(ValueError, match="b_amax must have 1 or 4"):
        bf16_gemm.matmul_bf16(
            a_codes, a_scales, a_amax, b_codes, b_scales, b_amax[:2],
            dtype=jnp.float32,
        )  # fmt: skip


# --- the workspace Python allocates, against the handler's plan (C++) -----------


@pytest.mark.parametrize("batch", [1, 3, 63, 64, 200])
def test_workspace_is_what_the_handler_plans(batch):
    """bf16_gemm.workspace_bytes(batch) is the head the handler writes beta and
    the alphas to, to the byte, then cuBLASLt's part (the plan itself is
    tested in tests/cpp)."""
    plan_bf16_gemm = pytest.importorskip("jax_nvfp4._ffi_testing").plan_bf16_gemm
    shapes = dict(
        a=[batch, 16, 32],
        b=[1, 48, 32],
        a_amax=[batch],
        b_amax=[1],
        out=[batch, 16, 48],
    )
    plan = plan_bf16_gemm(**shapes, workspace=[bf16_gemm.workspace_bytes(batch)])
    assert plan["workspace_bytes"] == MIB32
    head = bf16_gemm.workspace_bytes(batch) - MIB32
    assert plan["workspace_head_bytes"] == head
    plan_bf16_gemm(**shapes, workspace=[head])
    with pytest.raises(ValueError, match=f"at least {head} bytes"):
        plan_bf16_gemm(**shapes, workspace=[head - 1])


# --- on a GPU --------------------------------------------------------------------


def _bf16_gemm_gpu():
    """The first GPU if the handler can run there (else the test skips)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus or not bf16_gemm.cublaslt_gemm_supported(gpus):
        pytest.skip("needs a CUDA GPU of compute capability >= 8.0 with the "
                    "jax_nvfp4_matmul_bf16 handler built")  # fmt: skip
    return gpus[0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("case", CASES)
def test_handler_matches_cpu_handler(case, dtype):
    gpu = _bf16_gemm_gpu()
    args = random_operands(7, *case)
    on_gpu = [jax.device_put(x, gpu) for x in args]
    got = jax.jit(functools.partial(bf16_gemm.matmul_bf16, dtype=dtype))(*on_gpu)
    exact, bound = exact_result(*args)
    assert got.shape == exact.shape and got.dtype == dtype
    assert_within(got, exact, bound, dtype)
    want = on_cpu(ops.matmul, *args, dtype=jnp.float32)  # the CPU handler
    assert_within(want, exact, bound, jnp.float32)
    # Run again: the cached algorithm gives the same bytes.
    again = jax.jit(functools.partial(bf16_gemm.matmul_bf16, dtype=dtype))(*on_gpu)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(got))


@pytest.mark.gpu
def test_primitive_lowers_to_the_handler_on_gpu(monkeypatch):
    gpu = _bf16_gemm_gpu()
    if dispatch.dense_path([gpu]) != "cublaslt_bf16":
        pytest.skip("this GPU uses another GEMM (e.g. native FP4)")
    args = [jax.device_put(x, gpu) for x in random_operands(8, *CASES[4])]

    def f(*xs):
        return ops.matmul(*xs, dtype=jnp.bfloat16)

    text = jax.jit(f).lower(*args).as_text()
    assert f"@{bf16_gemm.GRAPH_TARGET}(" in text  # the graph-safe default
    got = jax.jit(f)(*args)
    with config.override(cublaslt_gemm=False):  # the same function, lowered anew
        assert bf16_gemm.TARGET not in jax.jit(f).lower(*args).as_text()
        xla = jax.jit(f)(*args)
    exact, bound = exact_result(*random_operands(8, *CASES[4]))
    assert_within(got, exact, bound, jnp.bfloat16)
    assert_within(xla, exact, bound, jnp.bfloat16)


def _raw_call(a, b, a_amax, b_amax, out_shape, dtype=jnp.float32):
    """The custom call with operands and result shapes as given."""
    out, _ = jax.ffi.ffi_call(
        bf16_gemm.TARGET,
        (
            jax.ShapeDtypeStruct(out_shape, dtype),
            jax.ShapeDtypeStruct((bf16_gemm.workspace_bytes(a.shape[0]),), jnp.uint8),
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
            jax.device_put(x, gpu)
            for x in random_operands(9, 2, 0, 7, 16, 1, False, False)
        ]
        gemm = functools.partial(bf16_gemm.matmul_bf16, dtype=jnp.bfloat16)
        out = jax.jit(gemm)(*args)
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
import gemm_cases as t
from jax_nvfp4 import _ffi_testing
from jax_nvfp4.backends import bf16_gemm

gpu = jax.devices("gpu")[0]
f = jax.jit(lambda *xs: bf16_gemm.matmul_bf16(*xs, dtype=jnp.float32))
results, alive = [], []  # phase 1's operands stay alive: new addresses below
for seed, case in enumerate(t.CASES[:3]):
    args = t.random_operands(20 + seed, *case)
    on_gpu = [jax.device_put(x, gpu) for x in args]
    alive.append(on_gpu)
    first = np.asarray(f(*on_gpu))
    again = np.asarray(f(*on_gpu))  # replayed
    exact, bound = t.exact_result(*args)
    t.assert_within(first, exact, bound, jnp.float32)
    results.append(bool(np.array_equal(first, again)))
phase1 = _ffi_testing.gemm_capture_counts()
_ffi_testing.forget_gemm_setup()
for seed, case in enumerate(t.CASES[:3]):
    args = t.random_operands(40 + seed, *case)
    got = np.asarray(f(*[jax.device_put(x, gpu) for x in args]))
    exact, bound = t.exact_result(*args)
    t.assert_within(got, exact, bound, jnp.float32)
print(json.dumps({{"replay_equal": results, "phase1": phase1,
                  "phase2": _ffi_testing.gemm_capture_counts()}}))
"""


@pytest.mark.gpu
def test_handler_runs_inside_cuda_graph_capture():
    gpu = _bf16_gemm_gpu()
    if dispatch.dense_path([gpu]) != "cublaslt_bf16":
        pytest.skip("this GPU uses another GEMM (e.g. native FP4)")
    env = dict(os.environ)
    env.pop("JAX_NVFP4_GEMM_GRAPHS", None)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_gpu_graph_min_graph_size=1"
    ).strip()
    script = _CAPTURE_SCRIPT.format(tests=str(pathlib.Path(__file__).parents[1]))
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
