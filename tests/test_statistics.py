"""quantization_stats: what NVFP4 quantization loses on a tensor, counted on
tensors built so that every statistic is known exactly."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4.statistics import STATISTICS


def _known():
    """One row of four blocks, amax 2688 (so the tensor scale is 1):
    block 0: 2688 and 100 (scale 448: 100 rounds to zero);
    block 1: 6, 0.2 and 0.3 (scale 1: 0.2 rounds to zero, 0.3 to 0.5);
    block 2: sixteen 1e-4 (scale 1.7e-5 rounds to an E4M3 zero: all lost);
    block 3: sixteen 0.03 (scale 0.005: an E4M3 subnormal)."""
    row = np.zeros(64, np.float32)
    row[[0, 1]] = [2688, 100]
    row[[16, 17, 18]] = [6, 0.2, 0.3]
    row[32:48] = 1e-4
    row[48:64] = 0.03
    return jnp.asarray(row[None])


@pytest.mark.parametrize("implementation", ["ffi", "reference"])
def test_known_counts(implementation):
    stats = nv.quantization_stats(_known(), implementation=implementation)
    assert set(stats) == set(STATISTICS)
    assert float(stats["amax"]) == 2688.0
    assert float(stats["nonfinite"]) == 0.0
    assert float(stats["underflow"]) == pytest.approx(18 / 37)
    assert float(stats["zero_scale_blocks"]) == 0.25
    assert float(stats["subnormal_scale_blocks"]) == 0.25


@pytest.mark.parametrize(
    "axis, block, rht", [(-1, "1x16", False), (0, "16x16", False), (0, "1x16", True)]
)
def test_relative_error_is_the_decoded_difference(axis, block, rht):
    x = jax.random.normal(jax.random.key(1), (48, 64), jnp.float32) * 3
    stats = jax.jit(lambda x: nv.quantization_stats(x, axis, block=block, rht=rht))(x)
    t = nv.quantize(x, axis, block=block, rht=rht)
    decoded = np.asarray(nv.dequantize(t, jnp.float32), np.float64)
    values = np.asarray(x, np.float64)
    if rht:  # what is quantized: each 16-chunk along the axis, transformed
        values = np.asarray(
            jnp.moveaxis(
                nv.reference.numerics.random_hadamard16(jnp.moveaxis(x, axis, -1)),
                -1,
                axis,
            ),
            np.float64,
        )
    expected = np.linalg.norm(decoded - values) / np.linalg.norm(values)
    assert float(stats["relative_error"]) == pytest.approx(expected, rel=1e-5)
    assert float(stats["amax"]) == float(t.amax)
    underflow = np.sum((values != 0) & (decoded == 0)) / np.sum(values != 0)
    assert float(stats["underflow"]) == pytest.approx(underflow, rel=1e-6)
    assert 0.02 < float(stats["relative_error"]) < 0.2  # 4 bits: about 10%


def test_a_nan_is_counted_and_its_block_set_aside():
    x = _known().at[0, 20].set(jnp.nan)  # in block 1
    stats = nv.quantization_stats(x)
    assert float(stats["nonfinite"]) == 1 / 64
    # Block 1 (two of the underflows, three nonzeros) is left out.
    assert float(stats["underflow"]) == pytest.approx(17 / 34)
    assert float(stats["zero_scale_blocks"]) == pytest.approx(1 / 3)
    assert np.isfinite(float(stats["relative_error"]))


def test_zeros_and_all_nan():
    zeros = nv.quantization_stats(jnp.zeros((16, 32), jnp.bfloat16))
    assert all(float(v) == 0.0 for v in zeros.values())
    nans = nv.quantization_stats(jnp.full((16, 32), jnp.nan, jnp.bfloat16))
    assert float(nans["nonfinite"]) == 1.0


def test_bad_input_says_what_to_change():
    with pytest.raises(ValueError, match="multiple of 16"):
        nv.quantization_stats(jnp.ones((4, 24)))


KEY = jax.random.key(3)


def _operands():
    x = jax.random.normal(jax.random.key(4), (32, 64), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(5), (64, 48), jnp.float32) * 0.1).astype(
        jnp.bfloat16
    )
    return x, w


def _loss(x, w):
    return jnp.sum(nv.dot(x, w, key=KEY).astype(jnp.float32) ** 2)


def test_operand_stats_measures_x_w_and_dy_as_the_recipe_quantizes_them():
    x, w = _operands()
    grads, records = nv.statistics.operand_stats(jax.jit(jax.grad(_loss, (0, 1))), x, w)
    with jax.disable_jit():  # the same operations, one at a time
        expected = jax.grad(_loss, (0, 1))(x, w)
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    by_role = {(r["block"], r["stochastic"], r["side"]): r for r in records}
    assert len(records) == 6 and len(by_role) == 6  # x, w, dY; rows and cols
    dy = 2 * nv.dot(x, w).astype(jnp.float32)  # d(sum y^2)/dy, y in bf16
    dy = dy.astype(jnp.bfloat16)
    cases = {
        ("1x16", False, "rows"): nv.quantization_stats(x),
        ("1x16", False, "cols"): nv.quantization_stats(x, 0, rht=True),
        ("16x16", False, "rows"): nv.quantization_stats(w, 0, block="16x16"),
        ("1x16", True, "rows"): nv.quantization_stats(dy),
        ("1x16", True, "cols"): nv.quantization_stats(dy, 0, rht=True),
    }
    for role, stats in cases.items():
        record = by_role[role]
        assert record["rht"] == (role[2] == "cols" and role[0] == "1x16")
        for name in STATISTICS:
            assert record[name] == pytest.approx(float(stats[name]), rel=1e-6), (
                role,
                name,
            )


def test_operand_stats_counts_loop_iterations_and_takes_cond_branches():
    x, w = _operands()
    ws = jnp.stack([w[:, :32] * (i + 1) for i in range(3)])[:, :32, :]  # 3 layers

    def stack(x, ws):
        def layer(h, w):
            return nv.dot(h, w, key=KEY) * 0.5, None

        return jnp.sum(jax.lax.scan(layer, x[:, :32], ws)[0].astype(jnp.float32))

    _, records = nv.statistics.operand_stats(jax.grad(stack, 1), x, ws)
    forward = [r["iteration"] for r in records if not r["stochastic"]]
    backward = [r["iteration"] for r in records if r["stochastic"]]
    assert forward[0] == (0,) and forward[-1] == (2,)
    assert backward[0] == (2,) and backward[-1] == (0,)  # the reversed scan

    def branchy(x, w, flag):
        return jax.lax.cond(
            flag, lambda: nv.dot(x, w, key=KEY), lambda: (x @ w).astype(x.dtype)
        )

    assert nv.statistics.operand_stats(branchy, x, w, False)[1] == []
    # Not differentiated: FPROP's operands alone, x and w along K (w [K, N]
    # is quantized along its first axis).
    taken = nv.statistics.operand_stats(branchy, x, w, True)[1]
    assert [(r["side"], r["block"]) for r in taken] == [
        ("rows", "1x16"),
        ("cols", "16x16"),
    ]

    square = jnp.concatenate([w, w[:, :16]], axis=1)  # [64, 64]

    def looped(x, w, n):
        return jax.lax.fori_loop(0, n, lambda i, h: nv.dot(h, w, key=KEY), x)

    _, records = nv.statistics.operand_stats(looped, x, square, jnp.int32(3))
    assert [r["iteration"] for r in records[::2]] == [(0,), (1,), (2,)]


def test_operand_stats_of_a_flax_nnx_model():
    """As an NNX user calls it: on nnx.grad of the loss, with the converted
    model itself as the argument, which stays usable afterwards."""
    nnx = pytest.importorskip("flax.nnx")
    import jax_nvfp4.flax as nvflax

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(32, 64, rngs=rngs)
            self.down = nnx.Linear(64, 32, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))

    model = MLP(nnx.Rngs(0))
    nvflax.convert(model, nv.policy.Policy(default=nv.NVFP4), nnx.Rngs(nvfp4=1))
    x = jax.random.normal(jax.random.key(0), (16, 32), jnp.bfloat16)

    def loss(m, x):
        return jnp.mean(m(x).astype(jnp.float32) ** 2)

    grads, records = nv.statistics.operand_stats(nnx.grad(loss), model, x)
    # Two layers: x and w forward (rows and cols each), dY backward.
    assert len(records) == 12
    assert sum(r["stochastic"] for r in records) == 4
    assert jax.tree.structure(grads) == jax.tree.structure(nnx.grad(loss)(model, x))


def test_operand_stats_of_ragged_dot_pools_the_groups():
    """The grouped product quantizes its token buffer's 16-row items, each
    with its group's amax: one record per side pools them (empty groups and
    padding rows hold zeros, which count as neither underflow nor error)."""
    x = jax.random.normal(jax.random.key(0), (64, 32), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (4, 32, 48), jnp.float32) * 0.2
    w = w.astype(jnp.bfloat16)
    sizes = jnp.array([10, 30, 0, 24], jnp.int32)

    def loss(x, w):
        y = nv.ragged_dot(x, w, sizes, key=KEY)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    grads, records = nv.statistics.operand_stats(jax.grad(loss, (0, 1)), x, w)
    with jax.disable_jit():
        expected = jax.grad(loss, (0, 1))(x, w)
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert len(records) == 6
    weights = [r for r in records if r["block"] == "16x16"]
    assert [r["shape"] for r in weights] == [(4, 32, 48)] * 2
    x_rows = records[0]
    assert x_rows["side"] == "rows" and x_rows["shape"][1:] == (16, 32)
    # Each group's rows quantized with that group's amax: the pooled
    # statistics are the sums of the groups' measured alone.
    starts = np.cumsum([0, 10, 30, 0])
    groups = [x[s : s + n] for s, n in zip(starts, [10, 30, 0, 24], strict=True) if n]
    alone = [nv.quantization_stats(g) for g in groups]
    nonzero = [int(jnp.sum(g != 0)) for g in groups]
    assert x_rows["amax"] == max(float(a["amax"]) for a in alone)
    pooled = sum(float(a["underflow"]) * n for a, n in zip(alone, nonzero, strict=True))
    assert x_rows["underflow"] == pytest.approx(pooled / sum(nonzero), rel=1e-5)


def test_operand_stats_takes_what_users_pass():
    """Static arguments and an Equinox model's functions are closed over (only
    arrays are traced), shard_map runs unmeasured, a jitted layer used twice
    is two sites, one amax shared by several items is measured, and a NaN in
    a 16x16 tile sets that tile aside."""
    x, w = _operands()

    @functools.partial(jax.jit, static_argnums=2)
    def scaled(x, w, factor):
        return nv.dot(x, w, key=KEY) * factor

    out, records = nv.statistics.operand_stats(scaled, x, w, 2.0)
    assert out.shape == (32, 48) and len(records) == 2

    layer = jax.jit(lambda h, w: nv.dot(h, w, key=KEY))
    square = jnp.concatenate([w, w[:, :16]], axis=1)
    _, records = nv.statistics.operand_stats(
        lambda x, a, b: layer(layer(x, a), b), x, square, square
    )
    assert [r["site"] for r in records] == [0, 1, 2, 3]
    assert [r["weight"] for r in records] == [False, True, False, True]

    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.shard_map(
        lambda x, w: nv.dot(x, w, recipe=nv.NVFP4_NO_SR, axis_name="d"),
        mesh=mesh,
        in_specs=(jax.P("d"), jax.P()),
        out_specs=jax.P("d"),
    )
    out, records = nv.statistics.operand_stats(jax.jit(sharded), x, w)
    assert records == []  # inside shard_map nothing is measured
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(sharded)(x, w)))

    items = jnp.ones((2, 32, 16))  # quantize along axis 1: one amax, two items
    _, records = nv.statistics.operand_stats(
        lambda x: nv.dequantize(nv.quantize(x, 1), jnp.float32), items
    )
    assert records and all(r["relative_error"] == 0.0 for r in records)

    tile = jax.random.normal(jax.random.key(6), (32, 64)).at[3, 5].set(jnp.nan)
    stats = nv.quantization_stats(tile, block="16x16")
    assert np.isfinite(float(stats["relative_error"]))


def test_operand_stats_of_an_equinox_model_with_function_fields():
    eqx = pytest.importorskip("equinox")
    import jax_nvfp4.equinox as nveqx

    mlp = eqx.nn.MLP(32, 32, 64, depth=1, key=jax.random.key(0))
    mlp = nveqx.convert(mlp, nv.policy.Policy(default=nv.NVFP4_NO_SR))
    x = jax.random.normal(jax.random.key(1), (16, 32))

    def loss(model, x):
        return jnp.sum(jax.vmap(model)(x) ** 2)

    grads, records = nv.statistics.operand_stats(eqx.filter_grad(loss), mlp, x)
    assert len(records) == 12  # two layers: x, w (rows, cols), dY
    assert sum(r["weight"] for r in records) == 4
