"""jax_nvfp4.dot: the FPROP/DGRAD/WGRAD recipe against a pure-JAX reference of
the same recipe, the bf16 switches against jnp.dot, and a short training run."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import on_cpu, outlier_data

import jax_nvfp4 as nv
from jax_nvfp4 import config


def _loss(recipe, key):
    def f(x, w, g):
        return jnp.sum(nv.dot(x, w, key=key, recipe=recipe).astype(jnp.float32) * g)

    return f


@pytest.mark.parametrize("tokens", [64, 40])
@pytest.mark.parametrize(
    "recipe", [nv.NVFP4, nv.NVFP4_NO_RHT, nv.NVFP4_NO_SR, nv.Recipe(weight_2d=False)]
)
def test_recipe_matches_pure_jax_reference(tokens, recipe):
    x = outlier_data(0, (tokens, 64), jnp.float32)
    w = outlier_data(1, (64, 32), jnp.float32) * 0.1
    g = outlier_data(2, (tokens, 32), jnp.float32)
    key = jax.random.key(3)
    ref = dataclasses.replace(recipe, implementation="reference")
    got = jax.jit(jax.value_and_grad(_loss(recipe, key), argnums=(0, 1)))(x, w, g)
    # The oracle is the reference on the CPU (exact IEEE float32 in XLA:CPU).
    want = on_cpu(jax.value_and_grad(_loss(ref, key), argnums=(0, 1)), x, w, g)
    # Identical quantized operands; the GEMMs differ only in float32
    # accumulation order (|error| <= K * 2^-23 * sum |terms|, far below 1e-4
    # relative here).
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(jnp.abs(b).max()))


@pytest.mark.parametrize("operands", ["auto", "decoded", "codes"])
@pytest.mark.parametrize("recipe", [nv.NVFP4, nv.NVFP4_NO_RHT])
def test_recipe_bf16_matches_pure_jax_reference(recipe, operands):
    """bfloat16 activations and weights (on a GPU: the paired-lane quantize
    kernel for X, dY and the 2D weights, and GEMMs writing bfloat16):
    y, dx and dw equal the reference's up to one bfloat16 rounding of float32
    sums that differ only in accumulation order (on the CPU: bit for bit).
    Another stochastic-rounding key moves half of dx's and most of dw's
    elements by more than this bound. operands: the recipe's own choice
    (on a Hopper GPU: the fused quantize writes x's and dY's bf16 GEMM
    operands), that forced on (on the CPU: the pure-JAX twin of the decoded
    quantize and the GEMM on decoded operands), or codes throughout
    (the setting ``gemm_operands``)."""
    x = outlier_data(0, (64, 64), jnp.bfloat16)
    w = outlier_data(1, (64, 32), jnp.bfloat16) * 0.1
    dy = outlier_data(2, (64, 32), jnp.bfloat16)
    key = jax.random.key(3)
    ref = dataclasses.replace(recipe, implementation="reference")

    def step(recipe):
        def f(x, w, dy):
            y, vjp = jax.vjp(lambda x, w: nv.dot(x, w, key=key, recipe=recipe), x, w)
            return (y, *vjp(dy))

        return f

    with config.override(gemm_operands=operands):
        got = jax.jit(step(recipe))(x, w, dy)
    want = on_cpu(step(ref), x, w, dy)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # One bfloat16 ulp (<= 2^-7 relative) per element, plus the float32
        # reordering error (~K * 2^-24 * sum |terms|) where sums cancel.
        np.testing.assert_allclose(a, b, rtol=2**-7, atol=1e-4 * np.abs(b).max())


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("recipe", [nv.NVFP4, nv.NVFP4_NO_RHT])
def test_decoded_operands_give_the_codes_bits(recipe, out_dtype):
    """The recipe with its GEMM-only operands forced decoded (x's rows, both
    of dY's copies as bfloat16 values) equals it with codes throughout, bit
    for bit on the CPU: y, dx and dw."""
    x = outlier_data(6, (48, 64), jnp.bfloat16)
    w = outlier_data(7, (64, 32), jnp.bfloat16) * 0.1
    dy = outlier_data(8, (48, 32), out_dtype)
    key = jax.random.key(9)

    def step(x, w, dy):
        def f(x, w):
            return nv.dot(
                x, w, key=key, recipe=recipe, preferred_element_type=out_dtype
            )

        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(dy))

    results = {}
    for form in ("codes", "decoded"):
        with config.override(gemm_operands=form):
            jaxpr = str(jax.make_jaxpr(step)(x, w, dy))
            assert ("decoded=True" in jaxpr) == (form == "decoded")
            results[form] = on_cpu(jax.jit(step), x, w, dy)
    for a, b in zip(results["decoded"], results["codes"], strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
        )


def test_bf16_recipe_is_jnp_dot():
    x = jax.random.normal(jax.random.key(0), (3, 16, 32), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (32, 48), jnp.bfloat16)

    def ref(x, w):
        return jnp.sum(jnp.dot(x, w).astype(jnp.float32) ** 2)

    def ours(x, w):
        return jnp.sum(nv.dot(x, w, recipe=nv.BF16).astype(jnp.float32) ** 2)

    np.testing.assert_array_equal(nv.dot(x, w, recipe=nv.BF16), jnp.dot(x, w))
    for a, b in zip(
        jax.grad(ours, (0, 1))(x, w), jax.grad(ref, (0, 1))(x, w), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_forward_is_fp4_gemm_of_quantized_operands():
    x = outlier_data(4, (32, 64), jnp.float32)
    w = outlier_data(5, (64, 16), jnp.float32)
    y = nv.dot(x, w, recipe=nv.NVFP4_NO_SR)
    xq = nv.dequantize(nv.quantize(x), jnp.float32)
    wq = nv.dequantize(nv.quantize(w, 0, block="16x16"), jnp.float32)
    np.testing.assert_allclose(y, xq @ wq, rtol=1e-5, atol=1e-4)


def test_leading_dims_vmap_jit():
    x = jax.random.normal(jax.random.key(0), (2, 3, 16, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (32, 16), jnp.float32)
    key = jax.random.key(2)
    y = nv.dot(x, w, key=key)
    assert y.shape == (2, 3, 16, 16)
    np.testing.assert_allclose(
        y.reshape(-1, 16), nv.dot(x.reshape(-1, 32), w, key=key), rtol=0, atol=0
    )
    vm = jax.jit(jax.vmap(lambda xi: nv.dot(xi, w, key=key)))(x[0])
    assert vm.shape == (3, 16, 16)


def test_errors():
    x = jnp.ones((16, 32))
    with pytest.raises(ValueError, match="key=jax.random.key"):
        jax.grad(lambda x: jnp.sum(nv.dot(x, jnp.ones((32, 16)))))(x)
    with pytest.raises(ValueError, match="multiples of 16"):
        nv.dot(x, jnp.ones((32, 20)), recipe=nv.NVFP4_NO_SR)
    with pytest.raises(TypeError, match="cast both"):
        nv.dot(x, jnp.ones((32, 16), jnp.bfloat16), recipe=nv.NVFP4_NO_SR)
    with pytest.raises(ValueError, match="K=32 features"):
        nv.dot(x, jnp.ones((16, 16)), recipe=nv.NVFP4_NO_SR)


def test_mlp_trains_close_to_bf16():
    """A 2-layer MLP on a synthetic regression task: NVFP4 within a few % of
    the float32/bf16-GEMM loss after a few hundred steps."""
    k_data, k_init = jax.random.split(jax.random.key(0))
    d_in, d_hidden, d_out, n = 32, 64, 16, 1024
    teacher = jax.random.normal(k_data, (d_in, d_out)) / np.sqrt(d_in)

    def data(seed):
        xs = jax.random.normal(jax.random.key(seed), (n, d_in))
        # Noisy targets (variance 0.25): an irreducible loss, as real data has.
        noise = 0.5 * jax.random.normal(jax.random.key(seed + 1), (n, d_out))
        return xs, jnp.tanh(xs @ teacher) + 0.5 * (xs @ teacher) + noise

    xs, ys = data(1)
    test_xs, test_ys = data(3)
    k1, k2 = jax.random.split(k_init)
    params0 = (
        jax.random.normal(k1, (d_in, d_hidden)) / np.sqrt(d_in),
        jax.random.normal(k2, (d_hidden, d_out)) / np.sqrt(d_hidden),
    )

    def train(recipe, steps=300, lr=0.3):
        def loss(params, key, xs=xs, ys=ys):
            k1, k2 = jax.random.split(key)
            h = jax.nn.gelu(nv.dot(xs, params[0], key=k1, recipe=recipe))
            out = nv.dot(h, params[1], key=k2, recipe=recipe)
            return jnp.mean((out - ys) ** 2)

        @jax.jit
        def step(params, key):
            value, grads = jax.value_and_grad(loss)(params, key)
            return jax.tree.map(lambda p, g: p - lr * g, params, grads), value

        params = params0
        for i in range(steps):
            params, value = step(params, jax.random.key(100 + i))
        # Held-out loss with the recipe's own forward pass, and with an exact
        # float32 forward pass (the quality of the trained weights).
        exact = jnp.mean((jax.nn.gelu(test_xs @ params[0]) @ params[1] - test_ys) ** 2)
        return float(loss(params, jax.random.key(0), test_xs, test_ys)), float(exact)

    (fp4, fp4_weights), (ref, ref_weights) = train(nv.NVFP4), train(nv.BF16)
    assert np.isfinite(fp4)
    assert ref < 0.45  # held-out; the noise floor is 0.25
    # The bounds leave room above what the FP4 forward and weights cost here.
    assert fp4_weights <= ref_weights * 1.04, (fp4_weights, ref_weights)
    assert fp4 <= ref * 1.10, (fp4, ref)


def _residual_bytes(recipe, x, w, key):
    _, vjp_fn = jax.vjp(lambda x, w: nv.dot(x, w, key=key, recipe=recipe), x, w)
    return sum(leaf.nbytes for leaf in jax.tree.leaves(vjp_fn))


def test_residuals_are_fp4():
    """Bytes kept for the backward pass: <= 0.3x the bf16 recipe's."""
    x = jnp.ones((256, 512), jnp.bfloat16)
    w = jnp.ones((512, 1024), jnp.bfloat16)
    key = jax.random.key(0)
    fp4 = _residual_bytes(nv.NVFP4, x, w, key)
    bf16 = _residual_bytes(nv.BF16, x, w, key)
    assert bf16 >= (x.nbytes + w.nbytes)
    assert fp4 <= 0.3 * bf16, (fp4, bf16)  # 0.5625 / 2 = 0.28 (+ two amaxes)


def test_dot_general_drop_in():
    x = jax.random.normal(jax.random.key(0), (2, 16, 32), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (32, 16), jnp.bfloat16)
    dn = (((2,), (0,)), ((), ()))
    dg = functools.partial(nv.dot_general, recipe=nv.NVFP4_NO_SR)
    y = dg(x, w, dn, precision=None, preferred_element_type=jnp.float32)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(
        y.astype(jnp.bfloat16), nv.dot(x, w, recipe=nv.NVFP4_NO_SR)
    )
    # The bf16 recipe through dot_general equals lax.dot_general.
    np.testing.assert_array_equal(
        nv.dot_general(x, w, dn, recipe=nv.BF16), jax.lax.dot_general(x, w, dn)
    )
    grads = jax.grad(lambda w: jnp.sum(dg(x, w, dn).astype(jnp.float32)))(w)
    assert grads.dtype == w.dtype and grads.shape == w.shape
    # A weight stored [N, K] is the same product.
    np.testing.assert_array_equal(
        dg(x, w.T, (((2,), (1,)), ((), ()))), nv.dot(x, w, recipe=nv.NVFP4_NO_SR)
    )


def test_higher_order_derivatives_raise_clearly():
    x = jnp.ones((16, 32))
    w = jnp.ones((32, 16))

    def f(w):
        return jnp.sum(nv.dot(x, w, recipe=nv.NVFP4_NO_SR))

    with pytest.raises(
        NotImplementedError, match="Higher-order derivatives of jax_nvfp4.dot"
    ):
        jax.grad(lambda w: jnp.sum(jax.grad(f)(w) ** 2))(w)
    with pytest.raises(NotImplementedError, match="no derivative"):
        jax.jvp(lambda x: nv.quantize(x).codes, (x,), (x,))


def test_forward_mode_raises_naming_reverse_mode():
    x = jnp.ones((16, 32))
    w = jnp.ones((32, 16))

    def f(w):
        return nv.dot(x, w, recipe=nv.NVFP4_NO_SR)

    for forward_mode in (
        lambda: jax.jvp(f, (w,), (w,)),
        lambda: jax.jacfwd(lambda w: jnp.sum(f(w)))(w),
        lambda: jax.jit(lambda w: jax.jvp(f, (w,), (w,)))(w),
        lambda: jax.jvp(
            lambda x: nv.dot_general(
                x, w, (((1,), (0,)), ((), ())), key=jax.random.key(0)
            ),
            (x,),
            (x,),
        ),
    ):
        with pytest.raises(TypeError, match=r"not a JVP.*jax.grad / jax.vjp"):
            forward_mode()
    # Reverse mode, and a jvp whose tangent does not reach the product, work.
    assert jax.jacrev(lambda w: jnp.sum(f(w), 0))(w).shape == (16, 32, 16)
    _, tangent = jax.jvp(lambda s: s * jnp.sum(f(w)), (1.0,), (1.0,))
    assert tangent == jnp.sum(f(w))


def test_disable_jit_runs_the_same_bits():
    """Under jax.disable_jit the primitives still run (compiled one by one),
    with the bits of the jitted step."""
    x = _normal_for_disable_jit(0, (32, 32))
    w = _normal_for_disable_jit(1, (32, 16))

    def step(w):
        return jax.value_and_grad(
            lambda w: jnp.sum(nv.dot(x, w, key=jax.random.key(3)))
        )(w)

    want = jax.jit(step)(w)
    with jax.disable_jit():
        got = step(w)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, r)


