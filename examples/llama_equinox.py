"""A Llama-style byte-level decoder in Equinox, trained in bf16 or NVFP4.

RMSNorm, SwiGLU MLP, causal attention with rotary position embeddings,
vocabulary of 256 bytes. Parameters are float32 master weights; each step casts
them to bfloat16 for the forward and backward pass (the gradient flows back
through the cast), and AdamW with linear warmup and cosine decay updates the
float32 copy. With ``--precision nvfp4*`` the model is converted by
``jax_nvfp4.equinox.convert`` under ``transformer_policy``: the MLP linears of
all but the last ``--keep-last`` blocks run the NVFP4 recipe; attention,
embeddings and the output head stay in bf16.

The model is written per example and per position, the Equinox way:
``jax.vmap`` over the batch of a model that ``jax.vmap``s its linears over
the positions; the NVFP4 layers fold both maps into one GEMM over all tokens.

    python examples/text_data.py prepare --out .data/      # once (network)
    python examples/llama_equinox.py --precision nvfp4     # CPU: about a minute

benchmarks/convergence.py has the GPU-sized flags.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_common  # noqa: E402

import jax_nvfp4.equinox as nveqx  # noqa: E402
from jax_nvfp4.policy import transformer_policy  # noqa: E402

VOCAB = 256


def _split(key: jax.Array | None, n: int) -> list[jax.Array | None]:
    return [None] * n if key is None else list(jax.random.split(key, n))


def _per_position(layer, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """Applies a per-vector layer to every position of x [S, d] (shared key)."""
    return jax.vmap(lambda v: layer(v, key=key))(x)


class RMSNorm(eqx.Module):
    weight: jax.Array
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-6):
        self.weight = jnp.ones((dim,), jnp.float32)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * scale * self.weight.astype(jnp.float32)).astype(x.dtype)


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


class Block(eqx.Module):
    attn_norm: RMSNorm
    attn: Attention
    mlp_norm: RMSNorm
    mlp: Mlp

    def __init__(self, d: int, heads: int, ffn: int, *, attention=None, key):
        ka, km = jax.random.split(key)
        self.attn_norm = RMSNorm(d)
        self.attn = Attention(d, heads, implementation=attention, key=ka)
        self.mlp_norm = RMSNorm(d)
        self.mlp = Mlp(d, ffn, key=km)

    def __call__(self, x, cos, sin, *, key=None):
        ka, km = _split(key, 2)
        x = x + self.attn(jax.vmap(self.attn_norm)(x), cos, sin, key=ka)
        return x + self.mlp(jax.vmap(self.mlp_norm)(x), key=km)


class Llama(eqx.Module):
    embed: eqx.nn.Embedding
    layers: list[Block]
    norm: RMSNorm
    lm_head: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, *, d_model, layers, heads, ffn, attention=None, key):
        ke, kh, *kl = jax.random.split(key, layers + 2)
        weight = 0.02 * jax.random.normal(ke, (VOCAB, d_model), jnp.float32)
        self.embed = eqx.nn.Embedding(weight=weight)
        self.layers = [
            Block(d_model, heads, ffn, attention=attention, key=k) for k in kl
        ]
        self.norm = RMSNorm(d_model)
        self.lm_head = eqx.nn.Linear(d_model, VOCAB, use_bias=False, key=kh)
        self.heads = heads

    def __call__(self, tokens: jax.Array, *, key=None) -> jax.Array:
        """tokens int32 [S] -> logits float32 [S, 256] (one example)."""
        x = jax.vmap(self.embed)(tokens)
        cos, sin = rope_tables(tokens.shape[0], x.shape[-1] // self.heads)
        for block, k in zip(self.layers, _split(key, len(self.layers)), strict=True):
            x = block(x, cos, sin, key=k)
        x = jax.vmap(self.norm)(x)
        return _per_position(self.lm_head, x, None).astype(jnp.float32)


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


def build(args: argparse.Namespace):
    """(model, optimizer, schedule, policy or None) for the flags."""
    model = Llama(
        d_model=args.d_model,
        layers=args.layers,
        heads=args.heads,
        ffn=args.ffn,
        attention=None if args.attention == "xla" else args.attention,
        key=jax.random.key(args.seed),
    )
    recipe = train_common.PRECISIONS[args.precision]
    policy = None
    if recipe is not None:
        policy = transformer_policy(
            args.layers, recipe=recipe, keep_last=args.keep_last
        )
        model = nveqx.convert(model, policy)
    optimizer, schedule = train_common.make_optimizer(args)
    return model, optimizer, schedule, policy


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    layers = nveqx.linear_paths(model)
    converted = [p for p, layer in layers.items() if isinstance(layer, nveqx.Linear)]
    print(
        f"{label}: {n_params / 1e6:.1f}M parameters; {len(converted)} of "
        f"{len(layers)} linear layers in NVFP4 ({args.precision})",
        flush=True,
    )

    opt_state = optimizer.init(params)

    @eqx.filter_jit(donate="all")
    def train_step(state, batch, key):
        model, opt_state = state

        def loss_of(model):
            return loss_fn(to_bf16(model), batch, key)

        loss, grads = eqx.filter_value_and_grad(loss_of)(model)
        updates, opt_state = optimizer.update(
            grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
        )
        model = eqx.apply_updates(model, updates)
        return (model, opt_state), loss

    @eqx.filter_jit
    def eval_loss(state, batch):
        model = eqx.nn.inference_mode(to_bf16(state[0]))
        return loss_fn(model, batch, None)

    flops = train_common.llama_flops_per_token(
        d_model=args.d_model, layers=args.layers, ffn=args.ffn, seq_len=args.seq_len
    )
    records = train_common.run_training(
        label=label,
        args=args,
        train_step=train_step,
        state=(model, opt_state),
        flops_per_token=flops,
        eval_loss=eval_loss,
        schedule=schedule,
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


if __name__ == "__main__":
    main()
