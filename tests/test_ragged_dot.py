"""jax_nvfp4.ragged_dot: the recipe per group (mixture of experts) against a
loop of the 2-D recipe (``jax_nvfp4.dot``) over the groups, decoded GEMM
operands, stochastic rounding, the recipe switches, traced group sizes,
errors and a small training run. The grouped GEMM's paths:
tests/ops/test_grouped_matmul.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import outlier_data
from jax.ad_checkpoint import checkpoint_name

import jax_nvfp4 as nv
from jax_nvfp4 import config
from jax_nvfp4.backends import bf16_grouped_gemm
from jax_nvfp4.ops import dispatch
from jax_nvfp4.recipe import MISSING_KEY_MESSAGE

K, N = 48, 32
# Unbalanced, an empty group, sizes off multiples of 16 / all rows in one group.
SIZES = {"unbalanced": (20, 0, 33, 17), "one_group": (0, 48, 0)}


def _operands(sizes, dtype, seed=0):
    tokens = sum(sizes)
    x = outlier_data(seed, (tokens, K), dtype)
    w = (outlier_data(seed + 1, (len(sizes), K, N), jnp.float32) * 0.1).astype(dtype)
    dy = outlier_data(seed + 2, (tokens, N), dtype)
    return x, w, dy


def _ragged_step(recipe, key=None, **kwargs):
    """(y, dx, dw) of ragged_dot, jitted, group_sizes traced."""

    @jax.jit
    def step(x, w, sizes, dy, key):
        y, vjp = jax.vjp(
            lambda a, b: nv.ragged_dot(a, b, sizes, key=key, recipe=recipe, **kwargs),
            x,
            w,
        )
        return (y, *vjp(dy))

    return lambda x, w, sizes, dy: step(x, w, jnp.asarray(sizes, jnp.int32), dy, key)


def _loop_step(recipe, sizes, key=None):
    """The oracle: jax_nvfp4.dot on each group's rows and weight; rows past
    the sum give zeros, an empty group's dw is 0."""

    @jax.jit
    def step(x, w, dy):
        ys, dxs, dws, start = [], [], [], 0
        for g, size in enumerate(sizes):
            rows = slice(start, start + size)
            start += size
            if size == 0:
                dws.append(jnp.zeros_like(w[g]))
                continue
            y, vjp = jax.vjp(
                lambda a, b: nv.dot(a, b, key=key, recipe=recipe), x[rows], w[g]
            )
            dx, dw = vjp(dy[rows])
            ys.append(y)
            dxs.append(dx)
            dws.append(dw)
        rest = x.shape[0] - start
        ys.append(jnp.zeros((rest, w.shape[2]), ys[0].dtype))
        dxs.append(jnp.zeros((rest, w.shape[1]), x.dtype))
        return jnp.concatenate(ys), jnp.concatenate(dxs), jnp.stack(dws)

    return step


def _assert_equal(got, want):
    for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype)
        np.testing.assert_array_equal(
            np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name
        )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", sorted(SIZES))
def test_matches_per_group_loop(case, dtype):
    """Round to nearest: y, dx and dw equal the per-group loop bit for bit."""
    sizes = SIZES[case]
    x, w, dy = _operands(sizes, dtype)
    got = _ragged_step(nv.NVFP4_NO_SR)(x, w, sizes, dy)
    _assert_equal(got, _loop_step(nv.NVFP4_NO_SR, sizes)(x, w, dy))
    for g, size in enumerate(sizes):
        if size == 0:  # exactly zero, not merely small
            assert not np.any(np.asarray(got[2][g], np.float32))


