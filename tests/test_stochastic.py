"""Stochastic rounding: reproducible bytes for a key, different bytes for
different keys, and unbiased on average."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from conftest import assert_same_bytes, on_cpu

import jax_nvfp4 as nv
from jax_nvfp4.ops import Place, QuantizeSpec


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


def _raw(a):
    return np.asarray(a).view(np.uint8)


def _quantize_block(impl, x3, origin, global_mk, amaxes, words):
    """Both quantizations (SR, RHT on the column-wise one) of x3 [b, m, k]
    placed at `origin` in a tensor of global (m, k)."""
    return impl.quantize_rows_cols(
        x3,
        amaxes[0].reshape(1),
        amaxes[1].reshape(1),
        words,
        jnp.asarray(origin, jnp.int32),
        rows=QuantizeSpec(stochastic=True, stream=0),
        cols=QuantizeSpec(stochastic=True, rht=True, stream=1),
        place=Place(global_m=global_mk[0], global_k=global_mk[1]),
    )


def test_a_shard_draws_the_bits_of_its_place_in_the_whole_tensor():
    """What a partitioned call does per shard: quantizing a block placed at
    an origin (the handler's origin operand) gives exactly the bytes of that
    block of the whole tensor's quantization, on every backend."""
    from jax_nvfp4 import ops, reference

    x = jax.random.normal(jax.random.key(4), (2, 64, 96), jnp.bfloat16)
    words = jax.random.key_data(jax.random.key(9)).reshape(1, 2)
    amaxes = (jnp.float32(4.5), jnp.float32(6.0))
    whole = _quantize_block(ops, x, (0, 0, 0), (64, 96), amaxes, words)
    # Batch item 1, rows 16:48, columns 32:64.
    block = x[1:2, 16:48, 32:64]
    expected = (
        whole[0][1:2, 16:48, 16:32],  # row codes [b, m, k/2]
        whole[1][1:2, 16:48, 2:4],  # row scales [b, m, k/16]
        whole[2][1:2, 32:64, 8:24],  # column codes [b, k, m/2]
        whole[3][1:2, 32:64, 1:3],  # column scales [b, k, m/16]
    )
    for impl in (ops, reference):
        got = jax.jit(functools.partial(_quantize_block, impl), static_argnums=(2,))(
            block, (1, 16, 32), (64, 96), amaxes, words
        )
        for e, g in zip(expected, got, strict=True):
            np.testing.assert_array_equal(_raw(e), _raw(g))
    # And the block's own quantization (origin 0) draws different bits.
    alone = _quantize_block(ops, block, (0, 0, 0), (32, 32), amaxes, words)
    assert np.mean(np.asarray(alone[0]) != np.asarray(expected[0])) > 0.1


def _sr_both_ways(x, key, implementation="ffi"):
    """Every stochastic-rounding primitive: rows, columns and the fused pair."""
    return (
        _sr(x, key, implementation=implementation),
        _sr(x, key, axis=-2, implementation=implementation),
        *nv.quantize_rowwise_and_columnwise(
            x,
            key=key,
            row_rounding="stochastic",
            col_rht=True,
            col_rounding="stochastic",
            implementation=implementation,
        ),
    )


def _assert_example(batched, i, want):
    for t, w in zip(batched, want, strict=True):
        np.testing.assert_array_equal(t.codes[i], w.codes)
        np.testing.assert_array_equal(
            t.scales[i].view(np.uint8), w.scales.view(np.uint8)
        )


def test_vmap_draws_what_a_loop_draws():
    """vmap folds the examples into one handler call; each example's
    stochastic-rounding index still starts at 0, so the bytes equal a loop
    over the examples, with a key per example or one shared key (which,
    as outside vmap, gives every example the same bits), and equal the pure-JAX
    reference under vmap."""
    xs = jnp.asarray(
        np.random.default_rng(0).standard_normal((3, 2, 32, 48)), jnp.bfloat16
    )
    keys = jax.random.split(jax.random.key(4), 3)
    mapped = jax.jit(jax.vmap(_sr_both_ways))(xs, keys)
    shared = jax.jit(jax.vmap(_sr_both_ways, in_axes=(0, None)))(xs, keys[0])
    for i in range(3):
        _assert_example(mapped, i, _sr_both_ways(xs[i], keys[i]))
        _assert_example(shared, i, _sr_both_ways(xs[i], keys[0]))
    reference = on_cpu(
        jax.vmap(functools.partial(_sr_both_ways, implementation="reference")),
        xs,
        keys,
    )
    for got, want in zip(mapped, reference, strict=True):
        assert_same_bytes(got, want)
    # Nested vmap: the innermost example is what restarts the index.
    nested = jax.jit(jax.vmap(jax.vmap(_sr_both_ways)))(
        xs.reshape(3, 2, 1, 32, 48), jnp.stack([keys[:2]] * 3)
    )
    for i in range(3):
        for j in range(2):
            want = _sr_both_ways(xs[i, j][None], keys[j])
            for t, w in zip(nested, want, strict=True):
                np.testing.assert_array_equal(t.codes[i, j], w.codes)
