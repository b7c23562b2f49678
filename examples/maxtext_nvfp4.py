"""Train a MaxText-shaped decoder with NVFP4 through qwix, beside its bf16 run.

    python examples/maxtext_nvfp4.py                # NNX and linen, 8 steps
    python examples/maxtext_nvfp4.py --api nnx --steps 20

The decoder has MaxText's layer names and weight shapes: ``token_embedder``,
``decoder/layers_{i}`` with ``pre_self_attention_layer_norm``,
``self_attention`` (``query``/``key``/``value`` DenseGeneral kernels [E, N, H],
``out`` [N, H, E]), ``post_self_attention_layer_norm`` and ``mlp`` (``wi_0``,
``wi_1`` [E, F], ``wo`` [F, E]), then ``decoder_norm`` and ``logits_dense``.
Its DenseGeneral calls ``jax.lax.dot_general`` as MaxText's does, and
attention scores are activation x activation einsums. The NNX version is
quantized as MaxText quantizes its model — ``qwix.quantize_model(model,
provider, tokens, positions, segment_ids, enable_dropout=False)`` — by the
same rule path, ``decoder/.*layers.*``: every projection of the decoder layers
runs the NVFP4 recipe, the embedding and ``logits_dense`` stay bf16. The
linen twin is quantized with ``qwix.quantize_model(model, provider)`` and
takes its keys from ``apply(..., rngs={"nvfp4": step_key})``.

MaxText. benchmarks/maxtext_check.py trains MaxText 0.2.5's own decoder
(dense and MoE) this way, beside bf16, and lists the wheels its model code
needs (MaxText requires Python >= 3.12). Its quantized-training hook is
qwix: with
``use_qwix_quantization: true`` and a non-empty ``quantization``,
``maxtext.utils.model_creation_utils.create_model`` calls
``maxtext.layers.quantizations.maybe_quantize_model(model, config)``, which
builds the provider with ``quantizations.get_qt_provider(config)`` (a
``match`` on ``config.quantization``), runs ``qwix.quantize_model(model,
provider, dummy_tokens, dummy_positions, dummy_segment_ids,
enable_dropout=False)`` on the NNX ``Transformer``, and then deletes every
module's ``qwix_rngs``. With qwix on, ``configure_quantization`` gives the
layers no AQT ``quant``, so ``DenseGeneral`` calls ``jax.lax.dot_general``,
which the provider intercepts. The lines a MaxText user changes:

1. Config (``base.yml`` keys, or ``key=value`` on the command line):
   ``use_qwix_quantization=true quantization=fp4``. ``fp4`` is a value that
   the config's ``QuantizationType`` accepts and that only
   ``get_qt_provider``/``get_quantization_rule`` read; the patch below
   replaces what it selects.
2. A launcher in place of ``python -m maxtext.trainers.pre_train.train``
   that patches the two functions before training::

       import jax_nvfp4
       import qwix
       from absl import app
       from flax import nnx
       from maxtext.layers import quantizations
       from maxtext.trainers.pre_train import train
       from jax_nvfp4.qwix import NvFp4Provider, NvFp4Rule, set_rngs

       def get_qt_provider(config):
           return NvFp4Provider([
               qwix.QtRule(module_path=r".*/gate$"),          # MoE router: bf16
               NvFp4Rule(module_path=r"decoder/.*MoeBlock_\\d+",  # experts
                         recipe=jax_nvfp4.NVFP4_NO_SR),
               NvFp4Rule(module_path=r"decoder/.*layers.*"),  # MaxText's path
           ])

       maybe_quantize_model = quantizations.maybe_quantize_model

       def maybe_quantize_model_nvfp4(model, config):
           model = maybe_quantize_model(model, config)  # deletes qwix_rngs
           seed = config.init_weights_seed
           return set_rngs(model, nnx.Rngs(nvfp4=seed))

       quantizations.get_qt_provider = get_qt_provider
       quantizations.maybe_quantize_model = maybe_quantize_model_nvfp4
       app.run(train.main)

   (``create_model`` looks both up in ``quantizations`` when it runs, and
   ``train.main`` is what ``python -m maxtext.trainers.pre_train.train``
   runs.) Without ``set_rngs`` the forward pass runs and the backward pass
   asks for a key; ``NvFp4Provider(rules, recipe=jax_nvfp4.NVFP4_NO_SR)``
   needs none. MaxText scans its layers by default (``scan_layers: true``);
   inside that scan the layers draw from a copy of the stream whose counter
   does not come back out, so every step and layer would round with the
   same keys: set ``scan_layers=false``. MoE: with ``sparse_matmul=true
   megablox=false`` the experts run ``jax.lax.ragged_dot``, which the
   provider intercepts, but inside MaxText's ``shard_map``, where the stream
   cannot advance (hence ``NVFP4_NO_SR`` for the experts) and qwix finds
   ``wo`` among the module's params but cannot tell ``wi_0`` from ``wi_1``
   (the same shape), which stay bf16. NVFP4 needs every matched weight's K
   and N to be multiples of 16.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import optax
import qwix
from flax import linen as nn
from flax import nnx

from jax_nvfp4.qwix import NvFp4Provider, NvFp4Rule, set_rngs

DTYPE = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 256
    emb_dim: int = 64
    num_heads: int = 4
    head_dim: int = 16
    mlp_dim: int = 128
    num_layers: int = 2
    batch: int = 4
    seq_len: int = 32


def rules():
    """MaxText's quantized-layer path; a MoE router ("gate") would stay bf16."""
    return [
        qwix.QtRule(module_path=r".*/gate$"),
        NvFp4Rule(module_path=r"decoder/.*layers.*"),
    ]


