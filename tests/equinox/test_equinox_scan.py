"""jax_nvfp4.equinox under lax.scan over stacked layers: the vmap fold
through scan / checkpoint bodies (in the jaxpr and bit for bit against the
layers on the flattened tokens), the cases that fall back to per-example
batching, and stacked layers converted with keep_last."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4 import equinox as nveqx
from jax_nvfp4.equinox import conversion as eqx_conversion
from jax_nvfp4.equinox import linear as eqx_linear
from jax_nvfp4.policy import transformer_policy

D, F = 32, 48  # model width and hidden width (multiples of 16, distinct)
B, S = 3, 40  # 120 tokens: padded to 128 when folded, to 3 x 48 if not
L = 3  # stacked blocks
KEY = jax.random.key(7)


class Mlp(eqx.Module):
    mlp_up: eqx.Module
    mlp_down: eqx.Module

    def __init__(self, key):
        ku, kd = jax.random.split(key)
        self.mlp_up = eqx.nn.Linear(D, F, key=ku)
        self.mlp_down = eqx.nn.Linear(F, D, use_bias=False, key=kd)

    def __call__(self, h, key, per_position):
        """h [S, D] per example, Equinox style (a vmap over the positions), or
        [tokens, D] called on the layers directly (per_position False)."""
        ku, kd = jax.random.split(key)

        def apply(layer, h, k):
            if per_position:
                return jax.vmap(lambda v: layer(v, key=k))(h)
            return layer(h, key=k)

        return h + apply(self.mlp_down, jax.nn.gelu(apply(self.mlp_up, h, ku)), kd)


class Stacked(eqx.Module):
    layers: Mlp  # every array with a leading [L] axis

    def __init__(self, key):
        self.layers = eqx.filter_vmap(Mlp)(jax.random.split(key, L))

    def __call__(self, h, key, *, per_position=True, wrap=None):
        """wrap: None, "jit" or a jax.checkpoint policy for the scan body."""
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, xs):
            p, k = xs
            return eqx.combine(p, static)(h, k, per_position), None

        if wrap == "jit":
            body = jax.jit(body)
        elif wrap is not None:
            body = jax.checkpoint(body, policy=wrap, prevent_cse=False)
        return jax.lax.scan(body, h, (params, jax.random.split(key, L)))[0]


def _random_init(build, seed=0):
    """``build()``'s module with random arrays made in NumPy (fast tests)."""
    rng = np.random.default_rng(seed)

    def fill(leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        bound = 1 / np.sqrt(leaf.shape[-1])
        return jnp.asarray(rng.uniform(-bound, bound, leaf.shape), leaf.dtype)

    return jax.tree.map(fill, eqx.filter_eval_shape(build))


def _model(policy=None):
    model = _random_init(lambda: Stacked(jax.random.key(0)))
    return nveqx.convert(model, policy or transformer_policy(L, keep_last=0))


def _inputs():
    x = jax.random.normal(jax.random.key(1), (B, S, D), jnp.float32)
    g = jax.random.normal(jax.random.key(2), (B, S, D), jnp.float32)
    return x, g


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _eqns(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _eqns(sub)


def _primitives(fn, *args):
    """{primitive name: [first operand shapes]} of fn's jaxpr, nested ones in."""
    found = {}
    for eqn in _eqns(eqx.filter_make_jaxpr(fn)(*args)[0].jaxpr):
        shape = eqn.invars[0].aval.shape if eqn.invars else ()
        found.setdefault(eqn.primitive.name, []).append(tuple(shape))
    return found


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


def _weights(tree):
    """The weights of a gradient (biases are summed by JAX outside the fold,
    in another order than over the flat tokens: not compared bit for bit)."""
    return [
        leaf.weight
        for leaf in jax.tree.leaves(tree, is_leaf=eqx_conversion._is_linear)
        if eqx_conversion._is_linear(leaf)
    ]


def _output_and_grads(f):
    """f(model, x), and the gradients of sum(f(model, x) * g): the weights'
    and x's (jitted)."""
    model, (x, g) = _model(), _inputs()

    def loss(mx):
        y = f(*mx)
        return jnp.sum(y * g), y

    value_and_grad = eqx.filter_value_and_grad(loss, has_aux=True)
    (_, y), (dm, dx) = eqx.filter_jit(value_and_grad)((model, x))
    return y, _weights(dm), dx


@functools.cache
def _on_flat_tokens():
    """The reference: the layers called on the flattened [tokens, D] input."""

    def flat(m, x):
        y = m(x.reshape(B * S, D), KEY, per_position=False)
        return y.reshape(B, S, D)

    return _output_and_grads(flat)


@pytest.mark.parametrize("wrap", [None, nv.save_fp4_residuals, "jit"])
def test_vmap_of_scan_folds_into_one_gemm_per_layer(wrap):
    model, (x, g) = _model(), _inputs()

    def batched(m, x):  # vmap over examples; each vmaps over its positions
        return jax.vmap(lambda xi: m(xi, KEY, wrap=wrap))(x)

    # Each GEMM runs over all B * S = 120 tokens, padded once to 128 (codes
    # hold two values a byte): FPROP and DGRAD take [1, 128, features / 2],
    # WGRAD dY^T [1, features, 64]. Per sequence it would be [3, 48, ...].
    forward = _primitives(batched, model, x)
    assert forward["nvfp4_matmul"] == [(1, 128, D // 2), (1, 128, F // 2)]
    loss = eqx.filter_grad(lambda m, x: jnp.sum(batched(m, x) * g))
    gemms = _primitives(loss, model, x)["nvfp4_matmul"]
    assert len(gemms) >= 6
    for shape in gemms:
        assert shape[0] == 1 and (shape[1] == 128 or shape[2] == 64), gemms

    # Bit for bit the computation on the flat tokens, forward and backward.
    _assert_equal(_output_and_grads(batched), _on_flat_tokens())


def test_unbatched_scan_inside_vmap_is_the_plain_dot():
    # The vmap maps none of the scan's operands and hands the scan on
    # unbatched: the fold primitive is in the jaxpr, and grad differentiates
    # it as the plain dot.
    model, (x, g) = _model(), _inputs()
    scales = jnp.arange(1.0, B + 1.0)

    def ours(mx):
        m, x = mx
        y = jax.vmap(lambda s: s * m(x[0], KEY))(scales)
        return jnp.sum(y * g)

    def reference(mx):
        m, x = mx
        return jnp.sum(scales[:, None, None] * m(x[0], KEY)[None] * g)

    assert "nvfp4_equinox_fold" in _primitives(ours, (model, x))
    got = eqx.filter_jit(eqx.filter_value_and_grad(ours))((model, x))
    want = eqx.filter_jit(eqx.filter_value_and_grad(reference))((model, x))
    _assert_equal(got[0], want[0])
    _assert_equal(_weights(got[1][0]), _weights(want[1][0]))
    _assert_equal(got[1][1], want[1][1])


def test_vmap_of_per_example_grad_through_scan_is_per_example():
    model, (x, g) = _model(), _inputs()

    def grad_of_one(m, xi, gi):
        return eqx.filter_grad(lambda m: jnp.sum(m(xi, KEY) * gi))(m)

    per_example = jax.vmap(grad_of_one, in_axes=(None, 0, 0))
    assert "nvfp4_equinox_fold" not in _primitives(per_example, model, x, g)
    got = eqx.filter_jit(per_example)(model, x, g)
    one = eqx.filter_jit(grad_of_one)
    for i in range(B):
        want = one(model, x[i], g[i])
        _assert_equal([w[i] for w in _weights(got)], [w for w in _weights(want)])


# ---------------------------------------------------- stacked layers, convert


def test_convert_stacked_layers_with_keep_last():
    base = _model(nv.policy.Policy())  # nothing converted: eqx.nn.Linear stacks
    policy = transformer_policy(L, keep_last=1)
    plan = nveqx.plan(base, policy)
    kept = (nv.NVFP4,) * (L - 1) + (None,)
    assert plan == {"layers.mlp_up": kept, "layers.mlp_down": kept}
    model = nveqx.convert(base, policy)
    up = model.layers.mlp_up
    assert isinstance(up, nveqx.Linear) and up.weight.shape == (L, F, D)
    assert up.weight is base.layers.mlp_up.weight
    np.testing.assert_array_equal(up.nvfp4, [True] * (L - 1) + [False])
    # keep_last=0: all in NVFP4, no switch; keep_last=L: left as it is.
    assert (
        nveqx.convert(base, transformer_policy(L, keep_last=0)).layers.mlp_up.nvfp4
        is None
    )
    assert nveqx.convert(base, transformer_policy(L, keep_last=L)) is base

    # Every layer applied to the same input inside one scan (each step one
    # layer): the last is bf16 bit for bit, the others NVFP4, forward and
    # backward (gradients through both branches of the cond).
    x, g = _inputs()
    h = x[0]  # [S, D]
    gh = jax.random.normal(jax.random.key(3), (L, S, F), jnp.float32)

    def per_layer(stack, h):
        params, static = eqx.partition(stack, eqx.is_array)

        def body(_, p):
            layer = eqx.combine(p, static)
            return None, jax.vmap(lambda v: layer(v, key=KEY))(h)

        return jax.lax.scan(body, None, params)[1]

    def layer_i(stack, i):
        return jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, stack)

    def reference(stack, h):
        outs = []
        for i in range(L):
            layer = layer_i(stack, i)
            if i < L - 1:  # the NVFP4 Linear on its own
                layer = nveqx.Linear.from_linear(layer, nv.NVFP4)
            else:  # eqx.nn.Linear, as in the unconverted model
                layer = eqx_linear._to_eqx_linear(layer)
            outs.append(jax.vmap(lambda v, m=layer: m(v, key=KEY))(h))
        return jnp.stack(outs)

    def loss(f):
        return lambda stack, h: jnp.sum(f(stack, h) * gh)

    stack = model.layers.mlp_up
    _assert_equal_on_cpu(
        eqx.filter_jit(per_layer)(stack, h), eqx.filter_jit(reference)(stack, h)
    )
    got = eqx.filter_jit(eqx.filter_grad(loss(per_layer)))(stack, h)
    want = eqx.filter_jit(eqx.filter_grad(loss(reference)))(stack, h)
    _assert_equal_on_cpu(got.weight, want.weight)
    _assert_equal_on_cpu(got.bias, want.bias)
    bf16 = eqx.filter_jit(per_layer)(base.layers.mlp_up, h)
    ours = eqx.filter_jit(per_layer)(stack, h)
    _assert_equal_on_cpu(ours[-1], bf16[-1])
    assert not np.array_equal(np.asarray(ours[0]), np.asarray(bf16[0]))


def test_mixed_stack_folds_inside_the_cond():
    model = _model(transformer_policy(L, keep_last=1))
    x, g = _inputs()

    def loss(m, x):
        return jnp.sum(jax.vmap(lambda xi: m(xi, KEY))(x) * g)

    found = _primitives(eqx.filter_grad(loss), model, x)
    assert "cond" in found
    # Each GEMM's first operand holds all 128 tokens: [1, 128, K/2] codes for
    # FPROP, and for WGRAD [1, K, 64] codes, or [1, K, 128] bf16 values where
    # the fused quantize writes decoded operands (on a GPU).
    for shape in found["nvfp4_matmul"]:
        assert shape[0] == 1 and (shape[1] == 128 or shape[2] in (64, 128)), shape
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model, x)
    for w in _weights(grads):
        assert np.all(np.isfinite(np.asarray(w))) and np.any(np.asarray(w) != 0)


# ------------------------------------------------------------------ example


def _example():
    from nvfp4_examples import llama_equinox

    return llama_equinox


def test_llama_equinox_example_folds_and_trains(tmp_path):
    """examples/llama_equinox.py: stacked blocks under lax.scan with the remat
    policy that keeps the FP4 residuals, the last block in bf16 by the
    per-layer switch; every GEMM of a training step runs over the batch's
    4 x 32 = 128 tokens at once, and the loss falls."""
    example = _example()
    model = example.Llama(d_model=32, layers=2, heads=2, ffn=64, key=KEY)
    model = nveqx.convert(model, transformer_policy(2, keep_last=1))
    assert model.layers.mlp.up_proj.nvfp4.tolist() == [True, False]
    batch = jnp.zeros((4, 33), jnp.int32)
    loss = eqx.filter_grad(lambda m: example.loss_fn(example.to_bf16(m), batch, KEY))
    found = _primitives(loss, model)
    assert "cond" in found and "scan" in found
    assert "remat2" in found or "checkpoint" in found  # the name varies by JAX
    # Each GEMM's first operand holds all 128 tokens: [1, 128, K/2] codes for
    # FPROP, and for WGRAD [1, K, 64] codes, or [1, K, 128] bf16 values where
    # the fused quantize writes decoded operands (on a GPU).
    for shape in found["nvfp4_matmul"]:
        assert shape[0] == 1 and (shape[1] == 128 or shape[2] in (64, 128)), shape

    records = example.main(
        [
            "--steps", "8", "--layers", "2", "--d-model", "32", "--heads", "2",
            "--ffn", "64", "--batch", "4", "--seq-len", "32", "--log-every", "1",
            "--eval-every", "100", "--out", str(tmp_path), "--no-plot",
        ]
    )  # fmt: skip
    losses = [float(r["loss"]) for r in records]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_llama_equinox_bf16_tail_stack_needs_no_switch():
    """The example's last block as a stack of its own, kept in bf16 by path:
    the first stack converts whole (no per-layer switch, so no cond and no
    bf16 residuals of a second branch), the tail stays eqx.nn.Linear."""
    example = _example()
    model = example.Llama(d_model=32, layers=3, heads=2, ffn=64, tail_layers=1, key=KEY)
    assert model.layers.mlp.up_proj.weight.shape[0] == 2
    assert model.tail.mlp.up_proj.weight.shape[0] == 1
    policy = transformer_policy(3, keep_last=0, bf16_patterns=("tail.*",))
    model = nveqx.convert(model, policy)
    assert isinstance(model.layers.mlp.up_proj, nveqx.Linear)
    assert model.layers.mlp.up_proj.nvfp4 is None  # all layers in NVFP4
    assert type(model.tail.mlp.up_proj) is eqx.nn.Linear
    batch = jnp.zeros((2, 17), jnp.int32)
    loss = eqx.filter_grad(lambda m: example.loss_fn(example.to_bf16(m), batch, KEY))
    found = _primitives(loss, model)
    assert "cond" not in found and "scan" in found
    assert found["nvfp4_matmul"]


def _built_example(*flags):
    """The example's model for a tiny size and these flags, as its command
    line builds it."""
    import argparse

    from nvfp4_examples import train_common

    parser = argparse.ArgumentParser()
    train_common.add_common_flags(parser)
    parser.add_argument("--attention", default="xla")
    parser.add_argument("--remat", default="none")
    args = parser.parse_args(
        ["--layers", "2", "--d-model", "32", "--heads", "2", "--ffn", "64", *flags]
    )
    return _example().build(args)[0]


@pytest.mark.parametrize(
    "layers, attention_in_nvfp4", [("mlp", False), ("mlp+attn", True)]
)
def test_llama_equinox_nvfp4_layers_flag(layers, attention_in_nvfp4):
    """--nvfp4-layers: the MLPs alone (the recipe's choice), or the attention
    projections too (benchmarks/convergence.py's nvfp4_attn run)."""
    model = _built_example("--nvfp4-layers", layers)
    assert isinstance(model.layers.mlp.up_proj, nveqx.Linear)
    converted = isinstance(model.layers.attn.q_proj, nveqx.Linear)
    assert converted == attention_in_nvfp4
    assert type(model.tail.attn.q_proj) is eqx.nn.Linear  # the bf16 tail


@pytest.mark.parametrize(
    "precision",
    ["nvfp4_1d_weights", "nvfp4_bf16_fprop", "nvfp4_bf16_dgrad", "nvfp4_bf16_wgrad"],
)
def test_llama_equinox_ablation_precisions(precision):
    """--precision's ablations (benchmarks/convergence.py's runs that find why
    a bound fails): the converted layers carry that recipe, and the gradient
    runs one NVFP4 GEMM fewer per layer where a GEMM is kept in bf16."""
    from nvfp4_examples import train_common

    example = _example()
    model = _built_example("--precision", precision)
    assert model.layers.mlp.up_proj.recipe == train_common.PRECISIONS[precision]
    batch = jnp.arange(2 * 17, dtype=jnp.int32).reshape(2, 17) % 256

    def gemms(m):
        grad = eqx.filter_grad(
            lambda m: example.loss_fn(example.to_bf16(m), batch, KEY)
        )
        return len(_primitives(grad, m).get("nvfp4_matmul", [])), grad(m)

    count, grads = gemms(model)
    full_count, _ = gemms(_built_example("--precision", "nvfp4"))
    kept_in_bf16 = precision.startswith("nvfp4_bf16_")
    assert count == (2 * full_count // 3 if kept_in_bf16 else full_count)
    for leaf in jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array)):
        assert bool(jnp.all(jnp.isfinite(leaf)))
