"""Train a small Llama-style decoder in Flax NNX with NVFP4 linear layers.

    python examples/text_data.py prepare --out .data/   # once (network)
    python examples/llama_flax.py                       # tiny model, CPU, ~1 min
    python examples/llama_flax.py --precision bf16      # the baseline
    python examples/llama_flax.py --precision nvfp4_no_rht --steps 2000 \\
        --d-model 768 --layers 12 --heads 12 --ffn 2048 --batch 32 --seq-len 512

Without the prepared corpus the run falls back, with a warning, to the few-KB
sample in tests/data.

The model: byte-level tokens (vocabulary 256), token embedding, pre-norm
decoder blocks (RMSNorm, causal self-attention with rotary position
embeddings, RMSNorm, SwiGLU MLP), a final RMSNorm and an output head (untied;
``--tie-embeddings`` reuses the embedding). Parameters are fp32 master
weights; every layer computes in bf16 (``nnx.Linear(dtype=bfloat16)`` casts
its fp32 kernel in the forward pass), norms, softmax and the loss in fp32.

Precision: ``--precision bf16`` leaves the model as built; the NVFP4 choices
convert it with ``jax_nvfp4.flax.convert`` and the default transformer policy
(``jax_nvfp4.policy.transformer_policy``): the MLP linears (gate, up, down) of
all but the last ``--keep-last`` blocks (a stack of their own, ``tail``) run
the NVFP4 recipe; attention projections, embedding and head stay in bf16.
Stochastic-rounding keys come from the model's own ``nvfp4`` RNG stream (seeded
from ``--seed``), whose counts are part of the training state, so a run is
reproducible and every step draws new bits. Training is AdamW with warmup and
cosine decay (``train_common.make_optimizer``); ``train_common.run_training``
runs the loop and writes ``<out>/flax_<precision>.csv`` (or ``--label``), and
this script draws the loss curves of every run in ``<out>`` (Flax and Equinox
alike) into ``<out>/loss_flax.png``.
"""

from __future__ import annotations

import argparse
import functools
import glob
import math
import os
import sys

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jax_nvfp4 import save_fp4_residuals
from jax_nvfp4.flax import Experts, convert, nvfp4_layers
from jax_nvfp4.policy import transformer_policy
from nvfp4_examples import moe_routing, train_common

VOCAB = 256
COMPUTE = jnp.bfloat16
PARAMS = jnp.float32


def _linear(d_in: int, d_out: int, *, std: float, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=False,
        dtype=COMPUTE,
        param_dtype=PARAMS,
        kernel_init=nnx.initializers.normal(std),
        rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, computed in fp32, returned in the compute dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.ones((dim,), PARAMS))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * rms * self.scale[...]).astype(COMPUTE)


