"""The recipe's residual names under jax.checkpoint: save_fp4_residuals keeps
exactly the FP4 copies of x and w, so the backward pass quantizes neither
again, and what it keeps is a fraction of the bf16 activations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv

T, K, N = 64, 128, 256
KEY = jax.random.key(2)
policies = jax.checkpoint_policies


def _operands():
    x = jax.random.normal(jax.random.key(0), (T, K), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (K, N), jnp.bfloat16)
    c = jax.random.normal(jax.random.key(3), (T, N), jnp.float32)
    return x, w, c


def _loss(x, w, c):
    return jnp.sum(nv.dot(x, w, key=KEY).astype(jnp.float32) * c)


def _quantizations_in_grad(policy):
    x, w, c = _operands()
    f = _loss if policy is None else jax.checkpoint(_loss, policy=policy)
    jaxpr = str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w, c))
    return jaxpr.count("nvfp4_quantize")


@pytest.mark.parametrize(
    "policy, count",
    [
        (None, 3),  # x, w forward; dY backward
        (nv.save_fp4_residuals, 3),  # nothing recomputed
        (policies.nothing_saveable, 5),  # x and w quantized again
        (policies.dots_saveable, 5),  # the NVFP4 GEMMs are no dot_generals
    ],
)
def test_what_the_backward_recomputes(policy, count):
    assert _quantizations_in_grad(policy) == count


def test_save_fp4_residuals_keeps_the_fp4_copies_and_same_gradients():
    x, w, c = _operands()
    f = jax.checkpoint(_loss, policy=nv.save_fp4_residuals)
    _, vjp_fn = jax.vjp(lambda x, w: f(x, w, c), x, w)
    kept = [a for a in jax.tree.leaves(vjp_fn) if hasattr(a, "dtype")]
    fp4 = sum(a.nbytes for a in kept if a.dtype in (jnp.uint8, jnp.float8_e4m3fn))
    # x's column-wise copy and w's 16x16 copy: codes (1/2 byte) and scales
    # (1/16 byte) per element, against 2 bytes per element in bf16.
    assert fp4 == (T * K + K * N) * (1 / 2 + 1 / 16)
    assert fp4 <= 0.3 * (x.nbytes + w.nbytes)
    want = jax.grad(_loss, argnums=(0, 1))(x, w, c)
    got = jax.grad(f, argnums=(0, 1))(x, w, c)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_array_equal(
            np.asarray(g).view(np.uint16), np.asarray(r).view(np.uint16)
        )


def test_the_output_has_a_name_too():
    x, w, c = _operands()

    def model(x, w, c):
        return jnp.sum(jax.nn.gelu(nv.dot(x, w, key=KEY)).astype(jnp.float32) * c)

    keep_all = policies.save_only_these_names(nv.X_RESIDUAL, nv.W_RESIDUAL, nv.OUTPUT)
    for policy, count in ((nv.save_fp4_residuals, 5), (keep_all, 3)):
        f = jax.checkpoint(model, policy=policy)
        jaxpr = str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w, c))
        assert jaxpr.count("nvfp4_quantize") == count
