"""Data + tensor parallel training of an NVFP4 MLP under jit with NamedSharding.

A Megatron-style MLP: w1 split by columns and w2 by rows over the ``model``
axis, tokens split over ``data``. No shard_map: the jax_nvfp4 primitives
partition themselves, so XLA keeps every activation and weight sharded (the
FP4 quantizations run per shard with the global amax; WGRAD and the row-split
GEMM reduce partial sums). The step's collectives are printed; there is no
all-gather.

    python examples/data_tensor_parallel.py               # 8 virtual CPU devices
    python examples/data_tensor_parallel.py --devices 0   # real devices (GPUs)
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
parser.add_argument("--model-parallel", type=int, default=2)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--tokens", type=int, default=1024)
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--hidden", type=int, default=1024)
parser.add_argument("--lr", type=float, default=0.05)
args = parser.parse_args()
if args.devices:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_nvfp4 as nv  # noqa: E402

n = len(jax.devices())
mesh = jax.make_mesh((n // args.model_parallel, args.model_parallel), ("data", "model"))
SPECS = {"w1": P(None, "model"), "w2": P("model", None)}


def init(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (args.width, args.hidden), jnp.float32)
        / args.width**0.5,
        "w2": jax.random.normal(k2, (args.hidden, args.width), jnp.float32)
        / args.hidden**0.5,
    }


def loss_fn(params, x, y, key):
    k1, k2 = jax.random.split(key)
    bf = lambda a: a.astype(jnp.bfloat16)  # noqa: E731
    h = jax.nn.gelu(nv.dot(bf(x), bf(params["w1"]), key=k1).astype(jnp.float32))
    out = nv.dot(bf(h), bf(params["w2"]), key=k2).astype(jnp.float32)
    return jnp.mean((out - y) ** 2)


@jax.jit
def train_step(params, x, y, key):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y, key)
    return jax.tree.map(lambda p, g: p - args.lr * g, params, grads), loss


def main():
    params = {
        k: jax.device_put(v, NamedSharding(mesh, SPECS[k]))
        for k, v in init(jax.random.key(0)).items()
    }
    kx, kt = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (args.tokens, args.width), jnp.float32)
    teacher = jax.random.normal(kt, (args.width, args.width)) / args.width**0.5
    y = jnp.tanh(x @ teacher)
    x, y = (jax.device_put(a, NamedSharding(mesh, P("data", None))) for a in (x, y))
    print(
        f"mesh {dict(mesh.shape)}; w1 {params['w1'].sharding.spec}, "
        f"w2 {params['w2'].sharding.spec}"
    )
    for step in range(args.steps):
        params, loss = train_step(params, x, y, jax.random.key(100 + step))
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {float(loss):.5f}")
    hlo = train_step.lower(params, x, y, jax.random.key(0)).compile().as_text()
    counts = {
        op: hlo.count(f" {op}(")
        for op in ("all-gather", "reduce-scatter", "all-reduce")
    }
    print("collectives in the step:", counts)
    print(
        "parameters stay sharded:", {k: str(v.sharding.spec) for k, v in params.items()}
    )
    return 0 if counts["all-gather"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