def rope(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding of x [B, S, H, Dh] (rotate-half form)."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, None].astype(jnp.float32) * freq  # [S, half]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(
        self,
        d: int,
        heads: int,
        *,
        out_std: float,
        implementation: str | None,
        rngs: nnx.Rngs,
    ):
        if d % heads or (d // heads) % 2:
            raise ValueError(
                f"--d-model {d} must split into {heads} heads of even width"
            )
        self.heads = heads
        self.implementation = implementation
        self.q_proj = _linear(d, d, std=0.02, rngs=rngs)
        self.k_proj = _linear(d, d, std=0.02, rngs=rngs)
        self.v_proj = _linear(d, d, std=0.02, rngs=rngs)
        self.o_proj = _linear(d, d, std=out_std, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        split = lambda t: t.reshape(b, s, self.heads, d // self.heads)  # noqa: E731
        positions = jnp.arange(s)
        q = rope(split(self.q_proj(x)), positions)
        k = rope(split(self.k_proj(x)), positions)
        v = split(self.v_proj(x))
        out = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=self.implementation
        )
        return self.o_proj(out.reshape(b, s, d))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, d: int, ffn: int, *, out_std: float, rngs: nnx.Rngs):
        self.gate_proj = _linear(d, ffn, std=0.02, rngs=rngs)
        self.up_proj = _linear(d, ffn, std=0.02, rngs=rngs)
        self.down_proj = _linear(ffn, d, std=out_std, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nnx.Module):
    """SwiGLU experts: each token routed to its top_k of ``experts`` (the
    router in fp32), the expert projections ``Experts`` layers run by
    ``ragged_dot`` over the rows sorted by expert."""

    def __init__(self, d, ffn, experts, *, top_k, out_std, rngs: nnx.Rngs):
        self.top_k = top_k
        self.router = nnx.Linear(
            d,
            experts,
            use_bias=False,
            param_dtype=PARAMS,
            kernel_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )

        def experts_layer(d_in, d_out, std):
            return Experts(
                experts,
                d_in,
                d_out,
                dtype=COMPUTE,
                param_dtype=PARAMS,
                kernel_init=nnx.initializers.normal(std),
                rngs=rngs,
            )

        self.gate_proj = experts_layer(d, ffn, 0.02)
        self.up_proj = experts_layer(d, ffn, 0.02)
        self.down_proj = experts_layer(ffn, d, out_std)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        tokens = x.reshape(b * s, d)
        logits = self.router(tokens.astype(jnp.float32))
        rows, sizes, order, weights = moe_routing.route(tokens, logits, self.top_k)
        h = jax.nn.silu(self.gate_proj(rows, sizes)) * self.up_proj(rows, sizes)
        out = moe_routing.combine(self.down_proj(h, sizes), order, weights)
        return out.reshape(b, s, d)


class Block(nnx.Module):
    def __init__(self, d, heads, ffn, *, out_std, attention, experts=0, top_k=2, rngs):
        self.attn_norm = RMSNorm(d)
        self.attn = Attention(
            d, heads, out_std=out_std, implementation=attention, rngs=rngs
        )
        self.mlp_norm = RMSNorm(d)
        self.mlp = (
            MoE(d, ffn, experts, top_k=top_k, out_std=out_std, rngs=rngs)
            if experts
            else MLP(d, ffn, out_std=out_std, rngs=rngs)
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


# --remat: what jax.checkpoint keeps of each block for the backward pass.
REMAT_POLICIES = {
    "none": None,  # no remat: XLA keeps what the backward pass reads
    "fp4": save_fp4_residuals,  # only the FP4 residuals; the rest recomputed
    "dots": jax.checkpoint_policies.dots_saveable,  # every matmul output
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute everything
}


class Llama(nnx.Module):
    """Token ids [B, S] -> logits [B, S, 256] (fp32).

    The blocks are stacks: built by ``nnx.vmap`` (every parameter has a
    leading layer axis) and run by ``nnx.scan``, so compile time does not
    grow with depth; ``jax_nvfp4.flax.convert`` stacks its RNG state the same
    way. ``tail_layers`` > 0 makes the last blocks a second stack (``tail``,
    scanned after ``layers``), so that a policy can keep them in bf16 by path
    (``bf16_patterns=("tail.*",)``). In a single stack that needs a per-layer
    switch (a ``lax.cond``), which under ``grad`` keeps both branches'
    residuals: every block would save its bf16 inputs next to the FP4 copies.
    ``experts`` > 0 makes each block's MLP a mixture of SwiGLU experts
    (``MoE``: top_k routing, ``jax_nvfp4.flax.Experts`` projections).
    """

    def __init__(
        self,
        *,
        d_model: int,
        layers: int,
        heads: int,
        ffn: int,
        tie_embeddings: bool = False,
        attention: str | None = None,
        remat: str = "fp4",
        tail_layers: int = 0,
        experts: int = 0,
        top_k: int = 2,
        rngs: nnx.Rngs,
    ):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}")
        if not 0 <= tail_layers < layers:
            raise ValueError(
                f"tail_layers={tail_layers} must be >= 0 and below layers={layers}"
            )
        # GPT-2-style init: residual-output projections scaled by depth.
        out_std = 0.02 / math.sqrt(2 * layers)
        self.embed = nnx.Embed(
            VOCAB,
            d_model,
            dtype=COMPUTE,
            param_dtype=PARAMS,
            embedding_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )

        def stack(size: int) -> Block:
            @nnx.split_rngs(splits=size)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def blocks(rngs: nnx.Rngs) -> Block:
                return Block(
                    d_model,
                    heads,
                    ffn,
                    out_std=out_std,
                    attention=attention,
                    experts=experts,
                    top_k=top_k,
                    rngs=rngs,
                )

            return blocks(rngs)

        self.layers = stack(layers - tail_layers)
        self.tail = stack(tail_layers) if tail_layers else None
        self.remat = remat
        self.norm = RMSNorm(d_model)
        self.tie_embeddings = tie_embeddings
        self.lm_head = (
            None if tie_embeddings else _linear(d_model, VOCAB, std=0.02, rngs=rngs)
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        def block(block: Block, x: jax.Array) -> jax.Array:
            return block(x)

        if self.remat != "none":
            block = nnx.remat(block, policy=REMAT_POLICIES[self.remat])
        run_blocks = nnx.scan(block, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        x = run_blocks(self.layers, self.embed(tokens))
        if self.tail is not None:
            x = run_blocks(self.tail, x)
        x = self.norm(x)
        logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
        return logits.astype(jnp.float32)


def next_byte_loss(model: Llama, batch: jax.Array) -> jax.Array:
    """Mean cross-entropy (nats/byte) of predicting batch[:, 1:] from batch[:, :-1]."""
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def _tail(args: argparse.Namespace) -> int:
    """The blocks of the bf16 tail stack: --keep-last, unless every block
    stays in bf16 (then one stack)."""
    return args.keep_last if args.keep_last < args.layers else 0


def build(args: argparse.Namespace) -> tuple[Llama, str]:
    """The model at ``args.precision`` and a line describing its precision."""
    model = Llama(
        d_model=args.d_model,
        layers=args.layers,
        heads=args.heads,
        ffn=args.ffn,
        tie_embeddings=args.tie_embeddings,
        attention=args.attention,
        remat=args.remat,
        tail_layers=_tail(args),
        experts=args.experts,
        top_k=args.top_k,
        rngs=nnx.Rngs(params=args.seed),
    )
    recipe = train_common.PRECISIONS[args.precision]
    # An Experts stack is one layer here, as nvfp4_layers lists it.
    linears = sum(
        isinstance(n, (nnx.Linear, Experts)) for _, n in nnx.iter_graph(model)
    )
    if recipe is None:
        return model, f"all {linears} linear and expert layers (or stacks) in bf16"
    # The last --keep-last blocks are the model's tail stack, kept in bf16.
    policy = transformer_policy(
        args.layers,
        recipe=recipe,
        keep_last=args.keep_last - _tail(args),
        nvfp4_patterns=train_common.NVFP4_LAYERS[args.nvfp4_layers],
        bf16_patterns=("tail.*", "*router*"),
    )
    convert(model, policy, nnx.Rngs(nvfp4=args.seed + 1))
    converted = sorted(nvfp4_layers(model))
    if not converted:
        print(
            f"warning: no layer runs in NVFP4 (--layers {args.layers}, "
            f"--keep-last {args.keep_last})",
            file=sys.stderr,
        )
    kept = f", the last {args.keep_last} block(s) in bf16" if args.keep_last else ""
    return model, (
        f"{len(converted)} of {linears} linear and expert layers (or stacks) in NVFP4 "
        f"({args.precision}{kept}): {', '.join(converted) or '-'}"
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    train_common.add_common_flags(parser)
    parser.add_argument(
        "--label", default=None, help="run name (default: flax_<precision>)"
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
        "--tie-embeddings",
        action="store_true",
        help="use the embedding matrix as the output head",
    )
    parser.add_argument(
        "--plot",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="draw every CSV in --out into <out>/loss_flax.png (matplotlib)",
    )
    args = parser.parse_args(argv)
    label = args.label or f"flax_{args.precision}"

    model, description = build(args)
    tx, schedule = train_common.make_optimizer(args)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"{label}: {params / 1e6:.2f}M parameters; {description}", flush=True)

    # Functional training state for jax.jit: the model's and the optimizer's
    # state (parameters, Adam moments, and the NVFP4 layers' RNG counts).
    graphdef, state = nnx.split((model, optimizer))

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch, key):
        # Stochastic-rounding keys come from the model's nvfp4 RNG stream,
        # which advances with the state; run_training's per-step key is unused.
        del key
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(next_byte_loss)(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    @jax.jit
    def eval_loss(state, batch):
        model, _ = nnx.merge(graphdef, state)  # a copy: its RNG draws are dropped
        return next_byte_loss(model, batch)

    flops = train_common.llama_flops_per_token(
        d_model=args.d_model, layers=args.layers, ffn=args.ffn, seq_len=args.seq_len
    )
    records = train_common.run_training(
        label=label,
        args=args,
        train_step=train_step,
        state=state,
        flops_per_token=flops,
        eval_loss=eval_loss,
        schedule=schedule,
    )
    if args.plot:
        png = os.path.join(args.out, "loss_flax.png")
        try:
            train_common.plot_curves(
                sorted(glob.glob(os.path.join(args.out, "*.csv"))), png
            )
            print(f"{label}: loss curves of the runs in {args.out}: {png}")
        except ImportError as e:
            print(f"{label}: no plot ({e})", file=sys.stderr)
    return records
