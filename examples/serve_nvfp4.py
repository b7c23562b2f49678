"""Train, export, reload and serve the example Llama in NVFP4 weights.

    python examples/serve_nvfp4.py                       # 200 steps, then generate
    python examples/serve_nvfp4.py --steps 50 --prompt "WATER, n."

1. Trains nvfp4_examples/llama_equinox.py's model with the NVFP4 recipe (the MLP
   projections of all blocks but the last in NVFP4, the rest bf16).
2. Names its weights as Hugging Face's Llama does (``model.layers.0.mlp.
   up_proj.weight``, ``[out, in]``) and records the activation amax of each
   NVFP4 projection over a few held-out batches (``checkpoint.calibrate``).
3. Exports a ModelOpt NVFP4 checkpoint (``checkpoint.export_nvfp4``: what
   vLLM, SGLang and TensorRT-LLM load), imports it back
   (``checkpoint.import_nvfp4``) and checks that its FP4 bytes are those the
   training forward pass used (``quantize`` of the bf16 weight in 16x16
   tiles). It keeps each layer's own scales (``fuse=()``) for that check; a
   checkpoint for an engine that runs gate_proj and up_proj as one GEMM
   (vLLM, SGLang, TensorRT-LLM) leaves ``fuse`` at its default, which gives
   the two one shared scale (``jax_nvfp4.checkpoint``'s docstring).
4. Serves from the imported tensors: each NVFP4 projection is
   ``jax_nvfp4.matmul(x, w)`` with bfloat16 activations (W4A16; on GPUs the
   weight is decoded inside the GEMM), the other layers bf16. It prints how
   far the serving logits are from (a) the same forward with the weights
   dequantized and multiplied by XLA (the same products; float32 summation
   order and where alpha is applied differ) and (b) the training-time
   forward, which quantizes the activations too (W4A4), then generates text
   greedily from --prompt with a KV cache, the whole loop one jitted
   program, and prints its tokens/s against the same model with every
   weight in bfloat16 (the NVFP4 weights dequantized).

With ``--experts 8 --top-k 2`` the blocks are mixtures of experts: each
expert is exported as a layer of its own (Mixtral's names,
``block_sparse_moe.experts.3.w1``), and serving stacks each block's experts
of one projection and runs ``jax_nvfp4.ragged_dot(rows, experts,
group_sizes)`` on the rows sorted by expert (the grouped W4A16 GEMM).

For a model whose weights dominate the time (on a GPU), e.g.:

    python examples/serve_nvfp4.py --steps 2 --layers 4 --d-model 4096 \
        --heads 32 --ffn 14336 --seq-len 64 --batch 2 --new-tokens 128
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import tempfile
import time
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from nvfp4_examples import llama_equinox, moe_routing, train_common

import jax_nvfp4 as nv
import jax_nvfp4.equinox as nveqx
from jax_nvfp4 import checkpoint, hf_names
from jax_nvfp4.format import NVFP4Tensor

# The example's linear layers -> Hugging Face Llama's module names, per block
# (the weights' names come from jax_nvfp4.hf_names).
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj",
    "attn.o_proj": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj",
}


# A mixture-of-experts block's module (Mixtral's naming, jax_nvfp4.hf_names):
# its router ``gate`` and experts ``experts.{e}.w1`` (gate), ``w3`` (up),
# ``w2`` (down).
MOE = "block_sparse_moe"
EXPERT_PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class Arch(NamedTuple):
    """What the tensors do not say: attention heads, experts per token."""

    heads: int
    top_k: int = 2


def _get(tree, path: str):
    for part in path.split("."):
        tree = getattr(tree, part)
    return tree


def hf_weights(model: llama_equinox.Llama) -> tuple[dict, set[str]]:
    """({Hugging Face tensor name: bf16 array}, the module names trained in
    NVFP4) of a (converted) example model; weights are [out, in] as in
    Equinox. The bf16 values are what the training forward pass multiplies
    (``llama_equinox.to_bf16``)."""
    model = llama_equinox.to_bf16(model)
    weights = hf_names.llama_weights(model, stacks=("layers", "tail"))
    nvfp4 = set()
    first = 0
    for stack in (model.layers, model.tail):
        if stack is None:
            continue
        count = llama_equinox._stack_size(stack)
        for ours, theirs in BLOCK_NAMES.items():
            layer = _get(stack, ours)
            for i in range(count):
                if isinstance(layer, nveqx.Linear) and (
                    layer.nvfp4 is None or bool(layer.nvfp4[i])
                ):
                    nvfp4.add(f"model.layers.{first + i}.{theirs}")
        if isinstance(stack.mlp, llama_equinox.MoE):
            for ours, theirs in EXPERT_PROJECTIONS.items():
                layer = getattr(stack.mlp, ours)
                if layer.recipe is not None:
                    nvfp4.update(
                        f"model.layers.{first + i}.{MOE}.experts.{e}.{theirs}"
                        for i in range(count)
                        for e in range(layer.num_experts)
                    )
        first += count
    return weights, nvfp4


def stack_experts(weights: dict) -> dict:
    """The tensors with each block's experts of one projection stacked into
    one: ``...experts.{e}.w1.weight`` [out, in] -> ``...experts.w1.weight``
    [E, out, in] (NVFP4Tensors leaf by leaf, each expert keeping its amax),
    what ``ragged_dot`` takes."""
    pattern = re.compile(r"(.*\.experts)\.(\d+)\.(w\d)\.weight")
    stacks: dict[str, dict[int, object]] = {}
    out = {}
    for name, value in weights.items():
        match = pattern.fullmatch(name)
        if match is None:
            out[name] = value
            continue
        prefix, expert, projection = match.groups()
        stacks.setdefault(f"{prefix}.{projection}.weight", {})[int(expert)] = value
    for name, experts in stacks.items():
        members = [experts[e] for e in range(len(experts))]
        out[name] = jax.tree.map(lambda *a: jnp.stack(a), *members)
    return out


def linear(weights: dict, name: str, x, record=None, dense=False):
    """x times the layer's ``.weight`` [out, in]: ``jax_nvfp4.matmul(x, w)``
    (W4A16) for an NVFP4Tensor, or with ``dense`` the product by its
    dequantized values through XLA; a bf16 GEMM for the others.
    ``record(name, x)`` (``checkpoint.calibrate``) sees the input."""
    if record is not None:
        x = record(name, x)
    w = weights[name + ".weight"]
    if isinstance(w, NVFP4Tensor):
        if not dense:
            return nv.matmul(x, w)
        w = nv.dequantize(w, jnp.float32)  # [N, K]
        return jnp.dot(x.astype(jnp.float32), w.T, precision="highest").astype(
            jnp.bfloat16
        )
    return jnp.dot(x, w.T.astype(x.dtype))


def expert_linear(weights: dict, name: str, rows, sizes, record=None, dense=False):
    """rows [R, in] sorted by expert (``sizes`` [E]) times the stacked experts
    ``name``.weight [E, out, in]: ``jax_nvfp4.ragged_dot`` (W4A16, the experts
    decoded inside the GEMM) for NVFP4 experts, or with ``dense`` the
    product by their dequantized values through XLA; a bf16 ragged_dot for
    the others. ``record`` sees every expert's input as all the rows (an
    expert may get no row of a calibration batch; the block's amax bounds
    each expert's)."""
    w = weights[name + ".weight"]
    if record is not None:
        prefix, projection = name.rsplit(".", 1)
        for e in range(sizes.shape[0]):
            rows = record(f"{prefix}.{e}.{projection}", rows)
    if isinstance(w, NVFP4Tensor):
        if not dense:
            return nv.ragged_dot(rows, w, sizes)
        w = jax.vmap(lambda e: nv.dequantize(e, jnp.float32))(w)  # [E, out, in]
        return jax.lax.ragged_dot(
            rows.astype(jnp.float32), jnp.swapaxes(w, 1, 2), sizes, precision="highest"
        ).astype(jnp.bfloat16)
    return jax.lax.ragged_dot(rows, jnp.swapaxes(w, 1, 2).astype(rows.dtype), sizes)


