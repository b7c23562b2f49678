"""A Llama-style byte-level decoder in Equinox, trained in bf16 or NVFP4.

RMSNorm, SwiGLU MLP, causal attention with rotary position embeddings,
vocabulary of 256 bytes. Parameters are float32 master weights; each step casts
them to bfloat16 for the forward and backward pass (the gradient flows back
through the cast), and AdamW with linear warmup and cosine decay updates the
float32 copy. With ``--precision nvfp4*`` the model is converted by
``jax_nvfp4.equinox.convert`` under ``transformer_policy``: the MLP linears of
all but the last ``--keep-last`` blocks run the NVFP4 recipe; attention,
embeddings and the output head stay in bf16.

Production shape: the blocks are stacks, built by ``eqx.filter_vmap``
(every array has a leading layer axis) and run by ``lax.scan``, so compile
time does not grow with depth; each scan step is wrapped in
``jax.checkpoint`` with ``--remat`` (default: keep only the NVFP4 layers' FP4
residuals, ``jax_nvfp4.save_fp4_residuals``, and recompute the rest). The
stacked MLP linears become stacked ``jax_nvfp4.equinox.Linear``s. The last
``--keep-last`` blocks are a second stack (``tail``) that the policy keeps in
bf16 by its path. Each step of the scan gets its own stochastic-rounding key
(``jax.random.split`` over the layers, scanned with the weights).

The model is written per example and per position, the Equinox way:
``jax.vmap`` over the batch of a model that ``jax.vmap``s its linears over
the positions; the NVFP4 layers fold both maps -- through the scan and the
checkpoint -- into one GEMM over all tokens of the batch.

    python examples/text_data.py prepare --out .data/      # once (network)
    python examples/llama_equinox.py --precision nvfp4     # CPU: about a minute

benchmarks/convergence.py has the GPU-sized flags.
"""

from __future__ import annotations

import argparse
import glob
import math
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jax_nvfp4.equinox as nveqx
from jax_nvfp4 import save_fp4_residuals
from jax_nvfp4.policy import transformer_policy
from nvfp4_examples import moe_routing, train_common

VOCAB = 256


def _split(key: jax.Array | None, n: int) -> list[jax.Array | None]:
    return [None] * n if key is None else list(jax.random.split(key, n))


def _per_position(layer, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """Applies a per-vector layer to every position of x [S, d] (shared key)."""
    return jax.vmap(lambda v: layer(v, key=key))(x)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / rms(x) * weight along the last axis, in float32, back to x's dtype."""
    x32 = x.astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * scale * weight.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(eqx.Module):
    weight: jax.Array
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-6):
        self.weight = jnp.ones((dim,), jnp.float32)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight, self.eps)


