"""Bad arguments to the public entry points raise at trace time with what to
change."""

import jax
import jax.numpy as jnp
import pytest

import jax_nvfp4 as nv


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