@pytest.mark.xfail(
    jax.default_backend() == "gpu" and not bf16_grouped_gemm.handler_supported(),
    reason="without the grouped GEMM handler, XLA expands ragged_dot_general "
    "into a dense dot over group-masked rows (RaggedDotRewriter), so a NaN in "
    "one group's weight meets other groups' zeroed rows",
    strict=True,
)
def test_non_finite_stays_in_its_group():
    """A NaN or inf poisons what the per-group loop's does (the same NaNs),
    never another group's outputs."""
    sizes = SIZES["unbalanced"]
    x, w, dy = _operands(sizes, jnp.float32, seed=18)
    x = x.at[25, 7].set(jnp.nan)  # group 2
    dy = dy.at[60, 3].set(jnp.inf)  # group 3
    w = w.at[0, 3, 5].set(jnp.nan)
    got = _ragged_step(nv.NVFP4_NO_SR)(x, w, sizes, dy)
    _assert_equal(got, _loop_step(nv.NVFP4_NO_SR, sizes)(x, w, dy))
    y, dx, dw = (np.asarray(a) for a in got)
    assert np.isnan(y[25]).all() and np.isfinite(np.delete(y, 25, 0)[20:]).all()
    assert np.isnan(dw[2][7]).all() and np.isfinite(np.delete(dw[2], 7, 0)).all()
    assert np.isnan(dw[3][:, 3]).all() and np.isfinite(np.delete(dw[3], 3, 1)).all()
    # dY's inf reaches its row of dx; w[0]'s NaN tile group 0's rows alone.
    assert np.isnan(dx[60]).all() and np.isfinite(np.delete(dx, 60, 0)[20:]).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decoded_operands_give_the_same_bits(dtype):
    """Where the dispatcher asks for decoded GEMM operands (the GPUs' bf16
    GEMMs read them; forced here by the setting ``gemm_operands``), the fused
    quantize writes bfloat16 values for bfloat16 inputs (x's rows, both of
    dY's copies) and every GEMM takes them: on the CPU the results are the
    loop's bit for bit, as with codes."""
    sizes = SIZES["unbalanced"]
    x, w, dy = _operands(sizes, dtype, seed=3)
    with nv.config.override(gemm_operands="decoded"):
        assert dispatch.grouped_decoded_operands()
        got = _ragged_step(nv.NVFP4_NO_SR)(x, w, sizes, dy)
    _assert_equal(got, _loop_step(nv.NVFP4_NO_SR, sizes)(x, w, dy))
    assert not np.any(np.asarray(got[2][1], np.float32))  # the empty group


@pytest.mark.parametrize(
    "recipe",
    [
        nv.Recipe(fprop=False, stochastic_rounding=False),
        nv.Recipe(dgrad=False, stochastic_rounding=False),
        nv.Recipe(wgrad=False, stochastic_rounding=False),
        nv.Recipe(rht=False, weight_2d=False, stochastic_rounding=False),
    ],
    ids=["no_fprop", "no_dgrad", "no_wgrad", "no_rht_1x16"],
)
def test_recipe_switches(recipe):
    """A GEMM switched off runs in the input dtype (lax.ragged_dot_general);
    the others as the loop's."""
    sizes = SIZES["unbalanced"]
    x, w, dy = _operands(sizes, jnp.float32, seed=6)
    got = _ragged_step(recipe)(x, w, sizes, dy)
    want = _loop_step(recipe, sizes)(x, w, dy)
    for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        np.testing.assert_allclose(
            a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()), err_msg=name
        )


def test_bf16_recipe_is_lax_ragged_dot():
    sizes = jnp.array([5, 0, 15], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (20, 24), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (3, 24, 8), jnp.bfloat16)

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w, sizes).astype(jnp.float32) ** 2)

    ours = jax.value_and_grad(
        loss(lambda x, w, s: nv.ragged_dot(x, w, s, recipe=nv.BF16)), (0, 1)
    )(x, w)
    theirs = jax.value_and_grad(loss(jax.lax.ragged_dot), (0, 1))(x, w)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(a, b)


