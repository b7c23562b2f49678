"""Bad input gets a ValueError/TypeError that says what to change: every
message of the public entry points, raised at trace time. (Errors of one
feature's own options live beside its tests; this file holds the entry
points' argument checks.)"""

import jax
import jax.numpy as jnp
import pytest

import jax_nvfp4 as nv


@pytest.mark.parametrize(
    "kwargs,x,error,match",
    [
        ({}, jnp.zeros((4, 100)), ValueError, "axis 1 has length 100.*multiple of 16"),
        ({"axis": 0}, jnp.zeros((20, 32)), ValueError, "axis 0 has length 20"),
        (
            {"block": "16x16"},
            jnp.zeros((8, 32)),
            ValueError,
            "axis 0 has length 8.*tile",
        ),
        ({"block": "16x16"}, jnp.zeros((32,)), ValueError, "rank >= 2"),
        ({"block": "2x2"}, jnp.zeros((16, 32)), ValueError, "block must be"),
        ({}, jnp.zeros((4, 32), jnp.int32), TypeError, "dtype int32.*astype"),
        ({}, jnp.zeros((4, 32), jnp.complex64), TypeError, "dtype complex64"),
        ({}, jnp.zeros(()), ValueError, "scalar"),
        ({"axis": 2}, jnp.zeros((4, 32)), ValueError, "out of range"),
        (
            {"rounding": "stochastic"},
            jnp.zeros((4, 32)),
            ValueError,
            "needs a PRNG key",
        ),
        ({"rounding": "up"}, jnp.zeros((4, 32)), ValueError, "rounding must be"),
        (
            {"amax": jnp.ones(3)},
            jnp.zeros((4, 32)),
            ValueError,
            "amax must be a scalar",
        ),
        ({"amax": 3}, jnp.zeros((4, 32)), TypeError, "amax must be a float"),
        ({"stream": 300}, jnp.zeros((4, 32)), ValueError, "stream must be"),
        ({"implementation": "gpu"}, jnp.zeros((4, 32)), ValueError, "implementation"),
        (
            {"rounding": "stochastic", "key": jax.random.split(jax.random.key(0), 2)},
            jnp.zeros((4, 32)),
            ValueError,
            "single PRNG key",
        ),
        (
            {"rounding": "stochastic", "key": jnp.zeros(3, jnp.uint32)},
            jnp.zeros((4, 32)),
            ValueError,
            "uint32\\[2\\]",
        ),
    ],
)
def test_quantize_rejects(kwargs, x, error, match):
    with pytest.raises(error, match=match):
        nv.quantize(x, **kwargs)


def test_fused_rejects():
    with pytest.raises(ValueError, match="rank 1"):
        nv.quantize_rowwise_and_columnwise(jnp.zeros(32))
    with pytest.raises(ValueError, match="axis 0 has length 24"):
        nv.quantize_rowwise_and_columnwise(jnp.zeros((24, 32)))
    with pytest.raises(ValueError, match="needs a PRNG key"):
        nv.quantize_rowwise_and_columnwise(
            jnp.zeros((32, 32)), col_rounding="stochastic"
        )


def test_dequantize_rejects():
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        nv.dequantize(jnp.zeros((4, 32)))
    t = nv.quantize(jnp.ones((4, 32)))
    with pytest.raises(TypeError, match="int8"):
        nv.dequantize(t, jnp.int8)