def rope_tables(seq_len: int, head_dim: int, base: float = 10000.0):
    """cos, sin [seq_len, head_dim / 2] (float32) of rotary embeddings."""
    inv = 1.0 / base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [S, heads, head_dim]; rotates the two halves of each head."""
    x32 = x.astype(jnp.float32)
    a, b = jnp.split(x32, 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([a * c - b * s, a * s + b * c], axis=-1).astype(x.dtype)


class Attention(eqx.Module):
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    implementation: str | None = eqx.field(static=True)

    def __init__(self, d: int, heads: int, *, implementation=None, key: jax.Array):
        if d % heads or (d // heads) % 2:
            raise ValueError(f"d_model={d} must split into {heads} even-sized heads")
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q_proj = eqx.nn.Linear(d, d, use_bias=False, key=kq)
        self.k_proj = eqx.nn.Linear(d, d, use_bias=False, key=kk)
        self.v_proj = eqx.nn.Linear(d, d, use_bias=False, key=kv)
        self.o_proj = eqx.nn.Linear(d, d, use_bias=False, key=ko)
        self.heads = heads
        self.implementation = implementation

    def __call__(self, x, cos, sin, *, key=None):
        s, d = x.shape
        hd = d // self.heads
        kq, kk, kv, ko = _split(key, 4)
        q = _per_position(self.q_proj, x, kq).reshape(s, self.heads, hd)
        k = _per_position(self.k_proj, x, kk).reshape(s, self.heads, hd)
        v = _per_position(self.v_proj, x, kv).reshape(s, self.heads, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Causal softmax(q k^T / sqrt(hd)) v; logits and softmax in float32.
        out = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=self.implementation
        ).reshape(s, d)
        return _per_position(self.o_proj, out, ko)


class Mlp(eqx.Module):
    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __init__(self, d: int, ffn: int, *, key: jax.Array):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate_proj = eqx.nn.Linear(d, ffn, use_bias=False, key=kg)
        self.up_proj = eqx.nn.Linear(d, ffn, use_bias=False, key=ku)
        self.down_proj = eqx.nn.Linear(ffn, d, use_bias=False, key=kd)

    def __call__(self, x, *, key=None):
        kg, ku, kd = _split(key, 3)
        gate = _per_position(self.gate_proj, x, kg)
        up = _per_position(self.up_proj, x, ku)
        return _per_position(self.down_proj, jax.nn.silu(gate) * up, kd)


class MoE(eqx.Module):
    """SwiGLU experts: each position routed to its top_k of the experts (the
    router in fp32), the projections ``jax_nvfp4.equinox.Experts`` over the
    rows sorted by expert (one example's rows: its own groups)."""

    router: eqx.nn.Linear
    gate_proj: nveqx.Experts
    up_proj: nveqx.Experts
    down_proj: nveqx.Experts
    top_k: int = eqx.field(static=True)

    def __init__(self, d: int, ffn: int, experts: int, *, top_k: int, key):
        kr, kg, ku, kd = jax.random.split(key, 4)
        self.router = eqx.nn.Linear(d, experts, use_bias=False, key=kr)
        self.gate_proj = nveqx.Experts(experts, d, ffn, key=kg)
        self.up_proj = nveqx.Experts(experts, d, ffn, key=ku)
        self.down_proj = nveqx.Experts(experts, ffn, d, key=kd)
        self.top_k = top_k

    def __call__(self, x, *, key=None):
        kg, ku, kd = _split(key, 3)
        logits = jax.vmap(self.router)(x.astype(jnp.float32))
        rows, sizes, order, weights = moe_routing.route(x, logits, self.top_k)
        h = jax.nn.silu(self.gate_proj(rows, sizes, key=kg))
        h = h * self.up_proj(rows, sizes, key=ku)
        return moe_routing.combine(self.down_proj(h, sizes, key=kd), order, weights)


class Block(eqx.Module):
    attn_norm: RMSNorm
    attn: Attention
    mlp_norm: RMSNorm
    mlp: Mlp | MoE

    def __init__(
        self, d: int, heads: int, ffn: int, *, attention=None, experts=0, top_k=2, key
    ):
        ka, km = jax.random.split(key)
        self.attn_norm = RMSNorm(d)
        self.attn = Attention(d, heads, implementation=attention, key=ka)
        self.mlp_norm = RMSNorm(d)
        if experts:
            self.mlp = MoE(d, ffn, experts, top_k=top_k, key=km)
        else:
            self.mlp = Mlp(d, ffn, key=km)

    def __call__(self, x, cos, sin, *, key=None):
        ka, km = _split(key, 2)
        x = x + self.attn(jax.vmap(self.attn_norm)(x), cos, sin, key=ka)
        return x + self.mlp(jax.vmap(self.mlp_norm)(x), key=km)


# --remat: what jax.checkpoint keeps of each block for the backward pass.
REMAT_POLICIES = {
    "none": None,  # no remat: XLA keeps what the backward pass reads
    "fp4": save_fp4_residuals,  # only the FP4 residuals; the rest recomputed
    "dots": jax.checkpoint_policies.dots_saveable,  # every matmul output
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute everything
}


class Llama(eqx.Module):
    """Token ids [S] -> logits [S, 256] (fp32), one example. ``experts`` > 0
    makes each block's MLP a mixture of SwiGLU experts (``MoE``).

    ``tail_layers`` > 0 makes the last blocks a second stack (``tail``,
    scanned after ``layers``), so that a policy can keep them in bf16 by path
    (``bf16_patterns=("tail.*",)``) instead of by a per-layer switch inside
    one scan, whose ``cond`` keeps both branches' residuals under ``grad``.
    """

    embed: eqx.nn.Embedding
    layers: Block  # a stack: every array with a leading layer axis
    tail: Block | None  # the last tail_layers blocks, stacked likewise
    norm: RMSNorm
    lm_head: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)
    remat: str = eqx.field(static=True)

    def __init__(
        self,
        *,
        d_model,
        layers,
        heads,
        ffn,
        attention=None,
        remat="fp4",
        tail_layers=0,
        experts=0,
        top_k=2,
        key,
    ):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}")
        if not 0 <= tail_layers < layers:
            raise ValueError(
                f"tail_layers={tail_layers} must be >= 0 and below layers={layers}"
            )
        ke, kh, kl = jax.random.split(key, 3)
        weight = 0.02 * jax.random.normal(ke, (VOCAB, d_model), jnp.float32)
        self.embed = eqx.nn.Embedding(weight=weight)

        def block(k):
            return Block(
                d_model,
                heads,
                ffn,
                attention=attention,
                experts=experts,
                top_k=top_k,
                key=k,
            )

        keys = jax.random.split(kl, layers)
        head = layers - tail_layers
        self.layers = eqx.filter_vmap(block)(keys[:head])
        self.tail = eqx.filter_vmap(block)(keys[head:]) if tail_layers else None
        self.norm = RMSNorm(d_model)
        self.lm_head = eqx.nn.Linear(d_model, VOCAB, use_bias=False, key=kh)
        self.heads = heads
        self.num_layers = layers
        self.remat = remat

    def __call__(self, tokens: jax.Array, *, key=None) -> jax.Array:
        """tokens int32 [S] -> logits float32 [S, 256] (one example)."""
        x = jax.vmap(self.embed)(tokens)
        cos, sin = rope_tables(tokens.shape[0], x.shape[-1] // self.heads)
        keys = None if key is None else jax.random.split(key, self.num_layers)
        head = self.num_layers - (0 if self.tail is None else _stack_size(self.tail))
        x = _scan_blocks(self.layers, x, cos, sin, keys, 0, head, self.remat)
        if self.tail is not None:
            x = _scan_blocks(self.tail, x, cos, sin, keys, head, None, self.remat)
        x = jax.vmap(self.norm)(x)
        return _per_position(self.lm_head, x, None).astype(jnp.float32)


def _stack_size(stack: Block) -> int:
    return stack.attn_norm.weight.shape[0]


def _scan_blocks(stack, x, cos, sin, keys, start, stop, remat):
    """Runs the stack's blocks in order with lax.scan: the scan slices every
    array of the stack (weights, and the per-layer NVFP4 switch of converted
    layers) and the per-layer keys (keys[start:stop])."""
    params, static = eqx.partition(stack, eqx.is_array)
    keys = None if keys is None else keys[start:stop]

    def step(x, layer):
        block_params, k = layer
        return eqx.combine(block_params, static)(x, cos, sin, key=k), None

    if remat != "none":
        step = jax.checkpoint(step, policy=REMAT_POLICIES[remat], prevent_cse=False)
    return jax.lax.scan(step, x, (params, keys))[0]


def to_bf16(model):
    """The bf16 compute copy of the float32 master weights."""
    return jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, model
    )