def test_stochastic_rounding_reference_equals_ffi():
    """With a key, the pure-JAX twin gives the CPU handlers' bytes (on a GPU
    the same quantized operands, summed in the GEMM's order); another key
    gives other gradients, the same key the same."""
    sizes = SIZES["unbalanced"]
    x, w, dy = _operands(sizes, jnp.float32, seed=9)
    ffi = _ragged_step(nv.NVFP4, jax.random.key(1))(x, w, sizes, dy)
    ref_recipe = dataclasses.replace(nv.NVFP4, implementation="reference")
    ref = _ragged_step(ref_recipe, jax.random.key(1))(x, w, sizes, dy)
    if jax.default_backend() == "cpu":
        _assert_equal(ffi, ref)
    else:  # the same quantized operands; the GPU's GEMM sums in another order
        for a, b in zip(ffi, ref, strict=True):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
    again = _ragged_step(nv.NVFP4, jax.random.key(1))(x, w, sizes, dy)
    _assert_equal(ffi, again)
    other = _ragged_step(nv.NVFP4, jax.random.key(2))(x, w, sizes, dy)
    np.testing.assert_array_equal(other[0], ffi[0])  # the forward reads no key
    for a, b in zip(other[1:], ffi[1:], strict=True):
        assert np.mean(np.asarray(a) != np.asarray(b)) > 0.3


def test_stochastic_rounding_is_unbiased():
    """The mean of dx and dw over keys is closer to the exact gradients than
    the round-to-nearest ones (dY's rounding error averages out; x's and
    w's remain)."""
    sizes = SIZES["unbalanced"]
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (sum(sizes), K))
    w = jax.random.normal(ks[1], (len(sizes), K, N))
    dy = jax.random.normal(ks[2], (sum(sizes), N))
    off = nv.Recipe(
        fprop=False, dgrad=False, wgrad=False, rht=False, stochastic_rounding=False
    )
    exact = _ragged_step(off)(x, w, sizes, dy)[1:]
    nearest = _ragged_step(nv.NVFP4_NO_SR)(x, w, sizes, dy)[1:]
    step = jax.jit(
        lambda x, w, s, dy, key: jax.vjp(
            lambda a, b: nv.ragged_dot(a, b, s, key=key), x, w
        )[1](dy)
    )
    s = jnp.asarray(sizes, jnp.int32)
    draws = [step(x, w, s, dy, jax.random.key(i)) for i in range(32)]
    for i, (e, r) in enumerate(zip(exact, nearest, strict=True)):
        mean = sum(d[i] for d in draws) / len(draws)
        assert _relative_error(mean, e) < 0.9 * _relative_error(r, e)


