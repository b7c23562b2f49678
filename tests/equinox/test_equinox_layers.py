"""jax_nvfp4.equinox: the Linear stand-in against jax_nvfp4.dot on the folded
tokens (forward and backward, bit for bit), the vmap fold seen in the jaxpr,
keys, and convert() with a policy."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4 import equinox as nveqx
from jax_nvfp4.policy import Policy, transformer_policy

K, N = 64, 48  # in, out features (distinct, so shapes tell operands apart)
B, S = 4, 6  # batch x positions: 24 tokens, padded to 32 for column-wise blocks


def _random_init(build, seed=0):
    """``build()``'s module with uniform random arrays, made in NumPy (an eager
    jax.random initialisation would compile a program per shape: slow tests)."""
    rng = np.random.default_rng(seed)

    def fill(leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        bound = 1 / np.sqrt(leaf.shape[-1])
        return jnp.asarray(rng.uniform(-bound, bound, leaf.shape), leaf.dtype)

    return jax.tree.map(fill, eqx.filter_eval_shape(build))


def _data(dtype=jnp.float32):
    lin = _random_init(lambda: eqx.nn.Linear(K, N, key=jax.random.key(0)))
    x = jax.random.normal(jax.random.key(1), (B, S, K), jnp.float32).astype(dtype)
    g = jax.random.normal(jax.random.key(2), (B, S, N), jnp.float32)
    return lin, x, g


def _assert_equal(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert u.shape == v.shape and u.dtype == v.dtype, (u.shape, v.shape)
        np.testing.assert_array_equal(
            np.asarray(u, np.float32), np.asarray(v, np.float32)
        )


def _assert_equal_on_cpu(a, b):
    """Bit for bit on the CPU. On a GPU the two computations were seen to
    differ by one bf16 ulp in single elements (the loss by float32 rounding),
    from where XLA's GPU compilation rounds differently or cuBLASLt sums in
    another order; not isolated: compared to within that there."""
    if jax.default_backend() == "cpu":
        return _assert_equal(a, b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert u.shape == v.shape and u.dtype == v.dtype, (u.shape, v.shape)
        u, v = np.asarray(u, np.float32), np.asarray(v, np.float32)
        scale = float(np.max(np.abs(v))) or 1.0
        np.testing.assert_allclose(u, v, rtol=2.0**-7, atol=2.0**-8 * scale)


def _nested(layer, key, key_axis=None):
    """vmap over the batch of a vmap over positions, Equinox style."""
    per_token = jax.vmap(lambda t, k: layer(t, key=k), in_axes=(0, key_axis))
    return jax.vmap(per_token, in_axes=(0, key_axis))


@pytest.mark.parametrize(
    "recipe, dtype",
    [
        (nv.NVFP4, jnp.float32),
        (nv.NVFP4, jnp.bfloat16),
        (nv.NVFP4_NO_RHT, jnp.bfloat16),
        (nv.NVFP4_NO_SR, jnp.float32),
    ],
)
def test_linear_is_dot_on_folded_tokens(recipe, dtype):
    lin, x, g = _data(dtype)
    layer = nveqx.Linear.from_linear(lin, recipe)
    key = jax.random.key(3)

    def ours(params, x):
        w, b = params
        m = eqx.tree_at(lambda m: (m.weight, m.bias), layer, (w, b))
        y = _nested(m, key)(x, key)
        return jnp.sum(y.astype(jnp.float32) * g), y

    def reference(params, x):
        # The hand-written reference: one dot over all B * S tokens.
        w, b = params
        y = nv.dot(x.reshape(-1, K), w.T.astype(dtype), key=key, recipe=recipe)
        y = y.reshape(B, S, N) + b.astype(dtype)
        return jnp.sum(y.astype(jnp.float32) * g), y

    params = (lin.weight, lin.bias)
    got = jax.jit(jax.value_and_grad(ours, (0, 1), has_aux=True))(params, x)
    want = jax.jit(jax.value_and_grad(reference, (0, 1), has_aux=True))(params, x)
    _assert_equal_on_cpu(got, want)


def _eqns(jaxpr):
    """Every equation of a jaxpr, nested jaxprs (jit, custom_vjp, ...) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _eqns(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _eqns(sub)


def _gemms_and_weight_shaped(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    gemms, weight_shaped = [], []
    for eqn in _eqns(jaxpr):
        if eqn.primitive.name == "nvfp4_matmul":
            gemms.append(
                [v.aval.shape for v in eqn.invars[:1]] + [eqn.outvars[0].aval.shape]
            )
        for v in eqn.outvars:
            shape = getattr(v.aval, "shape", ())
            if len(shape) >= 3 and set(shape[-2:]) == {K, N} and shape[0] > 1:
                weight_shaped.append((eqn.primitive.name, shape))
    return gemms, weight_shaped


def test_nested_vmap_folds_into_one_dot():
    lin, x, g = _data()
    layer = nveqx.Linear.from_linear(lin, nv.NVFP4)
    key = jax.random.key(3)

    def loss(layer, x):
        return jnp.sum(_nested(layer, key)(x, key) * g)

    gemms, weight_shaped = _gemms_and_weight_shaped(eqx.filter_grad(loss), layer, x)
    # FPROP, DGRAD, WGRAD: each ONE GEMM over all B * S = 24 tokens (padded to
    # 32 by the fused row + column quantization; operands stored [1, rows,
    # K/2]), and no per-example weight gradient [B, ..., K, N] anywhere.
    t = 32
    assert sorted(gemms) == sorted(
        [
            [(1, t, K // 2), (1, t, N)],  # FPROP: x [T, K] . w
            [(1, t, N // 2), (1, t, K)],  # DGRAD: dy [T, N] . w^T
            # WGRAD: dy^T [N, T] . x -> dw [N, K], the weight's own layout
            [(1, N, t // 2), (1, N, K)],
        ]
    ), gemms
    assert weight_shaped == []

    # The check can fail: plain per-example batching of dot gives batched GEMMs
    # and a per-example weight gradient.
    def unfolded(w, x):
        per_token = jax.vmap(lambda t: nv.dot(t[None], w, key=key)[0])
        return jnp.sum(jax.vmap(per_token)(x) * g)

    gemms, weight_shaped = _gemms_and_weight_shaped(
        jax.grad(unfolded, argnums=(0, 1)), lin.weight.T, x
    )
    assert any(s[0][0] > 1 for s in gemms) and weight_shaped


def test_single_vmap_and_tokens_without_vmap_agree():
    lin, x, _ = _data()
    layer = nveqx.Linear.from_linear(lin, nv.NVFP4_NO_SR)
    a = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(layer, x)  # per example [S, K]
    b = eqx.filter_jit(lambda m, x: m(x))(layer, x)  # [B, S, K] directly
    c = eqx.filter_jit(lambda m, x: _nested(m, None)(x, None))(layer, x)
    _assert_equal(a, b)
    _assert_equal(a, c)


def test_per_example_keys_use_the_first():
    lin, x, g = _data()
    layer = nveqx.Linear.from_linear(lin, nv.NVFP4)
    keys = jax.random.split(jax.random.key(4), B)

    def ours(w):
        m = eqx.tree_at(lambda m: m.weight, layer, w)
        per_token = jax.vmap(lambda t, k: m(t, key=k), in_axes=(0, None))
        return jnp.sum(jax.vmap(per_token)(x, keys) * g)

    def reference(w):
        y = nv.dot(x.reshape(-1, K), w.T, key=keys[0]) + lin.bias
        return jnp.sum(y.reshape(B, S, N) * g)

    _assert_equal(
        jax.jit(jax.grad(ours))(lin.weight), jax.jit(jax.grad(reference))(lin.weight)
    )


def test_per_example_gradients_and_batched_weights_are_not_folded():
    # vmap of grad, and a weight per example: JAX batches dot per example
    # (per-example amax, per-example weight gradient), which must equal a loop.
    lin, x, _ = _data()
    layer = nveqx.Linear.from_linear(lin, nv.NVFP4_NO_SR)

    def loss(m, xi):
        return jnp.sum(jax.vmap(m)(xi) ** 2)

    grad = eqx.filter_jit(eqx.filter_grad(loss))
    per_example = eqx.filter_jit(eqx.filter_vmap(grad, in_axes=(None, 0)))(layer, x)
    for i in range(B):
        _assert_equal(per_example.weight[i], grad(layer, x[i]).weight)

    weights = jnp.stack([lin.weight, 2 * lin.weight])

    def ensemble(w, xi):
        return eqx.tree_at(lambda m: m.weight, layer, w)(xi)

    ys = jax.jit(jax.vmap(ensemble))(weights, x[:2])
    for i in range(2):
        _assert_equal(ys[i], jax.jit(ensemble)(weights[i], x[i]))


def test_key_needed_for_gradients_unless_inference_or_no_sr():
    lin, x, _ = _data()
    layer = nveqx.Linear.from_linear(lin, nv.NVFP4)
    # Without a key, as jax_nvfp4.dot: the forward pass runs (its output does
    # not depend on the key), its gradient raises.
    _assert_equal(layer(x[0]), layer(x[0], key=jax.random.key(0)))
    with pytest.raises(ValueError, match="without a key.*key=.*keys"):
        eqx.filter_grad(lambda m: jnp.sum(m(x[0])))(layer)
    inference = eqx.nn.inference_mode(layer)
    assert inference.inference
    _assert_equal(inference(x[0]), layer(x[0], key=jax.random.key(0)))  # fwd: nearest
    nveqx.Linear.from_linear(lin, nv.NVFP4_NO_SR)(x[0])  # no key needed


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="multiples of 16"):
        nveqx.Linear(20, 32, key=jax.random.key(0))
    layer = eqx.filter_eval_shape(nveqx.Linear, 32, 16, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"\[\.\.\., 32\]"):
        layer(jnp.ones((4, 16)), key=jax.random.key(0))


# ------------------------------------------------------------------ convert


class Mlp(eqx.Module):
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __init__(self, d, f, key):
        k1, k2 = jax.random.split(key)
        self.up_proj = eqx.nn.Linear(d, f, key=k1)
        self.down_proj = eqx.nn.Linear(f, d, key=k2)

    def __call__(self, x, *, key=None):
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        return self.down_proj(jax.nn.silu(self.up_proj(x, key=k1)), key=k2)


class Block(eqx.Module):
    attn_proj: eqx.nn.Linear
    mlp: Mlp

    def __init__(self, d, f, key):
        k1, k2 = jax.random.split(key)
        self.attn_proj = eqx.nn.Linear(d, d, use_bias=False, key=k1)
        self.mlp = Mlp(d, f, k2)

    def __call__(self, x, *, key=None):
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        x = x + self.attn_proj(x, key=k1)
        return x + self.mlp(x, key=k2)


class Tiny(eqx.Module):
    layers: list
    head: eqx.nn.Linear

    def __init__(self, d=32, f=64, n=2, out=24, *, key):
        keys = jax.random.split(key, n + 1)
        self.layers = [Block(d, f, k) for k in keys[:n]]
        self.head = eqx.nn.Linear(d, out, key=keys[n])  # 24: not NVFP4-able

    def __call__(self, x, *, key=None):
        n = len(self.layers)
        keys = [None] * n if key is None else jax.random.split(key, n)
        for layer, k in zip(self.layers, keys, strict=True):
            x = layer(x, key=k)
        return self.head(x)


@functools.cache
def _tiny() -> Tiny:
    return _random_init(lambda: Tiny(key=jax.random.key(0)))


def test_convert_follows_the_policy():
    model = _tiny()
    policy = transformer_policy(2, keep_last=1)
    converted = nveqx.convert(model, policy)
    plan = nveqx.plan(model, policy)
    assert plan == {
        "layers.0.attn_proj": None,
        "layers.0.mlp.up_proj": nv.NVFP4,
        "layers.0.mlp.down_proj": nv.NVFP4,
        "layers.1.attn_proj": None,
        "layers.1.mlp.up_proj": None,
        "layers.1.mlp.down_proj": None,
        "head": None,
    }
    before, after = nveqx.linear_paths(model), nveqx.linear_paths(converted)
    assert before.keys() == after.keys()
    for path, recipe in plan.items():
        if recipe is None:  # untouched: the same layer type and arrays
            assert type(after[path]) is eqx.nn.Linear
            assert after[path].weight is before[path].weight
        else:
            assert isinstance(after[path], nveqx.Linear)
            assert after[path].recipe == recipe
            assert after[path].weight is before[path].weight
            assert after[path].bias is before[path].bias
    # A per-GEMM override is just another recipe in a rule.
    custom = Policy(rules=(("*down_proj", nv.Recipe(wgrad=False)),))
    overridden = nveqx.linear_paths(nveqx.convert(model, custom))
    assert overridden["layers.0.mlp.down_proj"].recipe == nv.Recipe(wgrad=False)
    assert type(overridden["layers.0.mlp.up_proj"]) is eqx.nn.Linear
    # A policy that converts nothing gives the model back.
    assert nveqx.convert(model, Policy()) is model


def test_excluded_layers_bit_identical_in_bf16():
    model = jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a,
        _tiny(),
    )
    converted = nveqx.convert(model, transformer_policy(2, keep_last=1))
    # The last block and the head are excluded: fed the same activations, the
    # converted model computes them bit for bit as the bf16 model does, and
    # its attention projection (excluded) too; the NVFP4 MLP differs.
    h = jax.random.normal(jax.random.key(2), (S, 32), jnp.bfloat16)
    key = jax.random.key(3)

    @eqx.filter_jit
    def parts(m):
        tail = jax.vmap(lambda v: m.head(m.layers[1](v, key=key)))(h)
        attn = jax.vmap(m.layers[0].attn_proj)(h)
        mlp = jax.vmap(lambda v: m.layers[0].mlp(v, key=key))(h)
        return tail, attn, mlp

    (tail, attn, mlp), (tail0, attn0, mlp0) = parts(converted), parts(model)
    _assert_equal(tail, tail0)
    _assert_equal(attn, attn0)
    assert not np.array_equal(np.asarray(mlp, np.float32), np.asarray(mlp0, np.float32))


def test_convert_rejects_layers_that_do_not_fit():
    model = _tiny()
    with pytest.raises(ValueError, match="head.*multiples of 16"):
        nveqx.convert(model, Policy(default=nv.NVFP4))


def test_converted_model_trains_under_filter_jit():
    model = _tiny()
    converted = nveqx.convert(model, transformer_policy(2, keep_last=1))
    x = jax.random.normal(jax.random.key(1), (B, S, 32), jnp.float32)

    @eqx.filter_jit
    def step(m, x, key):
        def loss(m):
            # Batch of sequences: vmap over examples, then over positions.
            y = jax.vmap(jax.vmap(lambda t: m(t, key=key)))(x)
            return jnp.mean(y**2)

        return eqx.filter_value_and_grad(loss)(m)

    loss, grads = step(converted, x, jax.random.key(2))
    assert np.isfinite(float(loss))
    up = grads.layers[0].mlp.up_proj
    assert isinstance(up, nveqx.Linear) and up.weight.shape == (64, 32)
    for leaf in jax.tree.leaves(grads):
        assert np.all(np.isfinite(np.asarray(leaf, np.float32)))
    # The converted MLP layers' gradients equal the hand-written reference:
    # the same block with jax_nvfp4.dot over all B * S tokens.
    mlp = converted.layers[0].mlp
    key = jax.random.key(2)
    k_block = jax.random.split(key, 2)[0]
    k_mlp = jax.random.split(k_block)[1]
    k_up, k_down = jax.random.split(k_mlp)
    xs = jax.random.normal(jax.random.key(3), (B * S, 32), jnp.float32)

    def ours(mlp):
        return jnp.sum(jax.vmap(lambda t: mlp(t, key=k_mlp))(xs) ** 2)

    def reference(mlp):
        h = nv.dot(xs, mlp.up_proj.weight.T, key=k_up) + mlp.up_proj.bias
        y = nv.dot(jax.nn.silu(h), mlp.down_proj.weight.T, key=k_down)
        return jnp.sum((y + mlp.down_proj.bias) ** 2)

    _assert_equal(
        eqx.filter_jit(eqx.filter_grad(ours))(mlp),
        eqx.filter_jit(eqx.filter_grad(reference))(mlp),
    )


def test_convert_warns_on_unmatched_rules_and_reconverts():
    model = _tiny()
    with pytest.warns(UserWarning, match="atention") as caught:
        nveqx.convert(model, Policy(rules=(("*atention*", nv.NVFP4),)))
    assert "layers.0.attn_proj" in str(caught[0].message)
    # Converting again applies the new policy to the converted layers too.
    converted = nveqx.convert(model, transformer_policy(2, keep_last=1))
    again = nveqx.linear_paths(
        nveqx.convert(converted, Policy(rules=(("*mlp*", nv.NVFP4_NO_SR),)))
    )
    for path in ("layers.0.mlp.up_proj", "layers.1.mlp.down_proj"):
        assert isinstance(again[path], nveqx.Linear)
        assert again[path].recipe == nv.NVFP4_NO_SR
    # ... and a policy that selects nothing gives the eqx.nn.Linear layers back.
    back = nveqx.linear_paths(nveqx.convert(converted, Policy()))
    for path, layer in nveqx.linear_paths(model).items():
        assert type(back[path]) is eqx.nn.Linear
        assert back[path].weight is layer.weight and back[path].bias is layer.bias


def test_convert_refuses_flax_modules():
    nnx = pytest.importorskip("flax.nnx")
    linen = pytest.importorskip("flax.linen")
    with pytest.raises(TypeError, match=r"jax_nvfp4\.flax\.convert"):
        nveqx.convert(nnx.Linear(16, 16, rngs=nnx.Rngs(0)), transformer_policy(1))
    with pytest.raises(TypeError, match="Flax module"):
        nveqx.convert(linen.Dense(16), transformer_policy(1))


# --------------------------------------------------------------------- keys


def _mlp(seed=0):
    """eqx.nn.MLP (its __call__ passes no key to its layers), all in NVFP4."""
    build = functools.partial(eqx.nn.MLP, K, 16, 48, depth=2, key=jax.random.key(0))
    return nveqx.convert(_random_init(build, seed), Policy(default=nv.NVFP4))


def test_keys_block_gives_each_layer_its_own_key():
    mlp = _mlp()
    assert all(isinstance(layer, nveqx.Linear) for layer in mlp.layers)
    x = jax.random.normal(jax.random.key(1), (B, K), jnp.float32)
    g = jax.random.normal(jax.random.key(2), (B, 16), jnp.float32)

    @eqx.filter_jit
    def grads(m, key):
        def loss(m):
            with nveqx.keys(key):
                return jnp.sum(jax.vmap(m)(x) * g)

        return eqx.filter_grad(loss)(m)

    @eqx.filter_jit
    def by_hand(m, keys):  # the MLP's layers, each given its key
        def loss(m):
            h = x
            for i, (layer, k) in enumerate(zip(m.layers, keys, strict=True)):
                h = jax.vmap(lambda v, layer=layer, k=k: layer(v, key=k))(h)
                h = jax.nn.relu(h) if i < len(m.layers) - 1 else h
            return jnp.sum(h * g)

        return eqx.filter_grad(loss)(m)

    def weights(grads):
        return [layer.weight for layer in grads.layers]

    key = jax.random.key(3)
    got = weights(grads(mlp, key))
    # Call n draws fold_in(key, n): each layer its own bits ...
    drawn = [jax.random.fold_in(key, i) for i in range(3)]
    _assert_equal(got, weights(by_hand(mlp, drawn)))
    same = weights(by_hand(mlp, [drawn[0]] * 3))
    assert not np.array_equal(np.asarray(got[0]), np.asarray(same[0]))
    # ... and another step's key other bits.
    other = weights(grads(mlp, jax.random.key(4)))
    for a, b in zip(got, other, strict=True):
        assert not np.array_equal(np.asarray(a), np.asarray(b))

    # Without a key: the forward pass, whose gradient raises; a key captured
    # by the traced function: an error.
    mlp(x[0])
    with pytest.raises(ValueError, match=r"keys\(step_key\)"):
        eqx.filter_grad(lambda m: jnp.sum(m(x[0])))(mlp)
    with nveqx.keys(key), pytest.raises(ValueError, match="argument"):
        eqx.filter_jit(lambda m: jax.vmap(m)(x))(mlp)
    with pytest.raises(TypeError, match="keys"):
        nveqx.keys(3).__enter__()


def test_eqx_mlp_trains_with_keys():
    mlp = _mlp(seed=1)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, K)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((K, 16)) / np.sqrt(K), jnp.float32)
    y = x @ y

    @eqx.filter_jit
    def step(m, key):
        def loss(m):
            with nveqx.keys(key):
                return jnp.mean((jax.vmap(m)(x) - y) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(m)
        return eqx.apply_updates(m, jax.tree.map(lambda g: -1.0 * g, grads)), value

    losses = []
    for i in range(40):
        mlp, value = step(mlp, jax.random.key(i))
        losses.append(float(value))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses


def test_forward_mode_gets_the_recipes_error_with_or_without_a_key():
    """jax.jvp through a converted Linear says that the recipe has a VJP only,
    whether the layer got a key or not (without one it runs its forward-only
    product, a custom VJP of its own)."""
    key = jax.random.key(0)
    linear = nveqx.convert(eqx.nn.Linear(64, 32, key=key), Policy(default=nv.NVFP4))
    x = jnp.ones((64,), jnp.float32)
    for call in (lambda x: linear(x), lambda x: linear(x, key=key)):
        with pytest.raises(TypeError, match=r"not a JVP.*jax.grad / jax.vjp"):
            jax.jvp(call, (x,), (x,))
