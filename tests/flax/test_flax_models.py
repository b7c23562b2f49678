"""Flax as real models use it: NNX blocks stacked with nnx.vmap and run by
nnx.scan (with and without nnx.remat), keep_last inside a stack, einsum
projections (nnx.Einsum, nnx.LinearGeneral, linen nn.Einsum), and the
converter's answers to a misconfigured call."""

import functools
import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_nvfp4 as nv
from jax_nvfp4.flax import (
    LinenEinsum,
    NNXDotGeneral,
    NVFP4Enabled,
    convert,
    nvfp4_layers,
)
from jax_nvfp4.policy import Policy, transformer_policy

BF16 = jnp.bfloat16
D, F, L = 32, 64, 3
KEY = jax.random.key(7)


def _data(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ------------------------------------------------------------- stacked blocks


class Block(nnx.Module):
    def __init__(self, rngs):
        kw = dict(dtype=BF16, rngs=rngs)
        self.attn = nnx.Linear(D, D, use_bias=False, **kw)
        self.mlp_up = nnx.Linear(D, F, use_bias=False, **kw)
        self.mlp_down = nnx.Linear(F, D, use_bias=False, **kw)

    def __call__(self, x):
        x = x + self.attn(x)
        return x + self.mlp_down(jax.nn.relu(self.mlp_up(x)))


class Stacked(nnx.Module):
    """L blocks built by nnx.vmap, run by nnx.scan (optionally rematted)."""

    def __init__(self, rngs, remat=False):
        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.layers = make(rngs)
        self.remat = remat

    def __call__(self, x):
        def body(block, x):
            return block(x)

        if self.remat:
            body = nnx.remat(body, policy=nv.save_fp4_residuals)

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block, x):
            return body(block, x)

        return run(self.layers, x)


def _unstacked_block(stacked, i):
    """Block i of a stack as a model of its own (its own arrays)."""
    graphdef, state = nnx.split(stacked.layers)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))


def _loss(model, x):
    return jnp.mean(jnp.square(model(x).astype(jnp.float32)))


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan+remat"])
def test_stacked_layers_convert_and_train(remat):
    model = Stacked(nnx.Rngs(0), remat=remat)
    convert(model, transformer_policy(L, keep_last=0), nnx.Rngs(nvfp4=1))
    assert set(nvfp4_layers(model)) == {"layers.mlp_up", "layers.mlp_down"}
    # RNG state is stacked like the parameters: one stream per layer.
    counts = nnx.state(model, nnx.RngCount)
    assert {a.shape for a in jax.tree.leaves(counts)} == {(L,)}
    x = _data(0, (48, D), BF16)
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(_loss)(model, x)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, x)) for _ in range(4)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    # Every layer and every step advanced its own stream.
    assert {int(c) for c in jax.tree.leaves(nnx.state(model, nnx.RngCount))[0]} == {4}


def test_stacked_layers_draw_different_bits_per_layer():
    """The per-layer keys of a stack differ: each layer's stochastic rounding
    of dY draws its own bits."""
    model = Stacked(nnx.Rngs(0))
    convert(model, Policy(rules=(("*mlp_up", nv.NVFP4),)), nnx.Rngs(nvfp4=1))
    keys = nnx.state(model, nnx.RngKey)
    data = jax.random.key_data(jax.tree.leaves(keys)[0])
    assert data.shape[0] == L and len({tuple(np.asarray(k)) for k in data}) == L


def test_stacked_equals_its_layers_run_one_by_one():
    """A scanned stack computes, layer by layer, what each layer computes on
    its own with the same RNG state: forward and gradients bit-identical."""
    model = Stacked(nnx.Rngs(0))
    convert(model, transformer_policy(L, keep_last=0), nnx.Rngs(nvfp4=1))
    blocks = [_unstacked_block(model, i) for i in range(L)]
    x = _data(1, (32, D), BF16)

    def unrolled(blocks, x):
        for block in blocks:
            x = block(x)
        return x

    _same(nnx.jit(lambda m, x: m(x))(model, x), nnx.jit(unrolled)(blocks, x))
    grads = nnx.jit(nnx.grad(_loss))(model, x)
    block_grads = nnx.jit(
        nnx.grad(lambda b, x: jnp.mean(jnp.square(unrolled(b, x).astype(jnp.float32))))
    )(blocks, x)
    for i in range(L):
        for name in ("mlp_up", "mlp_down", "attn"):
            _same(
                getattr(grads.layers, name).kernel[...][i],
                getattr(block_grads[i], name).kernel[...],
            )