def loss_fn(model, batch: jax.Array, key: jax.Array | None) -> jax.Array:
    """Mean next-byte cross-entropy of int32 [B, S + 1] windows."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = jax.vmap(lambda t: model(t, key=key))(inputs)  # shared key
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_train_step(optimizer):
    """The jitted training step ``((model, opt_state), batch, key) ->
    ((model, opt_state), loss)``: the loss of the bf16 compute copy, its
    gradients to the float32 master weights, one optimizer update."""

    @eqx.filter_jit(donate="all")
    def train_step(state, batch, key):
        model, opt_state = state

        def loss_of(model):
            return loss_fn(to_bf16(model), batch, key)

        loss, grads = eqx.filter_value_and_grad(loss_of)(model)
        updates, opt_state = optimizer.update(
            grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
        )
        return (eqx.apply_updates(model, updates), opt_state), loss

    return train_step


def build(args: argparse.Namespace):
    """(model, optimizer, schedule, policy or None) for the flags."""
    # The last --keep-last blocks are the model's tail stack, kept in bf16
    # (one stack, with every block in bf16, if that is all of them).
    tail = args.keep_last if args.keep_last < args.layers else 0
    model = Llama(
        d_model=args.d_model,
        layers=args.layers,
        heads=args.heads,
        ffn=args.ffn,
        attention=None if args.attention == "xla" else args.attention,
        remat=args.remat,
        tail_layers=tail,
        experts=args.experts,
        top_k=args.top_k,
        key=jax.random.key(args.seed),
    )
    recipe = train_common.PRECISIONS[args.precision]
    policy = None
    if recipe is not None:
        policy = transformer_policy(
            args.layers,
            recipe=recipe,
            keep_last=args.keep_last - tail,
            nvfp4_patterns=train_common.NVFP4_LAYERS[args.nvfp4_layers],
            bf16_patterns=("tail.*", "*router*"),
        )
        model = nveqx.convert(model, policy)
    optimizer, schedule = train_common.make_optimizer(args)
    return model, optimizer, schedule, policy


def count_nvfp4_layers(model) -> tuple[int, int]:
    """(linear layers and expert projections, those in NVFP4), each layer of
    a stack counted; an ``Experts`` (all experts of one projection) is one."""

    def is_layer(node):
        return isinstance(node, (eqx.nn.Linear, nveqx.Linear, nveqx.Experts))

    total = converted = 0
    for layer in jax.tree.leaves(model, is_leaf=is_layer):
        if not is_layer(layer):
            continue
        own = 3 if isinstance(layer, nveqx.Experts) else 2
        size = math.prod(layer.weight.shape[:-own])
        total += size
        if isinstance(layer, nveqx.Experts):
            converted += size if layer.recipe is not None else 0
        elif isinstance(layer, nveqx.Linear):
            converted += size if layer.nvfp4 is None else int(layer.nvfp4.sum())
    return total, converted


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    train_common.add_common_flags(parser)
    parser.add_argument(
        "--label", default=None, help="run name (default: equinox_<precision>)"
    )
    parser.add_argument(
        "--attention",
        choices=("xla", "cudnn"),
        default="xla",
        help="jax.nn.dot_product_attention implementation (cudnn: flash "
        "attention on NVIDIA GPUs)",
    )
    parser.add_argument(
        "--remat",
        choices=sorted(REMAT_POLICIES),
        default="fp4",
        help="what each block keeps for the backward pass: fp4 = only the NVFP4 "
        "layers' FP4 residuals (jax_nvfp4.save_fp4_residuals), dots = every matmul "
        "output, full = nothing, none = no remat",
    )
    parser.add_argument(
        "--operand-stats",
        default=None,
        metavar="JSON",
        help="after training, measure every operand the NVFP4 recipe quantizes "
        "(x, w, dY per layer; jax_nvfp4.statistics.operand_stats) on the first "
        "held-out batch and write the records here",
    )
    parser.add_argument(
        "--plot",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="draw every CSV in --out into <out>/loss_equinox.png (matplotlib)",
    )
    args = parser.parse_args(argv)
    label = args.label or f"equinox_{args.precision}"

    model, optimizer, schedule, _ = build(args)
    params = eqx.filter(model, eqx.is_inexact_array)
    n_params = sum(a.size for a in jax.tree.leaves(params))
    total, converted = count_nvfp4_layers(model)
    print(
        f"{label}: {n_params / 1e6:.1f}M parameters; {converted} of {total} "
        f"{'linear and expert layers' if args.experts else 'linear layers'} in "
        f"NVFP4 ({args.precision}, --remat {args.remat})",
        flush=True,
    )

    opt_state = optimizer.init(params)
    train_step = make_train_step(optimizer)

    @eqx.filter_jit
    def eval_loss(state, batch):
        model = eqx.nn.inference_mode(to_bf16(state[0]))
        return loss_fn(model, batch, None)

    flops = train_common.llama_flops_per_token(
        d_model=args.d_model, layers=args.layers, ffn=args.ffn, seq_len=args.seq_len
    )

    def measure_operands(state):
        trained, static = eqx.partition(state[0], eqx.is_inexact_array)
        _, held_out = train_common.load_splits(args)
        batch = train_common.eval_batches(held_out, args.batch, args.seq_len, 1)[0]

        def loss_of(trained, batch, key):
            model = to_bf16(eqx.combine(trained, static))
            return loss_fn(model, batch, key)

        train_common.write_operand_stats(
            args.operand_stats,
            jax.grad(loss_of),
            trained,
            jnp.asarray(batch),
            jax.random.key(args.seed + 2),
        )

    records = train_common.run_training(
        label=label,
        args=args,
        train_step=train_step,
        state=(model, opt_state),
        flops_per_token=flops,
        eval_loss=eval_loss,
        schedule=schedule,
        on_done=measure_operands if args.operand_stats else None,
    )
    if args.plot:
        png = os.path.join(args.out, "loss_equinox.png")
        try:
            train_common.plot_curves(
                sorted(glob.glob(os.path.join(args.out, "*.csv"))), png
            )
            print(f"{label}: plotted {png}")
        except ImportError as e:
            print(f"{label}: no plot ({e})")
    return records
