"""Block-scaled FP4 GEMM: the handler (and the GPU's bf16-decode path) against
the reference, within float32 accumulation-order error."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import on_cpu, outlier_data

import jax_nvfp4 as nv


def _accumulation_bound(a, b):
    """|sum order A - sum order B| <= 2 * K * 2^-24 * sum_k |a_k b_k| * alpha."""
    da = np.abs(np.asarray(nv.dequantize(a, jnp.float32), np.float64))
    db = np.abs(np.asarray(nv.dequantize(b, jnp.float32), np.float64))
    k = da.shape[-1]
    return 2 * k * 2.0**-24 * (da.reshape(-1, k) @ db.reshape(k, -1))


@pytest.mark.parametrize("shape", [(32, 64, 48), (7, 3, 16, 32)])
def test_matmul_matches_reference(shape):
    *lead, m, k = shape[:-1] if len(shape) == 3 else shape[:-1]
    n = shape[-1]
    x = outlier_data(0, (*shape[:-1],), jnp.bfloat16)
    w = outlier_data(1, (shape[-2], n), jnp.bfloat16)
    a = nv.quantize(x)  # [..., M, K] along K
    b = nv.quantize(w, axis=0, block="16x16")  # [K, N] along K
    got = jax.jit(functools.partial(nv.matmul, out_dtype=jnp.float32))(a, b)
    want = on_cpu(
        functools.partial(nv.matmul, out_dtype=jnp.float32, implementation="reference"),
        a,
        b,
    )
    assert got.shape == (*x.shape[:-1], n)
    # The reference in float64 from the exact dequantized values.
    exact = np.asarray(nv.dequantize(a, jnp.float32), np.float64) @ np.asarray(
        nv.dequantize(b, jnp.float32), np.float64
    )
    bound = _accumulation_bound(a, b).reshape(exact.shape) + 1e-30
    assert np.all(
        np.abs(np.asarray(got) - exact) <= bound * 1.01 + np.abs(exact) * 2**-23
    )
    assert np.all(
        np.abs(np.asarray(want) - exact) <= bound * 1.01 + np.abs(exact) * 2**-23
    )


def test_matmul_bf16_output_and_decode_path():
    x = outlier_data(2, (64, 32), jnp.float32)
    w = outlier_data(3, (32, 48), jnp.float32)
    a, b = nv.quantize(x), nv.quantize(w, axis=0)
    f32 = nv.matmul(a, b, out_dtype=jnp.float32)
    bf16 = nv.matmul(a, b)
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bf16, f32.astype(jnp.bfloat16))
    # The Hopper path (bf16 decode + bf16 GEMM, float32 accumulation) agrees.
    a3 = (a.codes[None], a.scales[None], a.amax.reshape(1))
    b3 = (b.codes[None], b.scales[None], b.amax.reshape(1))
    hopper = nv.reference.matmul_dequantize_bf16(*a3, *b3, dtype=jnp.float32)[0]
    np.testing.assert_allclose(
        hopper, f32, rtol=1e-5, atol=1e-5 * float(jnp.abs(f32).max())
    )


def test_matmul_batched_b_and_vmap():
    x = outlier_data(4, (3, 16, 32), jnp.bfloat16)
    w = outlier_data(5, (3, 48, 32), jnp.bfloat16)
    a, b = nv.quantize(x), nv.quantize(w)  # both stored [3, *, 32]
    out = nv.matmul(a, b, out_dtype=jnp.float32)
    assert out.shape == (3, 16, 48)
    for i in range(3):
        one = nv.matmul(
            nv.quantize(x[i], amax=a.amax),
            nv.quantize(w[i], amax=b.amax),
            out_dtype=jnp.float32,
        )
        np.testing.assert_allclose(out[i], one, rtol=1e-6)
    wq = nv.quantize(w[0], axis=-1)
    vm = jax.vmap(lambda xi: nv.matmul(nv.quantize(xi), wq, out_dtype=jnp.float32))(x)
    for i in range(3):
        np.testing.assert_allclose(
            vm[i], nv.matmul(nv.quantize(x[i]), wq, out_dtype=jnp.float32), rtol=1e-6
        )


def test_rht_cancels_in_wgrad_form():
    """(X^T R)(dY^T R)^T = X^T dY: both quantized along tokens with the RHT."""
    x = outlier_data(6, (64, 32), jnp.float32)
    dy = outlier_data(7, (64, 16), jnp.float32)
    xt = nv.quantize(x, axis=0, rht=True)
    dyt = nv.quantize(dy, axis=0, rht=True)
    got = nv.matmul(xt, dyt, out_dtype=jnp.float32)
    want = x.T @ dy
    rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert rel < 0.15, rel


def test_matmul_errors():
    a = nv.quantize(jnp.ones((16, 32)))
    with pytest.raises(ValueError, match="contraction lengths differ"):
        nv.matmul(a, nv.quantize(jnp.ones((16, 48))))
    with pytest.raises(ValueError, match="Random-Hadamard"):
        nv.matmul(a, nv.quantize(jnp.ones((16, 32)), rht=True))
    with pytest.raises(TypeError, match="NVFP4Tensors"):
        nv.matmul(a, jnp.ones((16, 32)))


def test_vmap_folds_into_one_gemm():
    """vmap of quantize + matmul: one GEMM call with per-example amaxes."""
    xs = (
        outlier_data(8, (4, 16, 32), jnp.float32)
        * jnp.array([1, 10, 100, 1000.0])[:, None, None]
    )
    w = outlier_data(9, (32, 16), jnp.float32)
    wq = nv.quantize(w, 0)

    def f(x):
        return nv.matmul(nv.quantize(x), wq, out_dtype=jnp.float32)

    batched = jax.jit(jax.vmap(f))(xs)
    for i in range(4):
        np.testing.assert_allclose(batched[i], f(xs[i]), rtol=1e-6)
    jaxpr = str(jax.make_jaxpr(jax.vmap(f))(xs))
    assert jaxpr.count("nvfp4_matmul") == 1 and "while" not in jaxpr
    # Both operands mapped (the WGRAD form under vmap).
    ws = jnp.stack([w, 2 * w, 3 * w, 4 * w])
    g = jax.vmap(
        lambda x, w: nv.matmul(
            nv.quantize(x, 0), nv.quantize(w, 0), out_dtype=jnp.float32
        )
    )
    out = g(xs.transpose(0, 2, 1), ws)  # [4, 32, 16] and [4, 32, 16] over 32
    for i in range(4):
        one = nv.matmul(
            nv.quantize(xs[i].T, 0), nv.quantize(ws[i], 0), out_dtype=jnp.float32
        )
        np.testing.assert_allclose(out[i], one, rtol=1e-6)


def test_tensors_returned_by_vmap_work_outside_it():
    """vmap(quantize) gives tensors whose arrays carry the batch axes while
    ``shape`` is per example: dequantize and matmul map over those axes."""
    x = outlier_data(20, (4, 32, 64), jnp.float32)
    w = outlier_data(21, (4, 48, 64), jnp.float32)
    tx, tw = jax.vmap(nv.quantize)(x), jax.vmap(nv.quantize)(w)
    assert tx.batch_ndim == 1 and tx.shape == (32, 64)
    np.testing.assert_array_equal(nv.dequantize(tx), jax.vmap(nv.dequantize)(tx))
    np.testing.assert_array_equal(nv.matmul(tx, tw), jax.vmap(nv.matmul)(tx, tw))
    shared = nv.quantize(w[0])
    np.testing.assert_array_equal(
        jax.jit(nv.matmul)(tx, shared),
        jax.vmap(nv.matmul, in_axes=(0, None))(tx, shared),
    )
    twice = jax.vmap(jax.vmap(nv.quantize))(x.reshape(2, 2, 32, 64))
    assert nv.dequantize(twice).shape == (2, 2, 32, 64)
    with pytest.raises(ValueError, match="vmapped leading axes"):
        nv.matmul(twice, tw)