def _normal_for_disable_jit(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def test_dot_runs_the_handlers_on_the_default_backend():
    """The compiled training step calls the quantize handlers (not their
    pure-JAX twins) wherever handlers exist for the default backend."""
    platform = jax.default_backend()
    platform = "cuda" if platform == "gpu" else platform
    if platform not in nv.available_platforms():
        pytest.skip(f"no handlers for {platform}")
    x = jnp.ones((64, 64), jnp.float32)
    w = jnp.ones((64, 32), jnp.float32)
    g = jnp.ones((64, 32), jnp.float32)
    step = jax.jit(jax.value_and_grad(_loss(nv.NVFP4, jax.random.key(0)), (0, 1)))
    hlo = step.lower(x, w, g).compile().as_text()
    assert hlo.count("jax_nvfp4_quantize_rows_cols") >= 3, "x, w and dY quantizations"
    assert "jax_nvfp4_amax" in hlo


@pytest.mark.parametrize("form", ["codes", "decoded"])
@pytest.mark.parametrize("nk", [False, True])
@pytest.mark.parametrize(
    "recipe", [nv.NVFP4, nv.NVFP4_NO_RHT, nv.Recipe(fprop=False)], ids=str
)
def test_undifferentiated_forward_quantizes_fprop_operands_alone(recipe, nk, form):
    """Without differentiation (an eval step), where the GEMM reads codes,
    only FPROP's operands are quantized: no transformed amax, no column-wise
    x, no DGRAD weight. Where it reads decoded operands, the forward pass is
    the differentiated one (its fused pass writes x's decoded rows). The
    output bytes are the differentiated forward's."""
    x = outlier_data(3, (40, 64), jnp.bfloat16)
    w = outlier_data(4, (32, 64) if nk else (64, 32), jnp.bfloat16)
    key = jax.random.key(5)

    def forward(x, w):
        if nk:
            dims = (((1,), (1,)), ((), ()))
            return nv.dot_general(x, w, dims, key=key, recipe=recipe)
        return nv.dot(x, w, key=key, recipe=recipe)

    with config.override(gemm_operands=form):
        alone = jax.jit(forward)(x, w)
        differentiated, _ = jax.jit(lambda x, w: jax.vjp(forward, x, w))(x, w)
        hlo = jax.jit(forward).lower(x, w).compile().as_text()
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(differentiated))
    if not nv.available_platforms():
        return  # the twins: no custom calls to count
    if not recipe.fprop:  # FPROP in bf16: nothing to quantize forward
        assert form == "decoded" or "jax_nvfp4_quantize" not in hlo
        return
    fused = "jax_nvfp4_quantize_rows_cols" in hlo
    assert fused == (form == "decoded")
    if form == "codes":
        assert 'jax_nvfp4_amax"' not in hlo, "no transformed amax"
        quantizations = hlo.count('custom_call_target="jax_nvfp4_quantize_')
        assert quantizations == 2, "x, and w along K"