def test_keep_last_inside_a_stack_runs_the_last_layer_in_bf16():
    model = Stacked(nnx.Rngs(0))
    reference = nnx.clone(model)
    convert(model, transformer_policy(L, keep_last=1), nnx.Rngs(nvfp4=1))
    switch = jax.tree.leaves(nnx.state(model, NVFP4Enabled))
    assert [bool(s) for s in switch[0]] == [True] * (L - 1) + [False]
    x = _data(2, (32, D), BF16)
    # The last layer on its own: its switch is off, it is the bf16 layer.
    last, plain = _unstacked_block(model, L - 1), _unstacked_block(reference, L - 1)
    _same(nnx.jit(lambda m, x: m(x))(last, x), nnx.jit(lambda m, x: m(x))(plain, x))
    grads = nnx.jit(nnx.grad(_loss))(last, x)
    ref_grads = nnx.jit(nnx.grad(_loss))(plain, x)
    _same(grads.mlp_up.kernel[...], ref_grads.mlp_up.kernel[...])
    # The first one runs NVFP4: not the bf16 product.
    first, plain0 = _unstacked_block(model, 0), _unstacked_block(reference, 0)
    assert not np.array_equal(
        np.asarray(first(x), np.float32), np.asarray(plain0(x), np.float32)
    )
    # And the whole stack trains.
    loss, _ = nnx.jit(nnx.value_and_grad(_loss))(model, x)
    assert np.isfinite(float(loss))


def test_keep_last_with_a_stack_of_another_size_says_how():
    model = Stacked(nnx.Rngs(0))
    with pytest.raises(ValueError, match="split the stack"):
        convert(model, transformer_policy(L + 1, keep_last=1), 0)


# --------------------------------------------------------------- einsum forms


def _reference(x, w, spec, recipe, key):
    return jnp.einsum(
        spec,
        x,
        w,
        _dot_general=functools.partial(nv.dot_general, recipe=recipe, key=key),
    )


@pytest.mark.parametrize(
    "spec,x_shape,w_shape",
    [
        ("btd,dnh->btnh", (2, 16, 32), (32, 2, 16)),
        ("btnh,nhd->btd", (2, 16, 2, 16), (2, 16, 32)),
    ],
    ids=["q_proj", "o_proj"],
)
def test_nnx_einsum_runs_the_recipe(spec, x_shape, w_shape):
    layer = nnx.Einsum(spec, w_shape, dtype=BF16, rngs=nnx.Rngs(0))
    assert layer.bias is None
    convert(layer, Policy(default=nv.NVFP4_NO_SR), None)
    assert nvfp4_layers(layer) == {"": nv.NVFP4_NO_SR}
    x = _data(3, x_shape, BF16)
    w = layer.kernel[...].astype(BF16)
    _same(layer(x), _reference(x, w, spec, nv.NVFP4_NO_SR, None))
    grad = nnx.grad(lambda m, x: jnp.sum(m(x).astype(jnp.float32)))(layer, x)
    ref = jax.grad(
        lambda w: jnp.sum(_reference(x, w.astype(BF16), spec, nv.NVFP4_NO_SR, None))
    )(layer.kernel[...])
    _same(grad.kernel[...], ref)


def test_nnx_einsum_with_batch_indices_is_refused_or_left():
    layer = nnx.Einsum("bqd,bkd->bqk", (2, 16, 32), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"batch indices \['b'\]"):
        convert(layer, Policy(default=nv.NVFP4), 0)
    with pytest.warns(UserWarning, match="stay as they are"):
        convert(layer, Policy(default=nv.NVFP4), 0, strict=False)
    assert nvfp4_layers(layer) == {}


def test_nnx_linear_general_runs_the_recipe():
    layer = nnx.LinearGeneral(
        (2, 16), (4, 8), axis=(-2, -1), use_bias=False, dtype=BF16, rngs=nnx.Rngs(0)
    )
    convert(layer, Policy(default=nv.NVFP4), nnx.Rngs(nvfp4=3))
    x = _data(4, (24, 2, 16), BF16)
    w = layer.kernel[...].astype(BF16)
    y = layer(x)
    expected = nv.dot_general(x, w, (((1, 2), (0, 1)), ((), ())), recipe=nv.NVFP4)
    _same(y, expected)
    assert y.shape == (24, 4, 8)


