"""Issue 31's silent and unclear edges, one test (or a few) per case: each
either gives a visible result (NaN where a given amax is wrong, a warning
where convert finds nothing, a forward pass where dot runs one) or a clear
error at trace time. The exports' cases are in tests/test_export*.py."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_same_bytes, on_cpu, outlier_data

import jax_nvfp4 as nv
import jax_nvfp4.equinox as nveqx
from jax_nvfp4.policy import Policy, transformer_policy

IMPLEMENTATIONS = ["ffi", "reference"]
# Each given amax that is not a max |x| of data holding nonzero values.
BAD_AMAXES = [0.0, -1.0, -0.0, float("nan"), float("inf"), float("-inf")]


def _x(seed=0, shape=(32, 64)):
    return outlier_data(seed, shape, jnp.float32)


def _scale_bytes(t):
    return np.asarray(jax.lax.bitcast_convert_type(t.scales, jnp.uint8))


def _assert_marked(t, implementation):
    """The tensor of an invalid amax: amax NaN, every scale the E4M3 NaN,
    dequantized NaN everywhere, every matmul output with it NaN."""
    assert np.isnan(np.asarray(t.amax))
    assert np.all(_scale_bytes(t) == 0x7F)
    values = nv.dequantize(t, jnp.float32, implementation=implementation)
    assert np.all(np.isnan(np.asarray(values)))


# ------------------------------------------------- a traced amax that is wrong


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "options",
    [
        dict(axis=-1),
        dict(axis=0),
        dict(axis=-1, block="16x16"),
        dict(axis=0, rht=True),
        dict(axis=-1, rounding="stochastic", key=jax.random.key(1)),
    ],
    ids=["rows", "cols", "16x16", "rht", "stochastic"],
)
def test_traced_invalid_amax_gives_nan(implementation, options):
    """Under jit a NaN, +-inf, negative or (with nonzero data) zero amax marks
    the tensor instead of quantizing to garbage or zeros; the handler's bytes
    equal the twin's."""
    x = _x()
    quantize = functools.partial(nv.quantize, **options)
    fn = jax.jit(lambda x, a: quantize(x, amax=a, implementation=implementation))
    twin = jax.jit(lambda x, a: quantize(x, amax=a, implementation="reference"))
    for amax in BAD_AMAXES:
        t = fn(x, jnp.float32(amax))
        _assert_marked(t, implementation)
        assert_same_bytes(t, on_cpu(twin, x, jnp.float32(amax)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_matmul_with_an_invalid_amax_is_nan(implementation):
    x, w = _x(0, (32, 64)), _x(1, (48, 64))

    @jax.jit
    def product(a):
        qa = nv.quantize(x, amax=a, implementation=implementation)
        qw = nv.quantize(w, implementation=implementation)
        return nv.matmul(qa, qw, out_dtype=jnp.float32, implementation=implementation)

    assert np.all(np.isfinite(np.asarray(product(jnp.max(jnp.abs(x))))))
    for amax in BAD_AMAXES:
        assert np.all(np.isnan(np.asarray(product(jnp.float32(amax))))), amax


def test_broken_statistic_under_jit_gives_nan():
    """An amax computed with jnp.max (which propagates NaN, unlike
    global_amax) over data holding a NaN: NaN everywhere, not garbage; with
    global_amax only the NaN's block is marked."""
    x = _x().at[3, 5].set(jnp.nan)
    bad = jax.jit(lambda x: nv.quantize(x, amax=jnp.max(jnp.abs(x))))(x)
    _assert_marked(bad, "ffi")
    good = jax.jit(lambda x: nv.quantize(x, amax=nv.global_amax(x)))(x)
    scales = _scale_bytes(good)
    assert scales[3, 0] == 0x7F and np.sum(scales == 0x7F) == 1


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("options", [{}, dict(block="16x16"), dict(rht=True)])
def test_traced_zero_amax_of_zero_data_is_valid(implementation, options):
    """A zero amax is right for a tensor without a nonzero finite element
    (all zeros, or zeros and NaN blocks): the same bytes as its computed
    amax."""
    zeros = jnp.zeros((32, 64), jnp.float32).at[0, 1].set(-0.0)
    with_nan = zeros.at[17, 40].set(jnp.nan)
    for axis in (-1, 0):
        q = functools.partial(
            nv.quantize, axis=axis, implementation=implementation, **options
        )
        given = jax.jit(lambda x, a, q=q: q(x, amax=a))
        computed = jax.jit(q)
        for x in (zeros, with_nan):
            t = given(x, jnp.float32(0))
            assert_same_bytes(t, computed(x))
            values = np.asarray(nv.dequantize(t, jnp.float32))
            assert not np.any(np.nan_to_num(values))
            assert np.isnan(values).any() == np.isnan(np.asarray(x)).any()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_traced_valid_amax_is_not_changed(implementation):
    x = _x()
    for amax in (float(jnp.max(jnp.abs(x))), 2.0 * float(jnp.max(jnp.abs(x))), 0.5):
        traced = jax.jit(
            lambda x, a: nv.quantize(x, amax=a, implementation=implementation)
        )(x, jnp.float32(amax))
        concrete = nv.quantize(x, amax=amax, implementation=implementation)
        assert_same_bytes(traced, concrete)


def test_vmapped_amax_marks_only_its_own_example():
    xs = jnp.stack([_x(0), _x(1), _x(2)])
    amaxes = jnp.array([jnp.max(jnp.abs(xs[0])), jnp.nan, 0.0], jnp.float32)
    ts = jax.jit(jax.vmap(lambda x, a: nv.quantize(x, amax=a)))(xs, amaxes)
    values = np.asarray(nv.dequantize(ts, jnp.float32))
    assert np.all(np.isfinite(values[0])) and np.all(np.isnan(values[1:]))
    assert_same_bytes(
        jax.tree.map(lambda a: a[0], ts), nv.quantize(xs[0], amax=amaxes[0])
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("side", ["row", "col"])
def test_fused_quantize_marks_the_side_of_the_invalid_amax(implementation, side):
    x = _x()
    options = dict(col_rht=True, implementation=implementation)
    bad = {f"{side}_amax": jnp.float32(-2.0)}
    rows, cols = jax.jit(
        lambda x, bad: nv.quantize_rowwise_and_columnwise(x, **options, **bad)
    )(x, bad)
    want_rows, want_cols = nv.quantize_rowwise_and_columnwise(x, **options)
    marked, kept, want = (
        (rows, cols, want_cols) if side == "row" else (cols, rows, want_rows)
    )
    _assert_marked(marked, implementation)
    assert_same_bytes(kept, want)


@pytest.mark.parametrize("amax", [-1.0, float("nan"), float("inf")])
def test_concrete_invalid_amax_raises_at_trace_time(amax):
    with pytest.raises(ValueError, match="finite, positive"):
        jax.jit(lambda x: nv.quantize(x, amax=amax))(_x())
    with pytest.raises(ValueError, match="col_amax.*finite, positive"):
        nv.quantize_rowwise_and_columnwise(_x(), col_amax=amax)


def test_concrete_zero_amax_of_nonzero_data_raises():
    with pytest.raises(ValueError, match="amax=0.*values up to"):
        nv.quantize(_x(), amax=0.0)
    t = nv.quantize(jnp.zeros((4, 32)), amax=0.0)
    assert_same_bytes(t, nv.quantize(jnp.zeros((4, 32))))


def test_recipe_with_axis_name_keeps_zero_data_zero():
    """The recipe's own amaxes under shard_map (pmax of global_amax) are
    valid by construction: an all-zero shard set stays zeros, gradients too."""
    mesh = jax.make_mesh((1,), ("data",), (jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec
    w = _x(1, (64, 48))

    def loss(x, w):
        y = nv.dot(x, w, key=jax.random.key(0), axis_name="data")
        return jnp.sum(y), y

    f = jax.shard_map(
        jax.grad(loss, argnums=(0, 1), has_aux=True),
        mesh=mesh,
        in_specs=(spec("data"), spec()),
        out_specs=((spec("data"), spec()), spec("data")),
        check_vma=False,
    )
    (dx, dw), y = jax.jit(f)(jnp.zeros((32, 64), jnp.float32), w)
    assert not np.any(np.asarray(y)) and not np.any(np.asarray(dw))
    assert np.all(np.isfinite(np.asarray(dx)))


# ------------------------------------------------------ convert on a bare dict


def test_equinox_convert_warns_when_it_finds_no_layer():
    policy = Policy(default=nv.NVFP4)
    tree = {"a": jnp.ones((32, 16))}
    with pytest.warns(UserWarning, match="no layer to convert in this dict.*array"):
        assert nveqx.convert(tree, policy) is tree
    with pytest.warns(UserWarning, match="no layer to convert"):
        nveqx.convert(jnp.ones((32, 16)), policy)


def test_flax_convert_warns_when_it_finds_no_layer():
    from flax import nnx

    from jax_nvfp4 import flax as nvflax

    class NoLinear(nnx.Module):
        def __init__(self):
            self.scale = nnx.Param(jnp.ones(16))

    model = NoLinear()
    for policy in (Policy(default=nv.NVFP4), Policy()):  # with and without rules
        with pytest.warns(
            UserWarning, match="found no layer to convert in this NoLinear"
        ):
            assert nvflax.convert(model, policy) is model


def test_equinox_convert_converts_layers_inside_any_pytree():
    key = jax.random.key(0)
    tree = {
        "a": eqx.nn.Linear(32, 16, key=key),
        "b": [eqx.nn.Linear(16, 32, key=key), jnp.ones(3)],
    }
    out = nveqx.convert(tree, Policy(default=nv.NVFP4))
    assert isinstance(out["a"], nveqx.Linear) and isinstance(out["b"][0], nveqx.Linear)
    assert out["a"].weight is tree["a"].weight and out["b"][1] is tree["b"][1]


# ------------------------------------------------------------- unclear errors


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x: nv.quantize(x, axis=1.0), TypeError, "axis must be an int.*1.0"),
        (lambda x: nv.quantize(x, axis=True), TypeError, "axis must be an int"),
        (lambda x: nv.quantize(x, axis=np.int64(0)), None, None),
        (lambda x: nv.quantize(x, stream=1.5), TypeError, "stream must be an int"),
        (lambda x: nv.quantize(x, rht="yes"), TypeError, "rht must be True or"),
        (lambda x: nv.quantize(x, block=None), ValueError, "block must be"),
        (lambda x: nv.quantize(x, block=["1x16"]), ValueError, "block must be"),
        (lambda x: nv.quantize(x, rounding=1), ValueError, "rounding must be"),
        (lambda x: nv.quantize(x, implementation=0), ValueError, "implementation"),
        (lambda x: nv.quantize(x, amax="1"), TypeError, "amax must be a float32"),
        (lambda x: nv.global_amax(x, axis=1.0), TypeError, "axis must be an int"),
        (lambda x: nv.global_amax(x, rht=1), TypeError, "rht must be True or"),
        (
            lambda x: nv.quantize_rowwise_and_columnwise(x, col_stream=2.0),
            TypeError,
            "col_stream must be an int",
        ),
        (
            lambda x: nv.quantize_rowwise_and_columnwise(x, row_block="2d"),
            ValueError,
            "row_block must be",
        ),
        (
            lambda x: nv.matmul(nv.quantize(x), nv.quantize(x), out_dtype="half4"),
            TypeError,
            "out_dtype must be bfloat16 or float32, got 'half4'",
        ),
        (
            lambda x: nv.matmul(nv.quantize(x), nv.quantize(x), out_dtype=jnp.int8),
            TypeError,
            "out_dtype must be bfloat16 or float32, got int8",
        ),
        (
            lambda x: nv.matmul(
                x.astype(jnp.bfloat16), nv.quantize(x), implementation="x"
            ),
            ValueError,
            "implementation must be",
        ),
        (
            lambda x: nv.dequantize(nv.quantize(x), "half4"),
            TypeError,
            "float32, bfloat16 or float16, not 'half4'",
        ),
        (lambda x: nv.dot(x, x.T, key=0), ValueError, "key must be"),
        (lambda x: nv.dot(x, nv.quantize(x.T, 0)), TypeError, "NVFP4Tensor.*matmul"),
        (lambda x: nv.dot(x, {"w": 1}), TypeError, "w is a dict"),
    ],
)
def test_arguments_of_the_wrong_type_say_so(call, error, match):
    x = _x(0, (32, 32))
    if error is None:
        call(x)
        return
    with pytest.raises(error, match=match):
        call(x)


def test_lists_are_arrays():
    """As jnp.dot: nested lists (and NumPy arrays) are accepted everywhere
    an array is."""
    x, w = _x(0, (16, 32)), _x(1, (32, 16))
    want = nv.dot(x, w, recipe=nv.NVFP4_NO_SR)
    lx, lw = np.asarray(x).tolist(), np.asarray(w).tolist()
    for got in (
        nv.dot(lx, lw, recipe=nv.NVFP4_NO_SR),
        nv.dot(np.asarray(x), lw, recipe=nv.NVFP4_NO_SR),
        nv.dot_general(lx, lw, (((1,), (0,)), ((), ())), recipe=nv.NVFP4_NO_SR),
        nv.dot_general(
            x, np.asarray(w), (((1,), (0,)), ((), ())), recipe=nv.NVFP4_NO_SR
        ),
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert_same_bytes(nv.quantize(lx), nv.quantize(x))
    w_nk = nv.quantize(jnp.asarray(w.T, jnp.bfloat16))
    np.testing.assert_array_equal(
        np.asarray(nv.matmul(np.asarray(x, jnp.bfloat16), w_nk)),
        np.asarray(nv.matmul(x.astype(jnp.bfloat16), w_nk)),
    )


# --------------------------------------------- an Equinox forward without key


def test_equinox_forward_without_key_runs_like_dot():
    """dot, linen and NNX run their forward pass without a key and raise on
    the gradient; so do the Equinox layers, with the same outputs as with a
    key (stochastic rounding is for dY only)."""
    key = jax.random.key(0)
    lin = eqx.nn.Linear(32, 16, key=key)
    layer = nveqx.Linear.from_linear(lin, nv.NVFP4)
    x = _x(1, (8, 32))
    y = jax.jit(jax.vmap(layer))(x)
    np.testing.assert_array_equal(
        np.asarray(y), np.asarray(jax.vmap(lambda t: layer(t, key=key))(x))
    )
    np.testing.assert_array_equal(
        np.asarray(y),
        np.asarray(nv.dot(x, lin.weight.T, recipe=nv.NVFP4_NO_SR) + lin.bias),
    )
    with pytest.raises(ValueError, match="Linear was differentiated without a key"):
        eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x)))(layer)

    experts = nveqx.Experts(2, 32, 16, key=key).with_recipe(nv.NVFP4)
    sizes = jnp.array([5, 3], jnp.int32)
    out = experts(x, sizes)
    np.testing.assert_array_equal(
        np.asarray(out), np.asarray(experts(x, sizes, key=key))
    )
    with pytest.raises(ValueError, match="Experts was differentiated without a key"):
        eqx.filter_grad(lambda m: jnp.sum(m(x, sizes)))(experts)


# ------------------------------------------------- the Equinox MoE example


def test_equinox_moe_example_counts_its_expert_layers():
    from nvfp4_examples import llama_equinox as example

    model = example.Llama(
        d_model=32, layers=2, heads=2, ffn=64, experts=4, key=jax.random.key(0)
    )
    model = nveqx.convert(
        model, transformer_policy(2, keep_last=0, bf16_patterns=("*router*",))
    )
    total, converted = example.count_nvfp4_layers(model)
    # Per block: q, k, v, o, the router and 3 expert projections; the head.
    assert total == 2 * 8 + 1
    assert converted == 2 * 3  # the expert projections; attention in bf16