def batch(cfg: Config, step: int):
    """Token runs (t, t+1, t+2, ...) from random starts: learnable in a few
    steps. Returns (tokens, positions, segment_ids, targets)."""
    start = jax.random.randint(jax.random.key(step), (cfg.batch, 1), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(
        jnp.arange(cfg.seq_len + 1), (cfg.batch, cfg.seq_len + 1)
    )
    seq = (start + positions) % cfg.vocab_size
    tokens, targets = seq[:, :-1], seq[:, 1:]
    positions = positions[:, :-1]
    return tokens, positions, jnp.ones_like(tokens), targets


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    return (x32 * scale).astype(DTYPE)


def attention(q, k, v):
    """MaxText's dot-product attention: activation x activation einsums."""
    scores = jnp.einsum("BTNH,BSNH->BNTS", q, k) * q.shape[-1] ** -0.5
    length = q.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    scores = jnp.where(causal, scores.astype(jnp.float32), -1e9)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("BNTS,BSNH->BTNH", probs, v)


def dense_general(x, kernel, n_in: int):
    """MaxText DenseGeneral's product: the last ``n_in`` axes of x against
    the kernel's first ``n_in``, cast to the compute dtype first."""
    kernel = jnp.asarray(kernel, DTYPE)
    axis = tuple(range(x.ndim - n_in, x.ndim))
    return jax.lax.dot_general(x, kernel, ((axis, tuple(range(n_in))), ((), ())))


init = nn.initializers.normal(0.05)


# ---------------------------------------------------------------------- NNX


class DenseGeneral(nnx.Module):
    def __init__(self, in_shape, out_shape, *, rngs):
        self.n_in = len(in_shape)
        self.kernel = nnx.Param(init(rngs.params(), (*in_shape, *out_shape)))

    def __call__(self, x):
        return dense_general(x, self.kernel[...], self.n_in)


class RMSNorm(nnx.Module):
    def __init__(self, dim):
        self.scale = nnx.Param(jnp.ones((dim,)))

    def __call__(self, x):
        return rms_norm(x, self.scale[...])


class Attention(nnx.Module):
    def __init__(self, cfg: Config, *, rngs):
        e, n, h = cfg.emb_dim, cfg.num_heads, cfg.head_dim
        self.query = DenseGeneral((e,), (n, h), rngs=rngs)
        self.key = DenseGeneral((e,), (n, h), rngs=rngs)
        self.value = DenseGeneral((e,), (n, h), rngs=rngs)
        self.out = DenseGeneral((n, h), (e,), rngs=rngs)

    def __call__(self, x):
        return self.out(attention(self.query(x), self.key(x), self.value(x)))


class MlpBlock(nnx.Module):
    def __init__(self, cfg: Config, *, rngs):
        self.wi_0 = DenseGeneral((cfg.emb_dim,), (cfg.mlp_dim,), rngs=rngs)
        self.wi_1 = DenseGeneral((cfg.emb_dim,), (cfg.mlp_dim,), rngs=rngs)
        self.wo = DenseGeneral((cfg.mlp_dim,), (cfg.emb_dim,), rngs=rngs)

    def __call__(self, x):
        return self.wo(jax.nn.silu(self.wi_0(x)) * self.wi_1(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Config, *, rngs):
        self.pre_self_attention_layer_norm = RMSNorm(cfg.emb_dim)
        self.self_attention = Attention(cfg, rngs=rngs)
        self.post_self_attention_layer_norm = RMSNorm(cfg.emb_dim)
        self.mlp = MlpBlock(cfg, rngs=rngs)

    def __call__(self, x):
        x = x + self.self_attention(self.pre_self_attention_layer_norm(x))
        return x + self.mlp(self.post_self_attention_layer_norm(x))


class Decoder(nnx.Module):
    def __init__(self, cfg: Config, *, rngs):
        self.num_layers = cfg.num_layers
        for i in range(cfg.num_layers):
            setattr(self, f"layers_{i}", DecoderLayer(cfg, rngs=rngs))
        self.decoder_norm = RMSNorm(cfg.emb_dim)
        self.logits_dense = DenseGeneral((cfg.emb_dim,), (cfg.vocab_size,), rngs=rngs)

    def __call__(self, x):
        for i in range(self.num_layers):
            x = getattr(self, f"layers_{i}")(x)
        return self.logits_dense(self.decoder_norm(x)).astype(jnp.float32)


class Transformer(nnx.Module):
    """``__call__`` takes MaxText Transformer's leading arguments."""

    def __init__(self, cfg: Config, *, rngs):
        self.token_embedder = nnx.Param(
            init(rngs.params(), (cfg.vocab_size, cfg.emb_dim))
        )
        self.decoder = Decoder(cfg, rngs=rngs)

    def __call__(
        self,
        decoder_input_tokens,
        decoder_positions,
        decoder_segment_ids=None,
        enable_dropout=True,
    ):
        x = jnp.asarray(self.token_embedder[...], DTYPE)[decoder_input_tokens]
        return self.decoder(x)


def xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train_nnx(cfg: Config, steps: int, lr: float) -> dict[str, list[float]]:
    model = Transformer(cfg, rngs=nnx.Rngs(params=0))
    tokens, positions, segments, _ = batch(cfg, 0)
    # As MaxText's maybe_quantize_model does (quantize_model copies the model).
    quantized = qwix.quantize_model(
        model, NvFp4Provider(rules()), tokens, positions, segments, enable_dropout=False
    )
    set_rngs(quantized, nnx.Rngs(nvfp4=0))

    @nnx.jit
    def step(model, optimizer, tokens, positions, segments, targets):
        def loss_fn(model):
            return xent(
                model(tokens, positions, segments, enable_dropout=False), targets
            )

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = {}
    for name, m in (("bf16", model), ("nvfp4", quantized)):
        optimizer = nnx.Optimizer(m, optax.adam(lr), wrt=nnx.Param)
        losses[name] = [float(step(m, optimizer, *batch(cfg, s))) for s in range(steps)]
    return losses


# -------------------------------------------------------------------- linen


class LinenDenseGeneral(nn.Module):
    in_shape: tuple
    out_shape: tuple

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", init, (*self.in_shape, *self.out_shape))
        return dense_general(x, kernel, len(self.in_shape))


class LinenRMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return rms_norm(x, self.param("scale", nn.initializers.ones, (x.shape[-1],)))


class LinenAttention(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        e, n, h = self.cfg.emb_dim, self.cfg.num_heads, self.cfg.head_dim
        q = LinenDenseGeneral((e,), (n, h), name="query")(x)
        k = LinenDenseGeneral((e,), (n, h), name="key")(x)
        v = LinenDenseGeneral((e,), (n, h), name="value")(x)
        return LinenDenseGeneral((n, h), (e,), name="out")(attention(q, k, v))


class LinenMlpBlock(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        e, f = self.cfg.emb_dim, self.cfg.mlp_dim
        gate = LinenDenseGeneral((e,), (f,), name="wi_0")(x)
        up = LinenDenseGeneral((e,), (f,), name="wi_1")(x)
        return LinenDenseGeneral((f,), (e,), name="wo")(jax.nn.silu(gate) * up)


class LinenDecoderLayer(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        y = LinenRMSNorm(name="pre_self_attention_layer_norm")(x)
        x = x + LinenAttention(self.cfg, name="self_attention")(y)
        y = LinenRMSNorm(name="post_self_attention_layer_norm")(x)
        return x + LinenMlpBlock(self.cfg, name="mlp")(y)


class LinenDecoder(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        for i in range(self.cfg.num_layers):
            x = LinenDecoderLayer(self.cfg, name=f"layers_{i}")(x)
        x = LinenRMSNorm(name="decoder_norm")(x)
        logits = LinenDenseGeneral(
            (self.cfg.emb_dim,), (self.cfg.vocab_size,), name="logits_dense"
        )(x)
        return logits.astype(jnp.float32)


class LinenTransformer(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(
        self, decoder_input_tokens, decoder_positions, decoder_segment_ids=None
    ):
        shape = (self.cfg.vocab_size, self.cfg.emb_dim)
        embedding = self.param("token_embedder", init, shape)
        x = jnp.asarray(embedding, DTYPE)[decoder_input_tokens]
        return LinenDecoder(self.cfg, name="decoder")(x)


def train_linen(cfg: Config, steps: int, lr: float) -> dict[str, list[float]]:
    model = LinenTransformer(cfg)
    tokens, positions, segments, _ = batch(cfg, 0)
    params = model.init(jax.random.key(0), tokens, positions, segments)
    quantized = qwix.quantize_model(model, NvFp4Provider(rules()))
    tx = optax.adam(lr)

    def make_step(m):
        @jax.jit
        def step(params, opt_state, key, tokens, positions, segments, targets):
            def loss_fn(params):
                logits = m.apply(
                    params, tokens, positions, segments, rngs={"nvfp4": key}
                )
                return xent(logits, targets)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step

    losses = {}
    for name, m in (("bf16", model), ("nvfp4", quantized)):
        step, p, opt_state, out = make_step(m), params, tx.init(params), []
        for s in range(steps):
            key = jax.random.fold_in(jax.random.key(1), s)  # a new key each step
            p, opt_state, loss = step(p, opt_state, key, *batch(cfg, s))
            out.append(float(loss))
        losses[name] = out
    return losses


def main(argv=None) -> dict[str, dict[str, list[float]]]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--api", choices=("nnx", "linen", "both"), default="both")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    cfg = Config(num_layers=args.layers)
    apis = ("nnx", "linen") if args.api == "both" else (args.api,)
    results = {}
    for api in apis:
        start = time.perf_counter()
        train = train_nnx if api == "nnx" else train_linen
        results[api] = losses = train(cfg, args.steps, args.lr)
        print(f"{api}: loss per step (bf16 | nvfp4)")
        for s, (a, b) in enumerate(zip(losses["bf16"], losses["nvfp4"], strict=True)):
            print(f"  step {s:3d}  {a:.4f} | {b:.4f}")
        print(f"  ({time.perf_counter() - start:.1f} s)")
    return results


if __name__ == "__main__":
    main()
