"""jax_nvfp4.qwix: the NVFP4 recipe as a qwix provider, on Flax linen and NNX.

The model is a Gemma/MaxText-shaped decoder block: einsum projections
query/key/value ([E, N, H] kernels, "BTD,DNH->BTNH") and out ([N, H, E],
"BTNH,NHD->BTD"), attention scores and values as activation x activation
einsums, and a SwiGLU MLP (wi_0, wi_1, wo). The quantized model uses stock
Flax modules; its reference is the same model with each projection computed
by ``jax_nvfp4.dot_general`` directly, with the key the provider would draw.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

qwix = pytest.importorskip("qwix")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_nvfp4  # noqa: E402
from jax_nvfp4.qwix import NvFp4Provider, NvFp4Rule, set_rngs  # noqa: E402

B, T, E, N, H, F = 2, 16, 32, 2, 16, 64
DTYPE = jnp.bfloat16
QKV = "BTD,DNH->BTNH"
OUT = "BTNH,NHD->BTD"
init = nn.initializers.normal(0.1)


def _bits(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))


def assert_bitwise_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        if x.dtype == jnp.bfloat16:
            np.testing.assert_array_equal(_bits(x), _bits(y))
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def attention(q, k, v):
    scores = jnp.einsum("BTNH,BSNH->BNTS", q, k) / jnp.sqrt(H).astype(q.dtype)
    causal = jnp.tril(jnp.ones((T, T), bool))
    scores = jnp.where(causal, scores.astype(jnp.float32), -1e9)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("BNTS,BSNH->BTNH", probs, v)


def rms(x, scale):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    return (x32 * (1 + scale)).astype(x.dtype)


def make_data(seed=0):
    kx, ky = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (B, T, E), jnp.float32).astype(DTYPE)
    return x, jax.random.normal(ky, (B, T, E), jnp.float32)


def mse(y, target):
    return jnp.mean((y.astype(jnp.float32) - target) ** 2)


# ---------------------------------------------------------------- linen


class DirectEinsum(nn.Module):
    """The reference projection: nn.Einsum's kernel, product by jax_nvfp4."""

    shape: tuple
    einsum_str: str
    recipe: jax_nvfp4.Recipe = jax_nvfp4.NVFP4

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", init, self.shape, jnp.float32).astype(DTYPE)
        key = self.make_rng("nvfp4") if self.has_rng("nvfp4") else None
        dg = functools.partial(jax_nvfp4.dot_general, recipe=self.recipe, key=key)
        return jnp.einsum(self.einsum_str, x.astype(DTYPE), kernel, _dot_general=dg)


class DirectDense(nn.Module):
    """The reference of nn.DenseGeneral(features, use_bias=False)."""

    features: int
    recipe: jax_nvfp4.Recipe = jax_nvfp4.NVFP4

    @nn.compact
    def __call__(self, x):
        shape = (x.shape[-1], self.features)
        kernel = self.param("kernel", init, shape, jnp.float32).astype(DTYPE)
        key = self.make_rng("nvfp4") if self.has_rng("nvfp4") else None
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        return jax_nvfp4.dot_general(
            x.astype(DTYPE), kernel, dims, recipe=self.recipe, key=key
        )


def stock_einsum(shape, einsum_str, name):
    return nn.Einsum(
        shape, einsum_str, use_bias=False, dtype=DTYPE, kernel_init=init, name=name
    )


def stock_dense(features, name):
    return nn.DenseGeneral(
        features, use_bias=False, dtype=DTYPE, kernel_init=init, name=name
    )


def direct_einsum(shape, einsum_str, name):
    return DirectEinsum(shape, einsum_str, name=name)


def direct_dense(features, name):
    return DirectDense(features, name=name)


