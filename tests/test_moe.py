"""Mixture-of-experts layers in the frameworks: Flax NNX ``Experts`` through
the policy (``convert``), qwix's interception of ``jax.lax.ragged_dot``, and
the examples' MoE model that trains."""

import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_nvfp4 as nv
from jax_nvfp4.flax import Experts, NNXRaggedDot, convert, nvfp4_layers
from jax_nvfp4.policy import Policy, transformer_policy

BF16 = jnp.bfloat16
E, D, F = 4, 32, 48  # experts, model width, expert width


def _rows(seed=0, tokens=40):
    """Rows sorted by expert (unbalanced, one expert empty) and their sizes."""
    x = jax.random.normal(jax.random.key(seed), (tokens, D), BF16)
    sizes = jnp.array([17, 0, 16, tokens - 33], jnp.int32)
    return x, sizes


class Block(nnx.Module):
    """A router and one expert projection, as an MoE block holds them."""

    def __init__(self, rngs):
        self.router = nnx.Linear(D, E, use_bias=False, rngs=rngs)
        self.experts = Experts(E, D, F, dtype=BF16, rngs=rngs)

    def __call__(self, x, sizes):
        return self.experts(x, sizes)


def _assert_equal(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(
            np.asarray(u, np.float32), np.asarray(v, np.float32)
        )


def test_experts_is_lax_ragged_dot_until_converted():
    layer = Experts(E, D, F, dtype=BF16, rngs=nnx.Rngs(0))
    x, sizes = _rows()
    kernel = layer.kernel[...].astype(BF16)
    _assert_equal(layer(x, sizes), jax.lax.ragged_dot(x, kernel, sizes))


def test_convert_selects_experts_by_path_and_keeps_the_router():
    block = Block(nnx.Rngs(0))
    policy = transformer_policy(1, keep_last=0, nvfp4_patterns=("*experts*",))
    convert(block, policy, nnx.Rngs(nvfp4=1))
    assert isinstance(block.experts.ragged_dot, NNXRaggedDot)
    assert block.router.dot_general is jax.lax.dot_general  # N = 4 experts
    assert nvfp4_layers(block) == {"experts": nv.NVFP4}


def test_converted_experts_are_jax_nvfp4_ragged_dot():
    """Forward and gradients bit-identical to jax_nvfp4.ragged_dot on the
    same operands (a recipe without stochastic rounding needs no key)."""
    layer = Experts(E, D, F, dtype=BF16, rngs=nnx.Rngs(0))
    convert(layer, Policy(default=nv.NVFP4_NO_SR))
    x, sizes = _rows(1)
    g = jax.random.normal(jax.random.key(2), (x.shape[0], F), BF16)

    def via_layer(layer, x):
        return jnp.sum(layer(x, sizes).astype(jnp.float32) * g)

    def direct(x, kernel):
        y = nv.ragged_dot(x, kernel.astype(BF16), sizes, recipe=nv.NVFP4_NO_SR)
        return jnp.sum(y.astype(jnp.float32) * g)

    value, (d_layer, dx) = nnx.value_and_grad(via_layer, argnums=(0, 1))(layer, x)
    want, (want_dx, want_dw) = jax.value_and_grad(direct, (0, 1))(x, layer.kernel[...])
    _assert_equal((value, dx, d_layer.kernel[...]), (want, want_dx, want_dw))


def test_converted_experts_draw_new_keys_each_call():
    layer = Experts(E, D, F, dtype=BF16, rngs=nnx.Rngs(0))
    convert(layer, Policy(default=nv.NVFP4), nnx.Rngs(nvfp4=3))
    x, sizes = _rows(4)

    @nnx.jit
    def grads(layer, x):
        return nnx.grad(lambda m: jnp.sum(m(x, sizes).astype(jnp.float32) ** 2))(layer)

    first, second = grads(layer, x), grads(layer, x)
    a, b = first.kernel[...], second.kernel[...]
    assert np.all(np.isfinite(np.asarray(a))) and not np.array_equal(a, b)


def test_unconverted_model_without_stream_raises_clearly_under_grad():
    layer = Experts(E, D, F, dtype=BF16, rngs=nnx.Rngs(0))
    convert(layer, Policy(default=nv.NVFP4))  # no rngs: forward only
    x, sizes = _rows()
    layer(x, sizes)  # the forward pass runs
    with pytest.raises(ValueError, match="key"):
        nnx.grad(lambda m: jnp.sum(m(x, sizes).astype(jnp.float32)))(layer)


def test_stacked_experts_in_a_scan_get_per_layer_keys():
    """Experts built by nnx.vmap (kernel [L, E, K, N]) and run by nnx.scan:
    convert stacks their RNG state; training a step changes every layer."""

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Experts(E, D, D, dtype=BF16, rngs=rngs)

    stack = make(nnx.Rngs(0))
    assert stack.kernel[...].shape == (3, E, D, D)
    convert(stack, Policy(default=nv.NVFP4), nnx.Rngs(nvfp4=5))
    assert isinstance(stack.ragged_dot, NNXRaggedDot)
    x, sizes = _rows(6)

    def loss(stack):
        def body(layer, h):
            return layer(h, sizes)

        out = nnx.scan(body, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(stack, x)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grads = nnx.jit(nnx.grad(loss))(stack)
    g = np.asarray(grads.kernel[...])
    assert g.shape == (3, E, D, D) and np.all(np.isfinite(g))
    assert all(np.any(g[i] != 0) for i in range(3))


def test_convert_refuses_experts_that_cannot_run_nvfp4():
    layer = Experts(E, D, 40, dtype=BF16, rngs=nnx.Rngs(0))  # N = 40
    with pytest.raises(ValueError, match="K=32, N=40"):
        convert(layer, Policy(default=nv.NVFP4))


# ---------------------------------------------------------------------- qwix


class LinenExperts(nn.Module):
    """An MoE projection as MaxText writes one: a [E, K, N] param and
    jax.lax.ragged_dot over rows sorted by expert."""

    @nn.compact
    def __call__(self, x, sizes):
        w = self.param("wi", nn.initializers.normal(0.1), (E, D, F), BF16)
        return jax.lax.ragged_dot(x, w, sizes)


class LinenMoE(nn.Module):
    @nn.compact
    def __call__(self, x, sizes):
        return LinenExperts(name="experts")(x, sizes)


def test_qwix_runs_matched_ragged_dot_as_jax_nvfp4_ragged_dot():
    qwix = pytest.importorskip("qwix")
    from jax_nvfp4.qwix import NvFp4Provider, NvFp4Rule

    model = LinenMoE()
    x, sizes = _rows(7)
    params = model.init(jax.random.key(0), x, sizes)
    w = params["params"]["experts"]["wi"]
    provider = NvFp4Provider([NvFp4Rule(module_path=".*experts.*")])
    qmodel = qwix.quantize_model(model, provider)
    got = qmodel.apply(params, x, sizes, rngs={"nvfp4": jax.random.key(1)})
    _assert_equal(got, nv.ragged_dot(x, w, sizes, key=jax.random.key(1)))
    # An unmatched module runs jax.lax.ragged_dot, bit for bit.
    other = NvFp4Provider([NvFp4Rule(module_path=".*router.*")])
    plain = qwix.quantize_model(model, other).apply(params, x, sizes)
    _assert_equal(plain, jax.lax.ragged_dot(x, w, sizes))


class LinenGatedExperts(nn.Module):
    """Two expert weights of one shape (MaxText's wi_0 and wi_1), which qwix
    cannot tell apart by shape."""

    @nn.compact
    def __call__(self, x, sizes):
        w0 = self.param("wi_0", nn.initializers.normal(0.1), (E, D, F), BF16)
        w1 = self.param("wi_1", nn.initializers.normal(0.1), (E, D, F), BF16)

        def experts(x, w0, w1, sizes):
            return jax.lax.ragged_dot(x, w0, sizes), jax.lax.ragged_dot(x, w1, sizes)

        # Inside shard_map, as MaxText runs its experts: qwix sees the
        # shard_map's operands, not the params.
        mesh = jax.make_mesh((1,), ("expert",))
        return jax.shard_map(experts, mesh=mesh, in_specs=P(), out_specs=P())(
            x, w0, w1, sizes
        )


def test_qwix_ragged_dot_weights_of_one_shape_both_run_nvfp4():
    qwix = pytest.importorskip("qwix")
    from jax_nvfp4.qwix import NvFp4Provider, NvFp4Rule

    model = LinenGatedExperts()
    x, sizes = _rows(7)
    params = model.init(jax.random.key(0), x, sizes)
    qmodel = qwix.quantize_model(model, NvFp4Provider([NvFp4Rule(module_path=".*")]))
    got = qmodel.apply(params, x, sizes, rngs={"nvfp4": jax.random.key(1)})
    for name, y in zip(("wi_0", "wi_1"), got, strict=True):
        w = params["params"][name]
        _assert_equal(y, nv.ragged_dot(x, w, sizes, key=jax.random.key(1)))


def test_qwix_ragged_dot_trains():
    qwix = pytest.importorskip("qwix")
    from jax_nvfp4.qwix import NvFp4Provider, NvFp4Rule

    model = LinenMoE()
    x, sizes = _rows(8)
    target = jax.random.normal(jax.random.key(9), (x.shape[0], F), BF16)
    params = model.init(jax.random.key(0), x, sizes)
    qmodel = qwix.quantize_model(model, NvFp4Provider([NvFp4Rule(module_path=".*")]))

    @jax.jit
    def step(params, key):
        def loss(p):
            y = qmodel.apply(p, x, sizes, rngs={"nvfp4": key})
            return jnp.mean((y.astype(jnp.float32) - target) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(
            lambda p, g: p - 0.5 * g.astype(p.dtype), params, grads
        ), value

    losses = []
    for i in range(6):
        params, value = step(params, jax.random.key(i))
        losses.append(float(value))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


# ------------------------------------------------------------------ example


@pytest.mark.parametrize("name", ["llama_flax", "llama_equinox"])
def test_llama_moe_example_trains(name, tmp_path):
    """examples/llama_{flax,equinox}.py --experts 4: top-2 routed SwiGLU
    experts in scanned blocks, their projections in NVFP4 through the policy
    (router and the bf16 tail block excluded); the loss falls."""
    example = importlib.import_module(f"nvfp4_examples.{name}")
    records = example.main(
        [
            "--steps", "8", "--layers", "2", "--d-model", "32", "--heads", "2",
            "--ffn", "48", "--experts", "4", "--batch", "4", "--seq-len", "32",
            "--log-every", "1", "--eval-every", "100", "--out", str(tmp_path),
            "--no-plot",
        ]
    )  # fmt: skip
    losses = [float(r["loss"]) for r in records]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


# ------------------------------------------------------------------ Equinox


def test_equinox_experts_convert_by_path_and_equal_ragged_dot():
    import equinox as eqx

    import jax_nvfp4.equinox as nveqx

    class EqxBlock(eqx.Module):
        router: eqx.nn.Linear
        experts: nveqx.Experts

        def __init__(self, key):
            kr, ke = jax.random.split(key)
            self.router = eqx.nn.Linear(D, E, use_bias=False, key=kr)
            self.experts = nveqx.Experts(E, D, F, key=ke)

    block = EqxBlock(jax.random.key(0))
    x, sizes = _rows(10)
    w = block.experts.weight.astype(BF16)
    _assert_equal(block.experts(x, sizes), jax.lax.ragged_dot(x, w, sizes))
    policy = transformer_policy(
        1, keep_last=0, nvfp4_patterns=("*experts*",), recipe=nv.NVFP4_NO_SR
    )
    converted = nveqx.convert(block, policy)
    assert converted.experts.recipe == nv.NVFP4_NO_SR
    assert type(converted.router) is eqx.nn.Linear
    assert converted.experts.weight is block.experts.weight
    g = jax.random.normal(jax.random.key(11), (x.shape[0], F), BF16)

    def via_layer(experts, x):
        return jnp.sum(experts(x, sizes).astype(jnp.float32) * g)

    def direct(w, x):
        y = nv.ragged_dot(x, w.astype(BF16), sizes, recipe=nv.NVFP4_NO_SR)
        return jnp.sum(y.astype(jnp.float32) * g)

    got = eqx.filter_value_and_grad(via_layer)(converted.experts, x)
    want = jax.value_and_grad(direct)(block.experts.weight, x)
    _assert_equal((got[0], got[1].weight), want)
    # Converting back with a policy that keeps them in bf16.
    back = nveqx.convert(converted, Policy(default=None))
    assert back.experts.recipe is None


def test_equinox_experts_need_a_key_for_stochastic_rounding():
    import equinox as eqx

    import jax_nvfp4.equinox as nveqx

    experts = nveqx.Experts(E, D, F, recipe=nv.NVFP4, key=jax.random.key(0))
    x, sizes = _rows(12)
    # The forward pass draws no random bits: without a key it runs, as dot's.
    np.testing.assert_array_equal(
        experts(x, sizes), experts(x, sizes, key=jax.random.key(5))
    )
    eqx.nn.inference_mode(experts)(x, sizes)  # evaluation: a fixed key

    def loss(m, k):
        return jnp.sum(m(x, sizes, key=k).astype(jnp.float32))

    # Its gradient needs the bits: without a key, a clear error.
    with pytest.raises(ValueError, match="key"):
        eqx.filter_grad(loss)(experts, None)

    grads = [
        eqx.filter_grad(loss)(experts, k).weight
        for k in (jax.random.key(1), jax.random.key(2))
    ]
    assert not np.array_equal(grads[0], grads[1])


def _merged(x, sizes):
    """Rows of every example sorted by group, group-major then example: what
    the Equinox fold hands to one ragged product; and the way back."""
    batch, rows, _ = x.shape
    ends = jnp.cumsum(sizes, axis=-1)
    group = jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(rows), side="right"))(
        ends
    )
    order = jnp.argsort((group * batch + jnp.arange(batch)[:, None]).reshape(-1))
    merged = x.reshape(batch * rows, -1)[order]

    def back(y):
        return jnp.zeros_like(y).at[order].set(y).reshape(batch, rows, -1)

    return merged, jnp.sum(sizes, axis=0), back


def test_equinox_experts_fold_the_batch_into_one_ragged_product():
    """Under vmap (per-example routing) the examples' rows of each expert
    form one group: bf16 equals each example's lax.ragged_dot; NVFP4 equals
    one jax_nvfp4.ragged_dot over the merged rows, forward and gradients."""
    import equinox as eqx

    import jax_nvfp4.equinox as nveqx

    x = jax.random.normal(jax.random.key(20), (3, 24, D), BF16)
    sizes = jnp.array([[8, 0, 10, 6], [24, 0, 0, 0], [1, 5, 9, 9]], jnp.int32)
    experts = nveqx.Experts(E, D, F, key=jax.random.key(21))
    w = experts.weight.astype(BF16)
    got = jax.vmap(experts)(x, sizes)
    for b in range(3):
        _assert_equal(got[b], jax.lax.ragged_dot(x[b], w, sizes[b]))

    experts = experts.with_recipe(nv.NVFP4_NO_SR)
    g = jax.random.normal(jax.random.key(22), (3, 24, F), BF16)

    def via_layer(experts, x):
        y = jax.vmap(experts)(x, sizes)
        return jnp.sum(y.astype(jnp.float32) * g)

    def direct(w, x):
        merged, total, back = _merged(x, sizes)
        y = back(nv.ragged_dot(merged, w.astype(BF16), total, recipe=nv.NVFP4_NO_SR))
        return jnp.sum(y.astype(jnp.float32) * g)

    value, grads = eqx.filter_value_and_grad(via_layer)(experts, x)
    want = jax.value_and_grad(direct)(experts.weight, x)
    _assert_equal((value, grads.weight), want)


def test_ragged_dot_under_vmap_is_per_example():
    """vmap of jax_nvfp4.ragged_dot (not folded): each example its own groups
    and amaxes, equal to calling it on each example."""
    x = jax.random.normal(jax.random.key(30), (3, 40, D), BF16)
    w = jax.random.normal(jax.random.key(31), (E, D, F), BF16)
    sizes = jnp.array([[10, 10, 10, 10], [40, 0, 0, 0], [5, 15, 20, 0]], jnp.int32)
    key = jax.random.key(32)

    def f(x, s):
        return nv.ragged_dot(x, w, s, key=key)

    batched = jax.vmap(f)(x, sizes)
    for b in range(3):
        _assert_equal(batched[b], f(x[b], sizes[b]))


def test_ragged_dot_training_step_exports():
    """jax.export of a step's weight gradient round-trips with the same bits."""
    from jax import export

    x, sizes = _rows(33, tokens=64)
    sizes = jnp.array([20, 0, 30, 14], jnp.int32)
    w = jax.random.normal(jax.random.key(34), (E, D, F), BF16)
    key = jax.random.key(35)

    def step(x, w, sizes, key):
        def loss(w):
            return jnp.sum(nv.ragged_dot(x, w, sizes, key=key).astype(jnp.float32))

        return jax.grad(loss)(w)

    exported = export.export(jax.jit(step), disabled_checks=nv.export_safety_checks())(
        x, w, sizes, key
    )
    back = export.deserialize(exported.serialize())
    _assert_equal(back.call(x, w, sizes, key), jax.jit(step)(x, w, sizes, key))


def test_qwix_nnx_ragged_dot_runs_nvfp4():
    """An NNX module calling jax.lax.ragged_dot on its [E, K, N] param, as
    MaxText's MoE does: qwix with an NvFp4Rule runs jax_nvfp4.ragged_dot."""
    qwix = pytest.importorskip("qwix")
    from jax_nvfp4.qwix import NvFp4Provider, NvFp4Rule, set_rngs

    class NNXExperts(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.normal(0.1)
            self.wi = nnx.Param(init(rngs.params(), (E, D, F), BF16))

        def __call__(self, x, sizes):
            return jax.lax.ragged_dot(x, self.wi[...], sizes)

    x, sizes = _rows(40)
    model = NNXExperts(nnx.Rngs(0))
    w = model.wi[...]
    rule = NvFp4Rule(module_path=".*", recipe=nv.NVFP4_NO_SR)
    qmodel = qwix.quantize_model(model, NvFp4Provider([rule]), x, sizes)
    set_rngs(qmodel, nnx.Rngs(nvfp4=1))
    got = qmodel(x, sizes)
    _assert_equal(got, nv.ragged_dot(x, w, sizes, recipe=nv.NVFP4_NO_SR))
