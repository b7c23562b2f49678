"""Check sharded NVFP4 on all local GPUs against one GPU and the CPU; time weak scaling.

    python benchmarks/multi_gpu_check.py              # on a machine with 2+ GPUs
    python benchmarks/multi_gpu_check.py --no-scaling # the checks only

1. The fused quantize (rows nearest; columns RHT + stochastic rounding) of a
   tensor sharded over the GPUs by rows and by columns: codes, scales and
   amaxes byte-identical to one GPU and to the CPU handler.
2. jax_nvfp4.dot forward + both gradients, tokens sharded (data parallel)
   and w sharded by columns (tensor parallel): the largest relative
   difference from one GPU (float32 accumulation order only).
3. Weak scaling of a data-parallel linear step (8192 tokens per GPU,
   4096 -> 14336, forward + backward + gradient all-reduce), NVFP4 and bf16:
   efficiency = time on one GPU / time on all.
Exits 1 if a check fails.
"""

import jax
import jax.numpy as jnp
import numpy as np
from common import argument_parser, median_seconds, parse_shape
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvfp4 as nv


def outliers(seed, shape):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape) * 1.5)
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, flat.size // 500, replace=False)] *= 300
    return x.astype(np.float32)


def tensor_bytes(t):
    return [
        np.asarray(t.codes),
        np.asarray(jax.lax.bitcast_convert_type(t.scales, jnp.uint8)),
        np.asarray(t.amax, np.float32).view(np.uint32),
    ]


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument(
        "--scaling-shape",
        default="8192x4096x14336",
        help="TOKENS_PER_GPUxKxN of the weak-scaling step",
    )
    parser.add_argument(
        "--no-scaling", action="store_true", help="skip the weak-scaling timing"
    )
    opts = parser.parse_args(argv)
    gpus = jax.devices()
    n = len(gpus)
    if n < 2:
        print(f"only {n} device(s): the sharded results compare with themselves")
    # Auto axes: XLA propagates the shardings, as under a plain jit.
    mesh = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    key = jax.random.key(5)
    print(f"{n} x {gpus[0].device_kind}; jax {jax.__version__}")

    def fused(x):
        return nv.quantize_rowwise_and_columnwise(
            x, col_rht=True, col_rounding="stochastic", key=key
        )

    x = jnp.asarray(outliers(0, (256 * n, 512)), jnp.bfloat16)
    one = jax.jit(fused)(jax.device_put(x, gpus[0]))
    cpu = jax.jit(fused)(jax.device_put(x, jax.devices("cpu")[0]))
    ok = True
    for name, spec in (("rows", P("d", None)), ("columns", P(None, "d"))):
        sharded = jax.jit(fused)(jax.device_put(x, NamedSharding(mesh, spec)))
        for label, ref in (("one GPU", one), ("CPU", cpu)):
            same = all(
                np.array_equal(a, b)
                for t, r in zip(sharded, ref, strict=True)
                for a, b in zip(tensor_bytes(t), tensor_bytes(r), strict=True)
            )
            ok &= same
            print(f"quantize sharded by {name} vs {label}: bytes identical {same}")

    tokens, k, nout = 128 * n, 256, 64 * n
    xs = jnp.asarray(outliers(1, (tokens, k)))
    w = jnp.asarray(outliers(2, (k, nout)) * 0.1)
    g = jnp.asarray(outliers(3, (tokens, nout)))

    def loss(x, w, g):
        return jnp.sum(nv.dot(x, w, key=key).astype(jnp.float32) * g)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    on_one = [jax.device_put(a, gpus[0]) for a in (xs, w, g)]
    want = step(*on_one)
    layouts = {
        "data parallel": (P("d", None), P(None, None), P("d", None)),
        "tensor parallel (w columns)": (P(None, None), P(None, "d"), P(None, "d")),
    }
    for name, specs in layouts.items():
        args = [
            jax.device_put(a, NamedSharding(mesh, s))
            for a, s in zip((xs, w, g), specs, strict=True)
        ]
        got = step(*args)
        rel = max(
            float(jnp.max(jnp.abs(np.asarray(a) - np.asarray(b))))
            / max(float(jnp.max(jnp.abs(np.asarray(b)))), 1e-30)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
        )
        ok &= rel <= 2.0**-16
        print(f"dot {name}: max |diff| / max |one GPU| = {rel:.2e} (bound 2^-16)")
    if not opts.no_scaling:
        scaling(mesh, gpus, key, *parse_shape(opts.scaling_shape))
    print("ALL OK" if ok else "MISMATCH")
    return 0 if ok else 1


def scaling(mesh, gpus, key, per_gpu, k, nout):
    n = len(gpus)
    print(f"weak scaling, {per_gpu} tokens per GPU, {k} -> {nout}:")
    for name, recipe in (("bf16", nv.BF16), ("nvfp4", nv.NVFP4)):

        def loss(x, w, recipe=recipe):
            y = nv.dot(x, w, key=key, recipe=recipe)
            return jnp.sum(y.astype(jnp.float32) ** 2)

        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        w = jax.random.normal(jax.random.key(1), (k, nout), jnp.bfloat16)
        x = jax.random.normal(jax.random.key(2), (per_gpu * n, k), jnp.bfloat16)
        t1 = 1e3 * median_seconds(step, jax.device_put(x[:per_gpu], gpus[0]), w)
        tn = 1e3 * median_seconds(
            step,
            jax.device_put(x, NamedSharding(mesh, P("d", None))),
            jax.device_put(w, NamedSharding(mesh, P())),
        )
        print(
            f"  {name:6s} 1 GPU {t1:7.3f} ms, {n} GPUs {tn:7.3f} ms, "
            f"efficiency {t1 / tn:.2f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
