"""Stochastic rounding: reproducible bytes for a key, different bytes for
different keys, and unbiased on average."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from conftest import assert_same_bytes, on_cpu

import jax_nvfp4 as nv


def _sr(x, key, **kw):
    return nv.quantize(x, rounding="stochastic", key=key, **kw)


def test_same_key_same_bytes_on_every_backend():
    x = jax.random.normal(jax.random.key(1), (64, 128), jnp.bfloat16)
    key = jax.random.key(123)
    a = jax.jit(_sr)(x, key)
    b = jax.jit(_sr)(x, key)
    assert_same_bytes(a, b)
    # The default device's handler, the CPU handler and the reference agree.
    assert_same_bytes(a, on_cpu(_sr, x, key))
    assert_same_bytes(
        a, on_cpu(functools.partial(_sr, implementation="reference"), x, key)
    )
    # A legacy uint32[2] key with the same words gives the same bytes.
    assert_same_bytes(a, _sr(x, jax.random.key_data(key)))


def test_different_keys_and_streams_differ():
    x = jax.random.normal(jax.random.key(2), (64, 128), jnp.float32)
    a = _sr(x, jax.random.key(0))
    b = _sr(x, jax.random.key(1))
    c = _sr(x, jax.random.key(0), stream=5)
    differ_ab = np.mean(np.asarray(a.codes) != np.asarray(b.codes))
    differ_ac = np.mean(np.asarray(a.codes) != np.asarray(c.codes))
    assert differ_ab > 0.3 and differ_ac > 0.3
    # Scales never depend on the random bits.
    np.testing.assert_array_equal(
        np.asarray(a.scales.astype(jnp.float32)),
        np.asarray(b.scales.astype(jnp.float32)),
    )


def test_unbiased():
    """The mean of many stochastic draws converges to the input; its bias is far
    below round-to-nearest's error."""
    x = jax.random.uniform(jax.random.key(3), (16, 64), jnp.float32, -6.0, 6.0)
    x = x.at[0, 0].set(6.0)  # pin the scale so that the grid is the E2M1 grid
    n = 2000
    keys = jax.random.split(jax.random.key(4), n)

    @jax.jit
    def mean_of_draws(x, keys):
        draws = jax.vmap(lambda k: nv.dequantize(_sr(x, k), jnp.float32))(keys)
        return draws.mean(0)

    mean = mean_of_draws(x, keys)
    nearest = nv.dequantize(nv.quantize(x), jnp.float32)
    sr_bias = float(jnp.mean(jnp.abs(mean - x)))
    rn_error = float(jnp.mean(jnp.abs(nearest - x)))
    # Each draw has spread <= step/2 (<= 1); the mean of 2000 has ~0.01-0.02.
    assert sr_bias < 0.03, sr_bias
    assert sr_bias < rn_error / 5, (sr_bias, rn_error)
    # Signed bias over all elements is ~0 as well.
    assert abs(float(jnp.mean(mean - x))) < 0.005


def test_sr_values_are_grid_neighbours():
    x = jax.random.normal(jax.random.key(5), (32, 64), jnp.float32)
    sr = nv.dequantize(_sr(x, jax.random.key(6)), jnp.float32)
    rn = nv.dequantize(nv.quantize(x), jnp.float32)
    # Same scales, so SR differs from RN by at most one grid step (<= 2/6 of the
    # block's amax after scaling); check it is never further than that.
    scale = jnp.repeat(nv.quantize(x).scales.astype(jnp.float32), 16, axis=1)
    step = scale * nv.quantize(x).amax / 2688.0 * 2.0
    assert bool(jnp.all(jnp.abs(sr - rn) <= step + 1e-6))