def test_linen_einsum_runs_the_recipe():
    spec = "btd,dnh->btnh"
    layer = LinenEinsum((32, 2, 16), spec, dtype=BF16, recipe=nv.NVFP4)
    plain = nn.Einsum((32, 2, 16), spec, dtype=BF16)
    x = _data(5, (2, 16, 32), BF16)
    variables = layer.init(jax.random.key(0), x)
    # Same parameters (names, shapes, bias) as nn.Einsum.
    plain_vars = plain.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, plain_vars)
    params = variables["params"]
    w = params["kernel"].astype(BF16)
    b = params["bias"].astype(BF16)

    def loss(params, key):
        y = layer.apply({"params": params}, x, rngs={"nvfp4": key})
        return jnp.sum(y.astype(jnp.float32) * _data(6, y.shape))

    y = layer.apply({"params": params}, x, rngs={"nvfp4": jax.random.key(11)})
    assert y.shape == (2, 16, 2, 16)
    # The forward pass does not depend on the key; compare with the reference.
    _same(y, _reference(x, w, spec, nv.NVFP4, None) + b)
    g1 = jax.grad(loss)(params, jax.random.key(1))
    g2 = jax.grad(loss)(params, jax.random.key(2))
    assert not np.array_equal(np.asarray(g1["kernel"]), np.asarray(g2["kernel"]))
    # Without the stream the forward runs; the gradient says what is missing.
    layer.apply({"params": params}, x)
    with pytest.raises(ValueError, match="'nvfp4' RNG stream"):
        jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, x)))(params)


def test_linen_dense_general_with_several_feature_axes():
    layer = nn.DenseGeneral(
        (2, 16),
        axis=(-2, -1),
        dtype=BF16,
        use_bias=False,
        dot_general_cls=functools.partial(nv.flax.LinenDotGeneral, recipe=nv.NVFP4),
    )
    x = _data(7, (24, 2, 16), BF16)
    params = layer.init(jax.random.key(0), x)["params"]
    y = layer.apply({"params": params}, x)
    w = params["kernel"].astype(BF16)
    _same(y, nv.dot_general(x, w, (((1, 2), (0, 1)), ((), ())), key=KEY))


# -------------------------------------------------------------- misconfigured


def test_convert_refuses_the_other_frameworks_models():
    linear = eqx.nn.Linear(32, 32, key=jax.random.key(0))
    with pytest.raises(TypeError, match="jax_nvfp4.equinox.convert"):
        convert(linear, Policy(default=nv.NVFP4), 0)
    with pytest.raises(TypeError, match="LinenDotGeneral"):
        convert(nn.Dense(32), Policy(default=nv.NVFP4), 0)


def test_a_policy_matching_nothing_warns_with_the_paths():
    model = Stacked(nnx.Rngs(0))
    with pytest.warns(UserWarning, match=r"no rule.*layers.mlp_up"):
        convert(model, Policy(rules=(("*ffw*", nv.NVFP4),)), 0)
    assert nvfp4_layers(model) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(model, transformer_policy(L, keep_last=0), 0)


def test_convert_again_replaces_the_recipe():
    layer = nnx.Linear(32, 32, rngs=nnx.Rngs(0))
    convert(layer, Policy(default=nv.NVFP4), 0)
    convert(layer, Policy(default=nv.NVFP4_NO_RHT), 0)
    assert isinstance(layer.dot_general, NNXDotGeneral)
    assert nvfp4_layers(layer) == {"": nv.NVFP4_NO_RHT}


def test_llama_flax_example_trains(tmp_path):
    """examples/llama_flax.py: stacked blocks under nnx.scan with the remat
    policy that keeps the FP4 residuals, the last block in bf16; loss falls."""
    from nvfp4_examples import llama_flax

    records = llama_flax.main(
        [
            "--steps", "8", "--layers", "2", "--d-model", "32", "--heads", "2",
            "--ffn", "64", "--batch", "4", "--seq-len", "32", "--log-every", "1",
            "--eval-every", "100", "--out", str(tmp_path), "--no-plot",
        ]
    )  # fmt: skip
    losses = [float(r["loss"]) for r in records]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