def test_nvfp4_tensor_holds_codes_only():
    """An NVFP4Tensor's codes are packed uint8 codes: other arrays (e.g. the
    bfloat16 values e2m1 * scale) are refused, eager and traced; the
    placeholder leaves JAX rebuilds pytrees with still pass."""
    t = nv.quantize(jnp.ones((32, 32), jnp.bfloat16))
    values = jnp.ones((32, 32), jnp.bfloat16)

    def wrap(codes):
        return nv.NVFP4Tensor(codes, t.scales, t.amax, t.shape, t.axis)

    message = "NVFP4Tensor.codes must be packed uint8.*got bfloat16 \\(32, 32\\)"
    with pytest.raises(TypeError, match=message):
        wrap(values)
    with pytest.raises(TypeError, match="codes must be packed uint8"):
        jax.jit(lambda v: wrap(v).amax)(values)
    assert jax.eval_shape(lambda t: t, t).codes.dtype == jnp.uint8
    assert jax.tree.map(lambda a: None, t, is_leaf=lambda a: a is None).codes is None
    axes = jax.tree.map(lambda a: 0, t)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), t)
    assert jax.vmap(lambda t: t.amax, in_axes=(axes,))(stacked).shape == (2,)
    tangent = jax.grad(lambda t: t.amax * 2, allow_int=True)(t)
    assert tangent.codes.dtype == jax.dtypes.float0


def test_errors_under_jit():
    with pytest.raises(ValueError, match="multiple of 16"):
        jax.jit(nv.quantize)(jnp.zeros((4, 40)))


@pytest.mark.parametrize(
    "fields, error, message",
    [
        (dict(rht="yes"), TypeError, "Recipe.rht must be True or False"),
        (dict(fprop=1), TypeError, "Recipe.fprop must be True or False"),
        (dict(implementation="cuda"), ValueError, "'ffi' or 'reference'"),
        (
            dict(fprop=False, dgrad=False, wgrad=False),
            ValueError,
            "every GEMM in bf16",
        ),
        (dict(dgrad=False, wgrad=False), ValueError, "set stochastic_rounding"),
    ],
)
def test_recipe_fields_are_checked(fields, error, message):
    with pytest.raises(error, match=message):
        nv.Recipe(**fields)


def test_presets_are_valid():
    assert not nv.BF16.needs_key
    nv.Recipe(dgrad=False, wgrad=False, stochastic_rounding=False)


@pytest.mark.parametrize("recipe", [None, "nvfp4", 0])
def test_recipe_must_be_a_recipe(recipe):
    x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    with pytest.raises(TypeError, match="recipe must be a jax_nvfp4.Recipe"):
        nv.dot(x, w, recipe=recipe)


def test_key_must_be_a_key():
    x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    with pytest.raises(ValueError, match="key must be"):
        nv.dot(x, w, key=0)


@pytest.mark.parametrize("amax", [0.0, -1.0, float("inf"), float("nan")])
def test_concrete_amax_must_be_finite_and_positive(amax):
    with pytest.raises(ValueError, match="finite, positive"):
        nv.quantize(jnp.ones((4, 32)), amax=amax)


def test_concrete_zero_amax_of_a_zero_tensor_is_valid():
    t = nv.quantize(jnp.zeros((4, 32)), amax=0.0)
    assert float(t.amax) == 0.0
    assert not jnp.any(nv.dequantize(t, jnp.float32))


def test_traced_amax_is_accepted():
    x = jnp.ones((4, 32))
    t = jax.jit(lambda x, a: nv.quantize(x, amax=a))(x, jnp.float32(2.0))
    assert t.amax == 2.0


def test_key_with_nearest_rounding_warns():
    with pytest.warns(UserWarning, match="ignored"):
        nv.quantize(jnp.ones((4, 32)), key=jax.random.key(0))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.bool_, jnp.complex64])
def test_products_refuse_operands_the_recipe_cannot_quantize(dtype):
    """Integer, bool and complex operands get a TypeError before any handler
    runs, eagerly and under jit (not a runtime error from the handler, nor an
    unchecked result); the bf16 recipe passes them to XLA."""
    x, w = jnp.ones((32, 64), dtype), jnp.ones((64, 32), dtype)
    with pytest.raises(TypeError, match=f"are {jnp.dtype(dtype)}.*cast them"):
        nv.dot(x, w)
    with pytest.raises(TypeError, match="cast them"):
        jax.jit(nv.dot)(x, w)
    with pytest.raises(TypeError, match="cast them"):
        nv.dot_general(x, w, (((1,), (0,)), ((), ())))
    if dtype != jnp.bool_:
        assert nv.dot(x, w, recipe=nv.BF16).dtype == dtype