class LinenBlock(nn.Module):
    """Pre-norm attention + SwiGLU MLP, MaxText's module names. ``direct``
    names the projections computed by jax_nvfp4 directly ("attn", "mlp")."""

    direct: tuple = ()

    @nn.compact
    def __call__(self, x):
        attn_dir = "attn" in self.direct
        mlp_dir = "mlp" in self.direct
        einsum = direct_einsum if attn_dir else stock_einsum
        dense = direct_dense if mlp_dir else stock_dense
        scale = self.param("pre_norm", nn.initializers.zeros, (E,))
        h = rms(x, scale)
        q = einsum((E, N, H), QKV, "query")(h)
        k = einsum((E, N, H), QKV, "key")(h)
        v = einsum((E, N, H), QKV, "value")(h)
        x = x + einsum((N, H, E), OUT, "out")(attention(q, k, v))
        scale = self.param("post_norm", nn.initializers.zeros, (E,))
        h = rms(x, scale)
        gate = dense(F, "wi_0")(h)
        up = dense(F, "wi_1")(h)
        return x + dense(E, "wo")(jax.nn.silu(gate) * up)


class LinenModel(nn.Module):
    direct: tuple = ()

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = LinenBlock(self.direct, name=f"layers_{i}")(x)
        return x


def linen_setup(rules, **provider_kwargs):
    x, target = make_data()
    model = LinenModel()
    params = model.init(jax.random.key(1), x)
    qmodel = qwix.quantize_model(model, NvFp4Provider(rules, **provider_kwargs))
    return qmodel, params, x, target


def linen_loss(model, params, x, target, key):
    return mse(model.apply(params, x, rngs={"nvfp4": key}), target)


ALL = [NvFp4Rule(module_path=".*")]


def test_linen_matches_direct_dot_general():
    qmodel, params, x, target = linen_setup(ALL)
    ref = LinenModel(direct=("attn", "mlp"))
    key = jax.random.key(7)
    apply = jax.jit(lambda m, p: m.apply(p, x, rngs={"nvfp4": key}), static_argnums=0)
    out = apply(qmodel, params)
    assert_bitwise_equal(out, apply(ref, params))
    # The same keys in the same modules: the gradients agree bit for bit too.
    grad = jax.jit(jax.grad(linen_loss, argnums=1), static_argnums=0)
    g = grad(qmodel, params, x, target, key)
    assert_bitwise_equal(g, grad(ref, params, x, target, key))
    # And NVFP4 is really on: the bf16 model differs.
    plain = apply(LinenModel(), params)
    assert not np.array_equal(_bits(out), _bits(plain))


def test_linen_rules_select_modules():
    x, _ = make_data()
    params = LinenModel().init(jax.random.key(1), x)
    apply = jax.jit(lambda m, p: m.apply(p, x), static_argnums=0)
    plain = apply(LinenModel(), params)

    # Only the MLP: the attention projections stay as in the bf16 model.
    mlp_only = qwix.quantize_model(
        LinenModel(), NvFp4Provider([NvFp4Rule(module_path=r".*/(wi_0|wi_1|wo)")])
    )
    assert_bitwise_equal(apply(mlp_only, params), apply(LinenModel(("mlp",)), params))

    # A rule without weight_qtype first excludes what it matches.
    attn_only = qwix.quantize_model(
        LinenModel(),
        NvFp4Provider([qwix.QtRule(module_path=r".*/w[io].*"), NvFp4Rule()]),
    )
    assert_bitwise_equal(apply(attn_only, params), apply(LinenModel(("attn",)), params))

    # No rule matches: bit-identical to the unquantized model.
    none = qwix.quantize_model(
        LinenModel(), NvFp4Provider([NvFp4Rule(module_path="nothing")])
    )
    assert_bitwise_equal(apply(none, params), plain)


