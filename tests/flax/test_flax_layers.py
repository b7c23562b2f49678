"""Flax integration: linen Dense and NNX Linear with the NVFP4 recipe match a
hand-written jax_nvfp4.dot reference, keys come from RNG streams, and the
policy converter leaves excluded layers bit-identical."""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_nvfp4 as nv
from jax_nvfp4.flax import LinenDotGeneral, NNXDotGeneral, convert, nvfp4_layers
from jax_nvfp4.flax import products as flax_products
from jax_nvfp4.policy import Policy, transformer_policy

BF16 = jnp.bfloat16
K, N = 32, 48


def _data(seed, shape, dtype=jnp.float32):
    # NumPy: no XLA compilation per shape, unlike eager jax.random.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _weights(seed):
    # Loss weights: a cotangent with many distinct values, so that stochastic
    # rounding of dY actually depends on the key.
    return _data(seed, (N,))


def assert_same(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape
    np.testing.assert_array_equal(a, b)


def assert_trees_same(a, b):
    jax.tree.map(assert_same, a, b)


def assert_trees_differ(a, b):
    leaves = jax.tree.leaves(jax.tree.map(lambda u, v: bool(jnp.any(u != v)), a, b))
    assert any(leaves)


def reference_dense(params, x, *, key, recipe):
    """The layer by hand: bf16 compute on fp32 master weights, then the bias."""
    w = params["kernel"].astype(BF16)
    b = params["bias"].astype(BF16)
    return nv.dot(x.astype(BF16), w, key=key, recipe=recipe) + b


# ----------------------------------------------------------------------- linen


@pytest.fixture
def recorded_keys(monkeypatch):
    """Records the key each NVFP4 layer call passes to the recipe."""
    keys = []
    inner = flax_products.layer_dot_general

    def recording(*args, key, **kwargs):
        keys.append(key)
        return inner(*args, key=key, **kwargs)

    monkeypatch.setattr(flax_products, "layer_dot_general", recording)
    return keys


def _linen_dense(recipe, **kwargs):
    return nn.Dense(
        N,
        dtype=BF16,
        dot_general_cls=functools.partial(LinenDotGeneral, recipe=recipe),
        **kwargs,
    )


def test_linen_dense_matches_reference(recorded_keys):
    dense = _linen_dense(nv.NVFP4)
    x = _data(0, (3, 16, K))
    params = jax.jit(dense.init)(jax.random.key(1), x)["params"]
    # Give the bias values so that its gradient and addition are checked.
    params["bias"] = _data(2, (N,))
    r = _weights(3)

    def loss(params, x):
        y = dense.apply({"params": params}, x, rngs={"nvfp4": jax.random.key(4)})
        return jnp.sum(y.astype(jnp.float32) * r), y

    def ref_loss(params, x, key):
        y = reference_dense(params, x, key=key, recipe=nv.NVFP4)
        return jnp.sum(y.astype(jnp.float32) * r), y

    @jax.jit
    def both(params, x):
        grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        (_, y), grads = grad(params, x)
        key = recorded_keys[-1]  # the key the layer drew (traced)
        assert key is not None
        ref_grad = jax.value_and_grad(ref_loss, argnums=(0, 1), has_aux=True)
        (_, y_ref), grads_ref = ref_grad(params, x, key)
        return y, grads, y_ref, grads_ref

    y, grads, y_ref, grads_ref = both(params, x)
    assert y.dtype == BF16
    assert_same(y, y_ref)
    assert_trees_same(grads, grads_ref)


def test_linen_keys_per_step_and_per_layer(recorded_keys):
    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.gelu(_linen_dense(nv.NVFP4, name="up")(x))
            return _linen_dense(nv.NVFP4, name="down")(h)

    model = Mlp()
    x = _data(0, (16, N))
    params = jax.jit(model.init)(jax.random.key(1), x)["params"]
    r = _weights(3)

    @jax.jit
    def grads(params, step_key):
        def loss(p):
            y = model.apply({"params": p}, x, rngs={"nvfp4": step_key})
            return jnp.sum(y.astype(jnp.float32) * r)

        g = jax.grad(loss)(params)
        up_key, down_key = (jax.random.key_data(k) for k in recorded_keys[-2:])
        return g, up_key, down_key

    g1, up1, down1 = grads(params, jax.random.key(10))
    g1_again, _, _ = grads(params, jax.random.key(10))
    g2, up2, _ = grads(params, jax.random.key(11))
    assert_trees_same(g1, g1_again)  # reproducible from the step key
    assert_trees_differ(g1["up"], g2["up"])  # a new key draws new bits
    assert_trees_differ(g1["down"], g2["down"])
    assert bool(jnp.any(up1 != down1))  # each layer its own key
    assert bool(jnp.any(up1 != up2))


def test_linen_without_stream_is_forward_only():
    dense = _linen_dense(nv.NVFP4)
    x = _data(0, (16, K))
    variables = jax.jit(dense.init)(jax.random.key(1), x)  # no "nvfp4" stream needed

    @jax.jit
    def inference_and_training(variables, x):
        y_training = dense.apply(variables, x, rngs={"nvfp4": jax.random.key(2)})
        return dense.apply(variables, x), y_training

    y_inference, y_training = inference_and_training(variables, x)
    assert_same(y_inference, y_training)  # the key only affects the backward
    with pytest.raises(ValueError, match="'nvfp4' RNG stream"):
        jax.jit(jax.grad(lambda v: jnp.sum(dense.apply(v, x).astype(jnp.float32))))(
            variables
        )


def test_linen_no_sr_needs_no_key(recorded_keys):
    dense = nn.Dense(N, dot_general=LinenDotGeneral(nv.NVFP4_NO_SR))  # float32
    x = _data(0, (16, K))
    params = jax.jit(dense.init)(jax.random.key(1), x)["params"]
    r = _weights(3)

    def loss(p):
        return jnp.sum(dense.apply({"params": p}, x) * r)

    def ref(p):
        y = nv.dot(x, p["kernel"], recipe=nv.NVFP4_NO_SR) + p["bias"]
        return jnp.sum(y * r)

    g, g_ref = jax.jit(lambda p: (jax.grad(loss)(p), jax.grad(ref)(p)))(params)
    assert recorded_keys[-1] is None
    assert_trees_same(g, g_ref)


def test_linen_dense_general_folds_axes():
    layer = nn.DenseGeneral(
        features=(2, 16),
        axis=(-2, -1),
        dtype=BF16,
        dot_general_cls=functools.partial(LinenDotGeneral, recipe=nv.NVFP4),
    )
    x = _data(0, (16, 2, 16))
    params = jax.jit(layer.init)(jax.random.key(1), x)["params"]

    @jax.jit
    def both(params, x):
        y = layer.apply({"params": params}, x, rngs={"nvfp4": jax.random.key(2)})
        w = params["kernel"].astype(BF16).reshape(32, 32)
        y_ref = nv.dot(x.astype(BF16).reshape(16, 32), w, recipe=nv.NVFP4_NO_SR)
        return y, y_ref.reshape(16, 2, 16) + params["bias"].astype(BF16)

    y, y_ref = both(params, x)
    assert y.shape == (16, 2, 16)
    assert_same(y, y_ref)  # the forward pass does not depend on the key


def test_linen_batch_dims_run_in_the_input_precision():
    """A contraction with batch dims has no NVFP4 form in the reference
    recipe: it is lax.dot_general's product."""
    kwargs = dict(features=16, axis=-1, batch_dims=(0,), dtype=BF16)
    layer = nn.DenseGeneral(
        **kwargs,
        dot_general_cls=functools.partial(LinenDotGeneral, recipe=nv.NVFP4),
    )
    x = jax.random.normal(jax.random.key(1), (2, 16, 16), BF16)
    params = layer.init(jax.random.key(0), x)
    y = layer.apply(params, x, rngs={"nvfp4": jax.random.key(2)})
    assert_same(y, nn.DenseGeneral(**kwargs).apply(params, x))


# ------------------------------------------------------------------------- NNX


def _next_key(stream: nnx.RngStream) -> jax.Array:
    """The key an RngStream's next call returns: fold_in(key, count)."""
    return jax.random.fold_in(stream.key[...], stream.count[...])


@pytest.mark.parametrize("recipe", [nv.NVFP4, nv.NVFP4_NO_SR])
def test_nnx_linear_matches_reference(recipe):
    layer = nnx.Linear(
        K,
        N,
        dtype=BF16,
        bias_init=nnx.initializers.normal(1.0),
        dot_general=NNXDotGeneral(recipe, rngs=nnx.Rngs(nvfp4=7)),
        rngs=nnx.Rngs(0),
    )
    x = _data(0, (2, 16, K))
    r = _weights(3)

    def loss(layer, x):
        y = layer(x)
        return jnp.sum(y.astype(jnp.float32) * r), y

    def ref_loss(params, x, key):
        y = reference_dense(params, x, key=key, recipe=recipe)
        return jnp.sum(y.astype(jnp.float32) * r), y

    @nnx.jit
    def both(layer, x):
        # The key the layer's next call draws, and the parameters, before it.
        stream = layer.dot_general.rngs
        key = _next_key(stream) if recipe.needs_key else None
        params = {"kernel": layer.kernel[...], "bias": layer.bias[...]}
        grad = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        (_, y), (grads, dx) = grad(layer, x)
        ref_grad = jax.value_and_grad(ref_loss, argnums=(0, 1), has_aux=True)
        (_, y_ref), (grads_ref, dx_ref) = ref_grad(params, x, key)
        grads = {"kernel": grads["kernel"][...], "bias": grads["bias"][...]}
        return (y, dx, grads), (y_ref, dx_ref, grads_ref)

    got, want = both(layer, x)
    assert_trees_same(got, want)
    if recipe.needs_key:
        assert int(layer.dot_general.rngs.count[...]) == 1
    else:
        assert layer.dot_general.rngs is None  # no key state without SR


class Block(nnx.Module):
    def __init__(self, d, ffn, *, rngs):
        self.attn = nnx.Module()
        self.attn.q_proj = nnx.Linear(d, d, dtype=BF16, rngs=rngs)
        self.mlp = nnx.Module()
        self.mlp.up_proj = nnx.Linear(d, ffn, dtype=BF16, rngs=rngs)
        self.mlp.down_proj = nnx.Linear(ffn, d, dtype=BF16, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn.q_proj(x)
        return x + self.mlp.down_proj(nnx.gelu(self.mlp.up_proj(x)))


class Tiny(nnx.Module):
    """Blocks of an attention-like and an MLP linear, and an output head."""

    def __init__(self, *, d=32, ffn=64, layers=2, vocab=48, rngs):
        self.layers = nnx.List([Block(d, ffn, rngs=rngs) for _ in range(layers)])
        self.lm_head = nnx.Linear(d, vocab, dtype=BF16, rngs=rngs)

    def __call__(self, x):
        for block in self.layers:
            x = block(x)
        return self.lm_head(x)


def _loss(model, x, r):
    return jnp.mean(model(x).astype(jnp.float32) * r)


def _converted_tiny(seed=0, policy=None, rngs=1):
    model = Tiny(rngs=nnx.Rngs(seed))
    return convert(model, policy or transformer_policy(2), nnx.Rngs(nvfp4=rngs))


def test_convert_selects_layers_by_policy():
    model = Tiny(rngs=nnx.Rngs(0))
    assert nvfp4_layers(model) == {}
    out = convert(model, transformer_policy(2, keep_last=1), nnx.Rngs(nvfp4=1))
    assert out is model  # in place
    assert nvfp4_layers(model) == {
        "layers.0.mlp.up_proj": nv.NVFP4,
        "layers.0.mlp.down_proj": nv.NVFP4,
    }
    assert model.layers[0].attn.q_proj.dot_general is jax.lax.dot_general
    assert model.lm_head.dot_general is jax.lax.dot_general
    # Every converted layer has its own stream: their next keys differ.
    up, down = model.layers[0].mlp.up_proj, model.layers[0].mlp.down_proj
    assert bool(
        jnp.any(
            jax.random.key_data(_next_key(up.dot_general.rngs))
            != jax.random.key_data(_next_key(down.dot_general.rngs))
        )
    )
    # Converting again replaces the recipe; per-GEMM overrides are rules.
    policy = Policy(
        rules=(("*down_proj", nv.Recipe(wgrad=False)), ("*mlp*", nv.NVFP4_NO_RHT)),
        keep_last=1,
        num_layers=2,
    )
    convert(model, policy, nnx.Rngs(nvfp4=2))
    assert nvfp4_layers(model) == {
        "layers.0.mlp.up_proj": nv.NVFP4_NO_RHT,
        "layers.0.mlp.down_proj": nv.Recipe(wgrad=False),
    }


def test_convert_excluded_layers_bit_identical():
    x = _data(0, (2, 16, 32))
    reference = Tiny(rngs=nnx.Rngs(0))
    model = _converted_tiny(seed=0)
    # The excluded layers, called on the same inputs: identical bits.
    for name in ("lm_head",):
        h = _data(2, (16, 32))
        assert_same(getattr(model, name)(h), getattr(reference, name)(h))
    for i in range(2):
        h = _data(3 + i, (16, 32))
        assert_same(model.layers[i].attn.q_proj(h), reference.layers[i].attn.q_proj(h))
    h = _data(5, (16, 32))
    assert_same(model.layers[1].mlp.up_proj(h), reference.layers[1].mlp.up_proj(h))
    # The converted layers do differ from bf16.
    assert bool(
        jnp.any(model.layers[0].mlp.up_proj(h) != reference.layers[0].mlp.up_proj(h))
    )
    # A policy that selects nothing leaves the model as built: the same graph
    # and state, hence the same bits forward and backward.
    untouched = convert(Tiny(rngs=nnx.Rngs(0)), Policy(), nnx.Rngs(nvfp4=1))
    assert nnx.graphdef(untouched) == nnx.graphdef(reference)
    assert_trees_same(nnx.state(untouched), nnx.state(reference))
    assert_same(untouched(x), reference(x))


def test_nnx_jit_training_steps_draw_new_bits_and_reproduce():
    model = _converted_tiny()
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    x = _data(0, (2, 16, 32))
    r = _data(1, (48,))

    @nnx.jit
    def train_step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(_loss)(model, x, r)
        optimizer.update(model, grads)
        return loss, grads

    up = model.layers[0].mlp.up_proj
    saved_model, saved_optimizer = nnx.clone(model), nnx.clone(optimizer)
    (loss1, g1), (loss2, _), (loss3, _) = (
        train_step(model, optimizer, x) for _ in range(3)
    )
    assert np.isfinite([loss1, loss2, loss3]).all() and loss3 < loss1
    assert int(up.dot_general.rngs.count[...]) == 3  # one key per step

    # The first step's parameters with the stream three steps on: new bits in
    # the NVFP4 layers' (and, through dX, earlier layers') gradients; the
    # layers above them see only forward values, which need no key.
    nnx.update(model, nnx.state(saved_model, nnx.Param))
    _, g4 = train_step(model, optimizer, x)
    assert_trees_differ(g1["layers"][0]["mlp"], g4["layers"][0]["mlp"])
    assert_trees_same(g1["layers"][1], g4["layers"][1])
    assert_trees_same(g1["lm_head"], g4["lm_head"])

    # Restoring the whole state (RNG counts included) reproduces the step.
    nnx.update(model, nnx.state(saved_model))
    nnx.update(optimizer, nnx.state(saved_optimizer))
    loss1_again, g1_again = train_step(model, optimizer, x)
    assert_same(loss1_again, loss1)
    assert_trees_same(g1_again, g1)


def test_jax_jit_with_split_merge():
    model = _converted_tiny()
    graphdef, state = nnx.split(model)
    x = _data(0, (2, 16, 32))
    r = _data(1, (48,))

    @jax.jit
    def step(state, x):
        model = nnx.merge(graphdef, state)
        grads = nnx.grad(_loss)(model, x, r)
        return grads, nnx.state(model)  # the advanced RNG counts

    g1, state1 = step(state, x)
    g2, state2 = step(state1, x)
    g1_again, _ = step(state, x)
    assert_trees_same(g1, g1_again)
    assert_trees_differ(g1["layers"][0]["mlp"], g2["layers"][0]["mlp"])
    count = state2["layers"][0]["mlp"]["up_proj"]["dot_general"]["rngs"]["count"]
    assert int(count[...]) == 2


def test_convert_without_rngs_is_forward_only():
    x = _data(0, (2, 16, 32))
    model = convert(Tiny(rngs=nnx.Rngs(0)), transformer_policy(2))
    trained = _converted_tiny(seed=0)
    forward = nnx.jit(lambda model, trained, x: (model(x), trained(x)))
    assert_same(*forward(model, trained, x))
    with pytest.raises(ValueError, match="'nvfp4' RNG stream"):
        nnx.jit(nnx.grad(_loss))(model, x, _data(1, (48,)))


def test_convert_skips_layers_not_multiple_of_16():
    class Odd(nnx.Module):
        def __init__(self, rngs):
            self.mlp = nnx.Module()
            self.mlp.fc = nnx.Linear(32, 40, rngs=rngs)
            self.mlp.out = nnx.Linear(40, 32, rngs=rngs)

    policy = Policy(rules=(("*mlp*", nv.NVFP4),))
    model = Odd(nnx.Rngs(0))
    with pytest.raises(
        ValueError, match=r"mlp\.fc \(Linear: K=32, N=40 .*mlp\.out \(Linear: K=40"
    ):
        convert(model, policy, 0)
    assert model.mlp.fc.dot_general is jax.lax.dot_general  # left unchanged
    with pytest.warns(UserWarning, match="stay as they are"):
        convert(model, policy, 0, strict=False)
    assert nvfp4_layers(model) == {}
    # Excluding them in the policy converts the rest without a word.
    model.mlp.ok = nnx.Linear(32, 32, rngs=nnx.Rngs(0))
    policy = Policy(rules=(("mlp.fc", None), ("mlp.out", None), ("*mlp*", nv.NVFP4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(model, policy, 0)
    assert nvfp4_layers(model) == {"mlp.ok": nv.NVFP4}


def test_convert_errors():
    custom = nnx.Linear(
        32, 32, dot_general=functools.partial(jax.lax.dot_general), rngs=nnx.Rngs(0)
    )
    with pytest.raises(ValueError, match="custom dot_general"):
        convert(custom, Policy(default=nv.NVFP4), 0)
    with pytest.raises(TypeError, match="Policy"):
        convert(Tiny(rngs=nnx.Rngs(0)), {"*mlp*": nv.NVFP4}, 0)
    with pytest.raises(ValueError, match="no 'nvfp4' stream"):
        convert(Tiny(rngs=nnx.Rngs(0)), transformer_policy(2), nnx.Rngs(params=0))
    with pytest.raises(TypeError, match="recipe must be"):
        NNXDotGeneral("nvfp4")
