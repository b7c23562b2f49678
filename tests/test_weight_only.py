"""The weight-only GEMM of serving (W4A16): ``matmul(x_bf16, w_nvfp4)``.

Operands built so that every float32 sum is exact (integer activations, scales
1 or 2) make results that may differ only in summation order bit-identical:
the CUDA handler, the cuBLASLt path and XLA's twin must then agree exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import has_gpu

import jax_nvfp4 as nv
from jax_nvfp4 import reference
from jax_nvfp4.backends import bf16_gemm, library, w4a16_gemm
from jax_nvfp4.format import NVFP4Tensor

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


needs_handler = pytest.mark.skipif(
    not (has_gpu() and w4a16_gemm.handler_supported(256, 2)),
    reason="needs the CUDA W4A16 handler on a GPU",
)


def _paths(x, w, dtype):
    n, k = w.stored_shape
    args = (x, w.codes, w.scales, w.amax, dtype)
    out = {"xla": w4a16_gemm.matmul_w4a16(*args, path="xla")}
    out["handler"] = jax.jit(
        lambda *a: w4a16_gemm.matmul_w4a16(*a, path="handler"), static_argnums=4
    )(*args)
    if bf16_gemm.cublaslt_gemm_supported():
        out["cublaslt"] = w4a16_gemm.matmul_w4a16(*args, path="cublaslt")
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
    args = (x, w.codes, w.scales, w.amax, jnp.float32)
    call = jax.jit(
        lambda *a: w4a16_gemm.matmul_w4a16(*a, path="handler"), static_argnums=4
    )
    first = np.asarray(call(*args))
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(call(*args)), first)


@needs_handler
@pytest.mark.gpu
def test_matmul_dispatch_on_gpu():
    """Few rows take the handler, many the cuBLASLt path, K off 128 the
    cuBLASLt path: all equal the exact sums."""
    for m, k in [(8, 256), (w4a16_gemm.MAX_HANDLER_ROWS + 16, 256), (8, 80)]:
        w = _exact_weight(64, k, seed=k)
        x = _integers((m, k), seed=m)
        got = jax.jit(lambda x, w: nv.matmul(x, w, out_dtype=jnp.float32))(x, w)
        want = _oracle(x, w, jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