def test_linen_training_and_keys():
    qmodel, params, x, target = linen_setup(ALL)
    grad = jax.jit(jax.value_and_grad(linen_loss, argnums=1), static_argnums=0)

    # The key is only read by the backward pass: one key, the same bits;
    # another key, other stochastic bits in the gradient.
    (l1, g1) = grad(qmodel, params, x, target, jax.random.key(1))
    (l1b, g1b) = grad(qmodel, params, x, target, jax.random.key(1))
    (l2, g2) = grad(qmodel, params, x, target, jax.random.key(2))
    assert_bitwise_equal((l1, g1), (l1b, g1b))
    assert l1 == l2
    kernels = ("layers_0", "wi_0", "kernel")
    a = g1["params"]
    b = g2["params"]
    for name in kernels:
        a, b = a[name], b[name]
    assert not np.array_equal(np.asarray(a), np.asarray(b))

    losses = []
    key = jax.random.key(0)
    for step in range(4):
        loss, g = grad(qmodel, params, x, target, jax.random.fold_in(key, step))
        losses.append(float(loss))
        params = jax.tree.map(lambda p, d: p - 0.5 * d, params, g)
    assert losses[-1] < losses[0], losses


def test_linen_without_key_is_forward_only():
    qmodel, params, x, target = linen_setup(ALL)
    apply = jax.jit(lambda p, rngs: qmodel.apply(p, x, rngs=rngs))
    # No "nvfp4" stream: the same forward pass.
    assert_bitwise_equal(apply(params, {}), apply(params, {"nvfp4": jax.random.key(0)}))
    grad = jax.jit(jax.grad(lambda p, m: mse(m.apply(p, x), target)), static_argnums=1)
    with pytest.raises(ValueError, match="rngs=\\{'nvfp4'"):
        grad(params, qmodel)
    # A recipe without stochastic rounding needs no key.
    provider = NvFp4Provider(ALL, recipe=jax_nvfp4.NVFP4_NO_SR)
    grad(params, qwix.quantize_model(LinenModel(), provider))


class WeightFirst(nn.Module):
    """Einsums that put the weight first, and an activation x activation
    einsum without batch dims, in one matched module."""

    direct: bool = False

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", init, (E, N, H), jnp.float32).astype(DTYPE)
        if self.direct:
            key = self.make_rng("nvfp4")
            dg = functools.partial(jax_nvfp4.dot_general, key=key)
            y = jnp.einsum(QKV, x, kernel, _dot_general=dg)
        else:
            y = jnp.einsum("DNH,BTD->BTNH", kernel, x)
        flat = y.reshape(B * T, N * H)
        gram = jnp.einsum("AK,CK->AC", flat, flat)  # stays bf16
        return y, gram


def test_weight_first_einsum_and_activation_products():
    x, _ = make_data()
    params = WeightFirst().init(jax.random.key(1), x)
    qmodel = qwix.quantize_model(WeightFirst(), NvFp4Provider(ALL))
    rngs = {"nvfp4": jax.random.key(3)}
    apply = jax.jit(lambda m, p: m.apply(p, x, rngs=rngs), static_argnums=0)
    (y, gram) = apply(qmodel, params)
    (y_ref, _) = apply(WeightFirst(direct=True), params)
    assert_bitwise_equal(y, y_ref)
    flat = y.reshape(B * T, N * H)
    assert_bitwise_equal(gram, jax.jit(lambda a: jnp.einsum("AK,CK->AC", a, a))(flat))