def _relative_error(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_traced_sizes_rows_past_the_sum():
    """Under jit with traced group sizes summing to less than T, as
    lax.ragged_dot: the rows past the sum give zeros in y and dx and add
    nothing to dw."""
    used = (9, 30, 0)
    x, w, dy = _operands((*used[:2], 25), jnp.bfloat16, seed=12)
    got = _ragged_step(nv.NVFP4_NO_SR)(x, w, used, dy)
    want = _loop_step(nv.NVFP4_NO_SR, used)(x, w, dy)
    _assert_equal(got, want)
    assert not np.any(np.asarray(got[0][39:], np.float32))
    assert not np.any(np.asarray(got[1][39:], np.float32))


def test_output_dtype_and_missing_key():
    sizes = SIZES["unbalanced"]
    x, w, dy = _operands(sizes, jnp.bfloat16, seed=15)
    s = jnp.asarray(sizes, jnp.int32)
    y32 = nv.ragged_dot(x, w, s, preferred_element_type=jnp.float32)
    assert y32.dtype == jnp.float32
    y = nv.ragged_dot(x, w, s, key=jax.random.key(0))
    assert y.dtype == jnp.bfloat16
    # The forward pass needs no key (stochastic rounding is for dY only) ...
    np.testing.assert_array_equal(nv.ragged_dot(x, w, s), y)
    np.testing.assert_array_equal(y32.astype(jnp.bfloat16), y)
    # ... but differentiating a stochastic recipe does.
    with pytest.raises(ValueError, match="without a key") as info:
        jax.grad(lambda x: jnp.sum(nv.ragged_dot(x, w, s).astype(jnp.float32)))(x)
    assert str(info.value) == MISSING_KEY_MESSAGE


@pytest.mark.parametrize(
    "args, error, match",
    [
        (((2, 24, K), (2, K, N), (40, 8)), ValueError, r"x \[T, K\].*w \[G, K, N\]"),
        (((48, K), (K, N), (48,)), ValueError, r"w \[G, K, N\]"),
        (((48, K), (2, 32, N), (40, 8)), ValueError, "features"),
        (((48, 40), (2, 40, N), (40, 8)), ValueError, "multiples of 16"),
        (((48, K), (2, K, 24), (40, 8)), ValueError, "multiples of 16"),
        (((48, K), (2, K, N), (40.0, 8.0)), TypeError, "integers"),
        (((48, K), (2, K, N), (40, 4, 4)), ValueError, r"shape \(2,\)"),
        (((48, K), (2, K, N), (50, -2)), ValueError, "non-negative and sum"),
        (((48, K), (2, K, N), (40, 16)), ValueError, "sorted by group"),
    ],
)
def test_bad_input(args, error, match):
    x_shape, w_shape, sizes = args
    x = jnp.zeros(x_shape, jnp.float32)
    w = jnp.zeros(w_shape, jnp.float32)
    with pytest.raises(error, match=match):
        nv.ragged_dot(x, w, np.asarray(sizes))


def test_bad_dtypes_and_options():
    x = jnp.zeros((32, K), jnp.float32)
    w = jnp.zeros((2, K, N), jnp.float32)
    sizes = jnp.array([16, 16], jnp.int32)
    with pytest.raises(TypeError, match="cast both"):
        nv.ragged_dot(x, w.astype(jnp.bfloat16), sizes)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        nv.ragged_dot(x.astype(jnp.int32), w.astype(jnp.int32), sizes)
    with pytest.raises(TypeError, match="Recipe"):
        nv.ragged_dot(x, w, sizes, recipe="nvfp4")
    with pytest.raises(NotImplementedError, match="group_offset"):
        nv.ragged_dot(x, w, sizes, group_offset=jnp.array([0]))


def test_remat_keeps_fp4_residuals():
    """Under jax.checkpoint with save_fp4_residuals the gradients are the
    same (the residuals carry the recipe's checkpoint names)."""
    sizes = SIZES["unbalanced"]
    x, w, dy = _operands(sizes, jnp.bfloat16, seed=21)
    s = jnp.asarray(sizes, jnp.int32)

    def loss(x, w):
        y = nv.ragged_dot(x, w, s, recipe=nv.NVFP4_NO_SR)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    remat = jax.checkpoint(loss, policy=nv.save_fp4_residuals)
    want = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    got = jax.jit(jax.grad(remat, (0, 1)))(x, w)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def _routed_loss(route_calls, named):
    """A block routing each of 64 tokens to one of 4 experts by a router that
    answers differently after its first call (the forward pass's routing
    against a recomputation's that rounded differently), with the choice
    labelled ROUTING when ``named``."""
    x = outlier_data(31, (64, K), jnp.float32)
    w = (outlier_data(32, (4, K, N), jnp.float32) * 0.1).astype(jnp.float32)
    first = np.arange(64, dtype=np.int32) % 4
    later = np.where(np.arange(64) == 5, 2, first).astype(np.int32)  # 1 -> 2

    def router(_):
        route_calls.append(1)
        return first if len(route_calls) == 1 else later

    def loss(x, w):
        spec = jax.ShapeDtypeStruct((64,), jnp.int32)
        chosen = jax.pure_callback(router, spec, jax.lax.stop_gradient(x))
        if named:
            chosen = checkpoint_name(chosen, nv.ROUTING)
        order = jnp.argsort(chosen, stable=True)
        sizes = jnp.bincount(chosen, length=4).astype(jnp.int32)
        y = nv.ragged_dot(x[order], w, sizes, recipe=nv.NVFP4_NO_SR)
        return jnp.sum(y * jnp.cos(jnp.arange(N, dtype=jnp.float32)))

    return loss, x, w


def test_recomputed_routing_differs_from_the_residuals():
    """Under jax.checkpoint with save_fp4_residuals, x's residual is laid out
    by the forward pass's routing. A recomputed routing that differs gives
    NaN weight gradients, not a silently wrong sum; with the routing
    labelled ROUTING the policy keeps it, the router runs once, and the
    gradients are those of the block without remat."""
    calls = []
    loss, x, w = _routed_loss(calls, named=False)
    remat = jax.checkpoint(loss, policy=nv.save_fp4_residuals)
    dx, dw = jax.grad(remat, (0, 1))(x, w)
    assert len(calls) == 2  # forward, then the backward's recomputation
    assert np.isnan(np.asarray(dw)).all()
    assert np.isfinite(np.asarray(dx)).all()  # DGRAD needs no x residual

    calls = []
    loss, x, w = _routed_loss(calls, named=True)
    remat = jax.checkpoint(loss, policy=nv.save_fp4_residuals)
    got = jax.grad(remat, (0, 1))(x, w)
    assert len(calls) == 1
    calls.clear()  # the same routing again, without remat
    want = jax.grad(loss, (0, 1))(x, w)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_moe_training_loss_falls():
    """A router-free mixture of experts (fixed group sizes): two ragged
    NVFP4 layers with a nonlinearity, trained by SGD toward a random
    teacher; the loss falls."""
    sizes = jnp.array([24, 8, 40, 0], jnp.int32)
    ks = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(ks[0], (72, 32))
    teacher = jax.random.normal(ks[1], (4, 32, 16)) / jnp.sqrt(32.0)
    target = jax.lax.ragged_dot(x, teacher, sizes)
    params = (
        jax.random.normal(ks[2], (4, 32, 32)) / jnp.sqrt(32.0),
        jax.random.normal(ks[3], (4, 32, 16)) / jnp.sqrt(32.0),
    )

    def loss(params, key):
        k1, k2 = jax.random.split(key)
        h = jax.nn.gelu(nv.ragged_dot(x, params[0], sizes, key=k1))
        return jnp.mean((nv.ragged_dot(h, params[1], sizes, key=k2) - target) ** 2)

    @jax.jit
    def step(params, key):
        value, grads = jax.value_and_grad(loss)(params, key)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), value

    losses = []
    for i in range(30):
        params, value = step(params, jax.random.fold_in(ks[4], i))
        losses.append(float(value))
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("recipe", [nv.NVFP4, nv.Recipe(fprop=False)], ids=str)
def test_undifferentiated_forward_quantizes_fprop_operands_alone(recipe):
    """Without differentiation, where the GEMMs read codes, only FPROP's
    operands are quantized (no transformed amax, no column-wise x, no DGRAD
    weights); the output bytes are those of the differentiated forward
    pass."""
    x = outlier_data(6, (50, 64), jnp.bfloat16)
    w = outlier_data(7, (3, 64, 32), jnp.bfloat16)
    sizes = jnp.array([20, 0, 27], jnp.int32)
    key = jax.random.key(8)

    def forward(x, w):
        return nv.ragged_dot(x, w, sizes, key=key, recipe=recipe)

    with config.override(gemm_operands="codes"):
        alone = jax.jit(forward)(x, w)
        differentiated, _ = jax.jit(lambda x, w: jax.vjp(forward, x, w))(x, w)
        hlo = jax.jit(forward).lower(x, w).compile().as_text()
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(differentiated))
    if nv.available_platforms():
        assert "jax_nvfp4_quantize_rows_cols" not in hlo
        assert 'jax_nvfp4_amax"' not in hlo, "no transformed amax"