def mixture(weights: dict, prefix: str, h, top_k: int, experts):
    """A mixture-of-experts block on h bf16 [S, d]: each row routed to its
    top_k experts by the float32 router (as the example's training does),
    ``experts(name, rows, sizes)`` one expert projection over the rows sorted
    by expert, the outputs combined with the router's weights."""
    router = weights[prefix + ".gate.weight"]  # [E, d]
    logits = jnp.dot(h.astype(jnp.float32), router.astype(jnp.float32).T)
    rows, sizes, order, probabilities = moe_routing.route(h, logits, top_k)
    gate = experts(prefix + ".experts.w1", rows, sizes)
    up = experts(prefix + ".experts.w3", rows, sizes)
    down = experts(prefix + ".experts.w2", jax.nn.silu(gate) * up, sizes)
    return moe_routing.combine(down, order, probabilities)


def _layer_count(weights: dict) -> int:
    return 1 + max(
        int(name.split(".")[2]) for name in weights if name.startswith("model.layers.")
    )


def _decoder(weights: dict, x, arch: Arch, cos, sin, attend, project, experts):
    """The decoder stack on embeddings x bf16 [S, d] at the positions of the
    rotary tables cos, sin [S, head_dim / 2]: ``attend(i, q, k, v)`` is
    layer i's attention ([S, heads, head_dim], q and k rotated),
    ``project(name, x)`` a projection, ``experts(name, rows, sizes)`` an
    expert projection (``mixture``). Logits float32 [S, 256]."""
    s, d = x.shape
    heads = arch.heads
    for i in range(_layer_count(weights)):
        p = f"model.layers.{i}."
        h = llama_equinox.rms_norm(x, weights[p + "input_layernorm.weight"])
        q, k, v = (
            project(p + f"self_attn.{n}_proj", h).reshape(s, heads, d // heads)
            for n in "qkv"
        )
        q = llama_equinox.apply_rope(q, cos, sin)
        k = llama_equinox.apply_rope(k, cos, sin)
        attn = attend(i, q, k, v).reshape(s, d)
        x = x + project(p + "self_attn.o_proj", attn)
        h = llama_equinox.rms_norm(x, weights[p + "post_attention_layernorm.weight"])
        if p + MOE + ".gate.weight" in weights:
            x = x + mixture(weights, p + MOE, h, arch.top_k, experts)
            continue
        gate = project(p + "mlp.gate_proj", h)
        up = project(p + "mlp.up_proj", h)
        x = x + project(p + "mlp.down_proj", jax.nn.silu(gate) * up)
    x = llama_equinox.rms_norm(x, weights["model.norm.weight"])
    return project("lm_head", x).astype(jnp.float32)


def forward(weights: dict, tokens: jax.Array, arch: Arch, record=None, dense=False):
    """Logits float32 [S, 256] of one example from Hugging Face-named tensors
    (``linear`` for each projection, ``expert_linear`` for the experts')."""
    x = weights["model.embed_tokens.weight"].astype(jnp.bfloat16)[tokens]
    cos, sin = llama_equinox.rope_tables(x.shape[0], x.shape[1] // arch.heads)
    return _decoder(
        weights,
        x,
        arch,
        cos,
        sin,
        attend=lambda i, q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
        project=lambda name, x: linear(weights, name, x, record, dense),
        experts=lambda name, rows, sizes: expert_linear(
            weights, name, rows, sizes, record, dense
        ),
    )


def empty_cache(weights: dict, arch: Arch, length: int):
    """Keys and values bf16 [layers, length, heads, head_dim], zeros."""
    d = weights["model.embed_tokens.weight"].shape[1]
    shape = (_layer_count(weights), length, arch.heads, d // arch.heads)
    return jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)


def decode(weights: dict, arch: Arch, cache, token, position):
    """One token at ``position`` through the model with a KV cache (what
    ``forward`` computes for that position, one row per GEMM): logits
    float32 [256] and the cache holding this token's keys and values."""
    keys, values = cache
    length, head_dim = keys.shape[1], keys.shape[3]
    cos, sin = llama_equinox.rope_tables(length, head_dim)
    visible = jnp.arange(length) <= position

    def attend(i, q, k, v):
        nonlocal keys, values
        keys = keys.at[i, position].set(k[0])
        values = values.at[i, position].set(v[0])
        scores = jnp.einsum(
            "hd,thd->ht", q[0].astype(jnp.float32), keys[i].astype(jnp.float32)
        ) / math.sqrt(head_dim)
        probabilities = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("ht,thd->hd", probabilities, values[i].astype(jnp.float32))
        return attn.astype(q.dtype)[None]

    x = weights["model.embed_tokens.weight"].astype(jnp.bfloat16)[token][None]
    logits = _decoder(
        weights,
        x,
        arch,
        jax.lax.dynamic_slice_in_dim(cos, position, 1),
        jax.lax.dynamic_slice_in_dim(sin, position, 1),
        attend,
        project=lambda name, x: linear(weights, name, x),
        experts=lambda name, rows, sizes: expert_linear(weights, name, rows, sizes),
    )
    return logits[0], (keys, values)


def decode_logits(weights: dict, tokens: jax.Array, arch: Arch) -> jax.Array:
    """Logits float32 [S, 256] of ``tokens`` fed one at a time through
    ``decode`` (to check the cache against ``forward``)."""

    def step(cache, position):
        logits, cache = decode(weights, arch, cache, tokens[position], position)
        return cache, logits

    cache = empty_cache(weights, arch, tokens.shape[0])
    return jax.lax.scan(step, cache, jnp.arange(tokens.shape[0]))[1]


def _greedy(weights, tokens, *, arch: Arch, prompt: int):
    """tokens int32 [L] with the prompt in front: every later position the
    argmax after the one before it, one ``decode`` step per position."""

    def step(position, state):
        tokens, cache = state
        logits, cache = decode(weights, arch, cache, tokens[position], position)
        following = jnp.where(
            position + 1 < prompt, tokens[position + 1], jnp.argmax(logits)
        )
        return tokens.at[position + 1].set(following.astype(tokens.dtype)), cache

    cache = empty_cache(weights, arch, tokens.shape[0])
    return jax.lax.fori_loop(0, tokens.shape[0] - 1, step, (tokens, cache))[0]


def generate(weights: dict, prompt: bytes, new_tokens: int, arch: Arch):
    """Greedy decoding with a KV cache, the loop one jitted program: the text
    and the decode steps per second (one token through the model each, the
    prompt's included), timed on a second run."""
    run = jax.jit(functools.partial(_greedy, arch=arch, prompt=len(prompt)))
    tokens = jnp.asarray(list(prompt) + [0] * new_tokens, jnp.int32)
    out = jax.block_until_ready(run(weights, tokens))
    start = time.perf_counter()
    jax.block_until_ready(run(weights, tokens))
    seconds = time.perf_counter() - start
    return bytes(np.asarray(out).tolist()), (tokens.shape[0] - 1) / seconds


def train(args) -> llama_equinox.Llama:
    """The example's NVFP4 training run; returns the trained model."""
    model, optimizer, _, _ = llama_equinox.build(args)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    final = []
    train_common.run_training(
        label="serve_nvfp4",
        args=args,
        train_step=llama_equinox.make_train_step(optimizer),
        state=(model, opt_state),
        flops_per_token=train_common.llama_flops_per_token(
            d_model=args.d_model, layers=args.layers, ffn=args.ffn, seq_len=args.seq_len
        ),
        on_done=final.append,
    )
    return final[0][0]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    train_common.add_common_flags(parser)
    parser.set_defaults(precision="nvfp4", steps=200, keep_last=1)
    parser.add_argument("--prompt", default="WATER, n.", help="text to continue")
    parser.add_argument("--new-tokens", type=int, default=64, help="bytes to generate")
    parser.add_argument(
        "--export-dir", default=None, help="checkpoint folder (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    args.attention, args.remat = None, "fp4"

    arch = Arch(args.heads, args.top_k)
    model = train(args)
    weights, nvfp4 = hf_weights(model)
    _, held_out = train_common.load_splits(args)
    windows = train_common.eval_batches(held_out, 1, args.seq_len, 4)

    stacked = stack_experts(weights)

    def record_inputs(batch, record):
        params, window = batch
        return forward(params, jnp.asarray(window[0, :-1]), arch, record)

    # The weights travel in each batch: closed over, they would become
    # constants of the compiled forward (slow to compile for a large model).
    input_amax = checkpoint.calibrate(record_inputs, [(stacked, w) for w in windows])
    directory = args.export_dir or tempfile.mkdtemp(prefix="serve_nvfp4_")
    checkpoint.export_nvfp4(
        weights, directory, nvfp4=nvfp4, input_amax=input_amax, fuse=()
    )
    loaded = checkpoint.import_nvfp4(directory)
    served = {
        **loaded.tensors,
        **{m + ".weight": w for m, w in loaded.quantized.items()},
    }
    served = stack_experts(
        {
            k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
            for k, v in served.items()
        }
    )

    # The FP4 bytes are training's: FPROP quantizes the bf16 weight [in, out]
    # along `in` in 16x16 tiles.
    same_bytes = all(
        np.array_equal(
            np.asarray(loaded.quantized[m].codes),
            np.asarray(
                nv.quantize(weights[m + ".weight"].T, axis=0, block="16x16").codes
            ),
        )
        for m in sorted(nvfp4)
    )
    tokens = jnp.asarray(
        train_common.eval_batches(held_out, 1, args.seq_len, 1)[0][0, :-1]
    )
    logits = jax.jit(lambda w, t: forward(w, t, arch))(served, tokens)
    dense = jax.jit(lambda w, t: forward(w, t, arch, dense=True))(served, tokens)
    trained = llama_equinox.to_bf16(eqx.nn.inference_mode(model))(tokens)
    scale = float(jnp.abs(dense).max())
    result = {
        "checkpoint": directory,
        "nvfp4_layers": len(nvfp4),
        "same_fp4_bytes": same_bytes,
        "max_diff_vs_dequantized": float(jnp.abs(logits - dense).max()) / scale,
        "max_diff_vs_training_forward": float(jnp.abs(logits - trained).max()) / scale,
        "top1_agreement_vs_training_forward": float(
            jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(trained, -1))
        ),
    }
    cached = jax.jit(lambda w, t: decode_logits(w, t, arch))(served, tokens)
    result["max_diff_cached_vs_forward"] = float(jnp.abs(cached - logits).max()) / scale
    text, speed = generate(served, args.prompt.encode(), args.new_tokens, arch)
    bf16_weights = {
        k: nv.dequantize(v, jnp.bfloat16) if isinstance(v, NVFP4Tensor) else v
        for k, v in served.items()
    }
    _, bf16_speed = generate(bf16_weights, args.prompt.encode(), args.new_tokens, arch)
    result["generated"] = text.decode("utf-8", errors="replace")
    result["tokens_per_s"] = speed
    result["tokens_per_s_bf16"] = bf16_speed
    print(f"checkpoint: {directory} ({len(nvfp4)} NVFP4 layers, the rest bf16)")
    print(f"FP4 weight bytes equal training's FPROP bytes: {same_bytes}")
    print(
        "serving logits vs the dequantized weights through XLA: max |diff| "
        f"{result['max_diff_vs_dequantized']:.2e} of the largest logit"
    )
    print(
        "serving logits (W4A16) vs the training forward (W4A4): max |diff| "
        f"{result['max_diff_vs_training_forward']:.2e} of the largest logit, "
        f"top-1 agreement {result['top1_agreement_vs_training_forward']:.1%}"
    )
    print(
        "KV-cache decoding vs the whole-window forward: max |diff| "
        f"{result['max_diff_cached_vs_forward']:.2e} of the largest logit"
    )
    print(f"greedy: {result['generated']!r}")
    print(
        f"generation ({jax.default_backend()}): {speed:.1f} tokens/s with the NVFP4 "
        f"weights (W4A16), {bf16_speed:.1f} with them in bf16 "
        f"({speed / bf16_speed:.2f}x)"
    )
    return result


if __name__ == "__main__":
    main()