class Odd(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(24, use_bias=False, dtype=DTYPE, name="head")(x)


def test_shapes_not_multiple_of_16():
    x, _ = make_data()
    params = Odd().init(jax.random.key(1), x)
    strict = qwix.quantize_model(Odd(), NvFp4Provider(ALL))
    with pytest.raises(ValueError, match="head"):
        strict.apply(params, x)
    lenient = qwix.quantize_model(Odd(), NvFp4Provider(ALL, strict=False))
    with pytest.warns(UserWarning, match="unquantized"):
        out = lenient.apply(params, x)
    assert_bitwise_equal(out, Odd().apply(params, x))


def test_rules():
    provider = NvFp4Provider(
        [
            qwix.QtRule(module_path="a"),
            qwix.QtRule(module_path="b", weight_qtype="nvfp4", act_qtype="nvfp4"),
            NvFp4Rule(module_path="c", recipe=jax_nvfp4.NVFP4_NO_SR),
        ],
        recipe=jax_nvfp4.NVFP4_NO_RHT,
    )
    a, b, c = provider.rules
    assert a.weight_qtype is None
    assert isinstance(b, NvFp4Rule) and b.recipe == jax_nvfp4.NVFP4_NO_RHT
    assert c.recipe == jax_nvfp4.NVFP4_NO_SR
    for bad, match in [
        (qwix.QtRule(weight_qtype=jnp.int8), "weight_qtype"),
        (NvFp4Rule(act_qtype=jnp.float8_e4m3fn), "act_qtype"),
        (NvFp4Rule(bwd_qtype=jnp.float8_e5m2), "bwd_qtype"),
        (NvFp4Rule(tile_size=128), "tile_size"),
        (NvFp4Rule(bwd_stochastic_rounding="uniform"), "bwd_stochastic_rounding"),
    ]:
        with pytest.raises(ValueError, match=match):
            NvFp4Provider([bad])
    with pytest.raises(TypeError, match="Recipe"):
        NvFp4Provider([NvFp4Rule(recipe="nvfp4")])


# ------------------------------------------------------------------ NNX


class NNXDirectEinsum(nnx.Module):
    """The reference projection: keys from a shared nnx.Rngs, in call order
    (as the provider draws them from qwix_rngs)."""

    def __init__(self, einsum_str, shape, keys, *, rngs):
        self.einsum_str = einsum_str
        self.kernel = nnx.Param(init(rngs.params(), shape, jnp.float32))
        self.keys = keys

    def __call__(self, x):
        dg = functools.partial(jax_nvfp4.dot_general, key=self.keys.nvfp4())
        kernel = self.kernel[...].astype(DTYPE)
        return jnp.einsum(self.einsum_str, x.astype(DTYPE), kernel, _dot_general=dg)


class NNXBlock(nnx.Module):
    """``direct`` names the projections computed by jax_nvfp4 directly
    ("attn", "mlp"), with keys drawn from the nnx.Rngs ``keys``."""

    def __init__(self, *, rngs, keys=None, direct=()):
        def einsum(eq, shape, part):
            if part in direct:
                return NNXDirectEinsum(eq, shape, keys, rngs=rngs)
            return nnx.Einsum(eq, shape, dtype=DTYPE, kernel_init=init, rngs=rngs)

        def dense(k, n):
            if "mlp" in direct:
                return NNXDirectEinsum("BTD,DF->BTF", (k, n), keys, rngs=rngs)
            return nnx.LinearGeneral(
                k, n, use_bias=False, dtype=DTYPE, kernel_init=init, rngs=rngs
            )

        self.pre_norm = nnx.Param(jnp.zeros((E,)))
        self.query = einsum(QKV, (E, N, H), "attn")
        self.key = einsum(QKV, (E, N, H), "attn")
        self.value = einsum(QKV, (E, N, H), "attn")
        self.out = einsum(OUT, (N, H, E), "attn")
        self.post_norm = nnx.Param(jnp.zeros((E,)))
        self.wi_0 = dense(E, F)
        self.wi_1 = dense(E, F)
        self.wo = dense(F, E)

    def __call__(self, x):
        h = rms(x, self.pre_norm[...])
        o = attention(self.query(h), self.key(h), self.value(h))
        x = x + self.out(o)
        h = rms(x, self.post_norm[...])
        return x + self.wo(jax.nn.silu(self.wi_0(h)) * self.wi_1(h))


class NNXModel(nnx.Module):
    def __init__(self, *, rngs, keys=None, direct=((), ())):
        self.layers_0 = NNXBlock(rngs=rngs, keys=keys, direct=direct[0])
        self.layers_1 = NNXBlock(rngs=rngs, keys=keys, direct=direct[1])

    def __call__(self, x):
        return self.layers_1(self.layers_0(x))


def nnx_setup(rules=ALL, **provider_kwargs):
    x, target = make_data()
    model = NNXModel(rngs=nnx.Rngs(params=1))
    provider = NvFp4Provider(rules, **provider_kwargs)
    qmodel = qwix.quantize_model(model, provider, x)
    return model, qmodel, x, target


BOTH = ("attn", "mlp")


def nnx_reference(model, seed, direct=(BOTH, BOTH)):
    keys = nnx.Rngs(nvfp4=seed)
    ref = NNXModel(rngs=nnx.Rngs(params=0), keys=keys, direct=direct)
    nnx.update(ref, nnx.state(model, nnx.Param))
    return ref


@nnx.jit
def nnx_forward(model, x):
    return model(x)


@nnx.jit
def nnx_grad(model, x, target):
    return nnx.value_and_grad(lambda m: mse(m(x), target))(model)


def test_nnx_matches_direct_dot_general():
    model, qmodel, x, target = nnx_setup()
    set_rngs(qmodel, nnx.Rngs(nvfp4=5))
    ref = nnx_reference(model, 5)
    out = nnx_forward(qmodel, x)
    assert_bitwise_equal(out, nnx_forward(ref, x))
    assert not np.array_equal(_bits(out), _bits(nnx_forward(model, x)))
    # Both draw the keys of the same stream in the same order: the same
    # gradients bit for bit (the forward passes above drew keys too).
    set_rngs(qmodel, nnx.Rngs(nvfp4=6))
    ref = nnx_reference(model, 6)
    (lq, gq), (lr, gr) = nnx_grad(qmodel, x, target), nnx_grad(ref, x, target)
    assert_bitwise_equal(lq, lr)
    assert_bitwise_equal(nnx.to_pure_dict(gq), nnx.to_pure_dict(gr))


def test_nnx_rules_select_modules():
    model, qmodel, x, _ = nnx_setup(
        [NvFp4Rule(module_path=r"layers_1/(query|key|value|out)")]
    )
    out = nnx_forward(qmodel, x)
    # Only layers_1's attention projections are NVFP4; the rest as in bf16.
    assert_bitwise_equal(out, nnx_forward(nnx_reference(model, 0, ((), ("attn",))), x))
    assert not np.array_equal(_bits(out), _bits(nnx_forward(model, x)))
    none = qwix.quantize_model(
        model, NvFp4Provider([NvFp4Rule(module_path="nothing")]), x
    )
    assert_bitwise_equal(nnx_forward(none, x), nnx_forward(model, x))


def test_nnx_training_and_keys():
    _, qmodel, x, target = nnx_setup()
    with pytest.raises(ValueError, match="set_rngs"):
        nnx_grad(qmodel, x, target)  # no stream yet: forward only
    set_rngs(qmodel, nnx.Rngs(nvfp4=0))
    params = nnx.state(qmodel, nnx.Param)
    l1, g1 = nnx_grad(qmodel, x, target)
    l2, g2 = nnx_grad(qmodel, x, target)  # the stream moved on: new bits
    assert l1 == l2
    g1, g2 = nnx.to_pure_dict(g1), nnx.to_pure_dict(g2)
    a = np.asarray(g1["layers_0"]["wi_0"]["kernel"])
    assert not np.array_equal(a, np.asarray(g2["layers_0"]["wi_0"]["kernel"]))
    # Re-seeding the stream reproduces the first step.
    set_rngs(qmodel, nnx.Rngs(nvfp4=0))
    nnx.update(qmodel, params)
    _, g1b = nnx_grad(qmodel, x, target)
    assert_bitwise_equal(g1, nnx.to_pure_dict(g1b))

    @nnx.jit
    def sgd_step(model, x, target):
        loss, grads = nnx.value_and_grad(lambda m: mse(m(x), target))(model)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads))
        return loss

    losses = [float(sgd_step(qmodel, x, target)) for _ in range(4)]
    assert losses[-1] < losses[0], losses


def test_maxtext_example():
    """examples/maxtext_nvfp4.py trains both ways, bf16 beside NVFP4."""
    import maxtext_nvfp4  # examples/ is on the tests' path

    results = maxtext_nvfp4.main(["--steps", "3", "--layers", "1"])
    for losses in results.values():
        assert set(losses) == {"bf16", "nvfp4"}
        for run in losses.values():
            assert np.all(np.isfinite(run)) and run[-1] < run[0], losses
