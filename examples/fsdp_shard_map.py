"""FSDP training of an NVFP4 MLP with shard_map.

Weights are sharded over the ``fsdp`` mesh axis and gathered one layer at a
time inside the step; tokens are sharded over the same axis; gradients come
back reduce-scattered (the transpose of the gather). ``jax_nvfp4.dot`` is
told the token axis (``axis_name="fsdp"``), so amaxes are reduced across
shards and stochastic rounding follows the global token index: every step
quantizes exactly as one device would. ``--check`` recomputes the first
step on one device and prints the largest difference.

    python examples/fsdp_shard_map.py                 # 8 virtual CPU devices
    python examples/fsdp_shard_map.py --devices 0     # all real devices (GPUs)
"""

import argparse
import os
import sys

parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
)
parser.add_argument(
    "--devices", type=int, default=8, help="virtual CPU devices (0: use the real ones)"
)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--tokens", type=int, default=1024, help="global tokens per step")
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--hidden", type=int, default=1024)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument(
    "--check", action="store_true", help="compare step 1 with one device"
)
args = parser.parse_args()
if args.devices:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_nvfp4 as nv  # noqa: E402

try:
    from jax import shard_map
except ImportError:  # older JAX
    from jax.experimental.shard_map import shard_map

mesh = jax.make_mesh((len(jax.devices()),), ("fsdp",))
SHARDED = P("fsdp", None)  # weights: first axis; tokens: first axis


def init(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (args.width, args.hidden), jnp.float32)
        / args.width**0.5,
        "w2": jax.random.normal(k2, (args.hidden, args.width), jnp.float32)
        / args.hidden**0.5,
    }


def data(key):
    """A teacher network's outputs for random inputs: a regression target."""
    kx, kt = jax.random.split(key)
    x = jax.random.normal(kx, (args.tokens, args.width), jnp.float32)
    teacher = (
        jax.random.normal(kt, (args.width, args.width), jnp.float32) / args.width**0.5
    )
    return x, jnp.tanh(x @ teacher)


def mlp(params, x, key, axis_name):
    """One shard's forward pass; each weight gathered just before its GEMM."""
    k1, k2 = jax.random.split(key)
    dot = lambda a, w, k: nv.dot(  # noqa: E731
        a.astype(jnp.bfloat16), w.astype(jnp.bfloat16), key=k, axis_name=axis_name
    )
    gather = (
        (lambda w: jax.lax.all_gather(w, axis_name, axis=0, tiled=True))
        if axis_name
        else (lambda w: w)
    )
    h = jax.nn.gelu(dot(x, gather(params["w1"]), k1).astype(jnp.float32))
    return dot(h, gather(params["w2"]), k2).astype(jnp.float32)


def local_loss(params, x, y, key, axis_name=None):
    err = jnp.sum((mlp(params, x, key, axis_name) - y) ** 2)
    if axis_name:
        err = jax.lax.psum(err, axis_name)
    return err / (args.tokens * args.width)


sharded_loss = shard_map(
    lambda p, x, y, k: local_loss(p, x, y, k, "fsdp"),
    mesh=mesh,
    in_specs=({"w1": SHARDED, "w2": SHARDED}, SHARDED, SHARDED, P()),
    out_specs=P(),
)


@jax.jit
def train_step(params, x, y, key):
    loss, grads = jax.value_and_grad(sharded_loss)(params, x, y, key)
    return jax.tree.map(lambda p, g: p - args.lr * g, params, grads), loss, grads


def main():
    put = lambda a: jax.device_put(a, NamedSharding(mesh, SHARDED))  # noqa: E731
    params = jax.tree.map(put, init(jax.random.key(0)))
    x, y = map(put, data(jax.random.key(1)))
    print(
        f"{len(jax.devices())} devices; "
        f"w1 shard {params['w1'].addressable_shards[0].data.shape}"
    )
    if args.check:
        _, loss, grads = train_step(params, x, y, jax.random.key(100))
        one = jax.jit(jax.value_and_grad(local_loss))
        loss1, grads1 = one(
            jax.device_get(params),
            jax.device_get(x),
            jax.device_get(y),
            jax.random.key(100),
        )
        diff = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(
                jax.tree.leaves(grads), jax.tree.leaves(grads1), strict=True
            )
        )
        print(
            f"step 1 vs one device: loss {float(loss):.6f} vs {float(loss1):.6f}, "
            f"max |grad diff| {diff:.2e}"
        )
    for step in range(args.steps):
        params, loss, _ = train_step(params, x, y, jax.random.key(100 + step))
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {float(loss):.5f}")
    hlo = train_step.lower(params, x, y, jax.random.key(0)).compile().as_text()
    print(
        "collectives in the step:",
        {
            op: hlo.count(f" {op}(")
            for op in ("all-gather", "reduce-scatter", "all-reduce")
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
