"""Time the GEMMs of serving: bfloat16 activations by a weight stored in NVFP4.

    python benchmarks/serving_bench.py         # 4096->14336, 8192->28672, 14336->4096
    python benchmarks/serving_bench.py --shapes 4096x14336 --rows 16,256

For each weight K -> N and each row count M, a jitted loop of --iters GEMMs
(activations rescaled per iteration so that no GEMM is hoisted, outputs
summed), cycling through --copies weights of the shape so that no weight is
still in the L2 cache when its turn comes (as in a model, where each layer
has its own): the time per GEMM of
  bf16            jnp.dot of x by the bf16 weight (what serving in bf16 does)
  w4a16 engine    jax_nvfp4's weight-only GEMM on the Hopper engine, the
                  weight decoded in registers (ops.w4a16_matmul, path
                  "engine"; compute capability 9.0)
  w4a16 handler   the same on the mma.sync handler (path "handler")
  w4a16 decoded   the same product by the weight decoded to bf16 per call and
                  the cuBLASLt GEMM (path "cublaslt")
  w4a4            matmul(quantize(x), w): the activations quantized as in
                  training's FPROP, then the decoding GEMM
  matmul          what jax_nvfp4.matmul(x, w) dispatches to at this M
  loop            the loop around a product that reads no weight (x's first
                  column broadcast): the loop's own time per GEMM (the
                  rescale of x, the float32 sum of the outputs)
The loop keeps the Python dispatch of each call out of the times. Last
columns: bf16's time over matmul's; the same with the loop's own time taken
from both (the GEMMs alone); the weight's bytes (4.5 bits an element) over
matmul's time.

Then the grouped form (mixture-of-experts serving), for each expert shape of
--grouped-shapes: --experts experts with --expert-rows rows each, x [G * rows,
K] sorted by expert, the experts' weights cycled through --grouped-copies
stacks:
  bf16 xla         jax.lax.ragged_dot by the bf16 experts
  bf16 tokamax *   tokamax's ragged_dot (mosaic, triton: what MaxText's MoE
                   layer calls) by the bf16 experts, where it imports
  w4a16 ragged     jax_nvfp4.ragged_dot by the NVFP4 experts (the engine's
                   grouped form on an H100/H200)
Last columns: the fastest bf16's time over w4a16 ragged's; the same with the
loop's own time taken from both; the experts' bytes (4.5 bits an element)
over w4a16 ragged's time.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
from common import (
    argument_parser,
    header,
    parse_shape,
    tokamax_ragged_dot,
    write_json,
)

import jax_nvfp4 as nv
from jax_nvfp4 import ops
from jax_nvfp4.backends import w4a16_gemm


def looped(product, iters):
    """A jitted loop of `iters` products of rescaled x, taking the weights in
    turn; returns their sum."""

    def run(x, weights):
        def body(i, acc):
            scale = (1 + i % 3).astype(x.dtype)
            for w in weights:
                acc = acc + product(x * scale, w).astype(jnp.float32)
            return acc

        n = jax.eval_shape(product, x, weights[0]).shape
        rounds = iters // len(weights)
        return jax.lax.fori_loop(0, rounds, body, jnp.zeros(n, jnp.float32))

    return jax.jit(run)


def no_weight(x, n):
    """[M, n] from x alone: what the loop costs around a product."""
    return jnp.broadcast_to(x[:, :1], (x.shape[0], n))


def time_per_gemm(fn, x, weights, iters, rounds):
    jax.block_until_ready(fn(x, weights))
    gemms = iters // len(weights) * len(weights)
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn(x, weights))
        samples.append((time.perf_counter() - start) / gemms)
    return statistics.median(samples)


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--shapes", default="4096x14336,8192x28672,14336x4096")
    parser.add_argument("--rows", default="1,16,64,256,2048")
    parser.add_argument("--iters", type=int, default=48)
    parser.add_argument(
        "--copies", type=int, default=4, help="weights cycled through (L2 > 1 copy)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--grouped-shapes",
        default="4096x14336,14336x4096",
        help="expert shapes K x N of the grouped form ('' leaves it out)",
    )
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--expert-rows", default="16", help="rows per expert")
    parser.add_argument("--grouped-copies", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    print(header())
    results = dense(args) if args.shapes else []
    grouped_results = grouped(args) if args.grouped_shapes else []
    if args.out:
        write_json(
            args.out,
            {"args": vars(args), "results": results, "grouped": grouped_results},
        )


def dense(args):
    """The dense table: one weight K -> N by M rows."""

    def w4a16(path):
        """The W4A16 primitive lowered to the CUDA GEMM ``path``."""

        def product(x, w):
            n, k = w.stored_shape
            return ops.w4a16_matmul(
                x[None],
                w.codes.reshape(1, n, k // 2),
                w.scales.reshape(1, n, k // 16),
                jnp.asarray(w.amax, jnp.float32).reshape(1),
                dtype=jnp.bfloat16,
                path=path,
            )[0]

        return product

    products = {
        "bf16": lambda x, w: jnp.dot(x, w[1]),
        "w4a16 engine": lambda x, w: w4a16("engine")(x, w[0]),
        "w4a16 handler": lambda x, w: w4a16("handler")(x, w[0]),
        "w4a16 decoded": lambda x, w: w4a16("cublaslt")(x, w[0]),
        "w4a4": lambda x, w: nv.matmul(nv.quantize(x), w[0]),
        "matmul": lambda x, w: nv.matmul(x, w[0]),
        "loop": lambda x, w: no_weight(x, w[0].shape[-1]),
    }
    if not w4a16_gemm.handler_supported(256, 2):  # e.g. on the CPU
        for name in ("w4a16 handler", "w4a16 decoded"):
            del products[name]
    if not w4a16_gemm.engine_supported(256):  # not an H100/H200
        del products["w4a16 engine"]
    results = []
    print(
        f"{'K -> N':>13s} {'M':>5s} "
        + " ".join(f"{name:>14s}" for name in products)
        + "   (us per GEMM; bf16 / matmul; the same less the loop; weight TB/s)"
    )
    for shape in args.shapes.split(","):
        k, n = parse_shape(shape)
        weights = []
        for copy in range(args.copies):
            w_float = jax.random.normal(jax.random.key(1 + copy), (k, n)) * 0.02
            w_q = nv.quantize(w_float, axis=0, block="16x16")
            weights.append((w_q, nv.dequantize(w_q, jnp.bfloat16)))
        for m in (int(r) for r in args.rows.split(",")):
            x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
            row = {"k": k, "n": n, "m": m}
            for name, product in products.items():
                fn = looped(product, args.iters)
                row[name] = time_per_gemm(fn, x, weights, args.iters, args.rounds)
            results.append(row)
            times = " ".join(f"{row[name] * 1e6:14.1f}" for name in products)
            weight_bytes = n * k * 9 / 16  # codes and E4M3 scales
            alone = (row["bf16"] - row["loop"]) / (row["matmul"] - row["loop"])
            print(
                f"{k:>6d}->{n:<6d} {m:5d} {times}   {row['bf16'] / row['matmul']:.2f}x"
                f"   {alone:.2f}x   {weight_bytes / row['matmul'] / 1e12:.2f}"
            )
    return results


def tokamax_products():
    """{name: product} of tokamax's ragged_dot implementations, where
    tokamax imports."""
    ragged_dot, why = tokamax_ragged_dot()
    if ragged_dot is None:
        print(f"tokamax left out: {why}")
        return {}
    return {
        f"bf16 tokamax {impl}": (
            lambda x, w, sizes, impl=impl: ragged_dot(
                x, w[1], sizes, implementation=impl
            )
        )
        for impl in ("mosaic", "triton")
    }


def apply(product, sizes, x, w):
    return product(x, w, sizes)


def grouped(args):
    """The grouped table: G experts K -> N, rows per expert."""
    products = {
        "bf16 xla": lambda x, w, sizes: jax.lax.ragged_dot(x, w[1], sizes),
        **tokamax_products(),
        "w4a16 ragged": lambda x, w, sizes: nv.ragged_dot(x, w[0], sizes),
        "loop": lambda x, w, sizes: no_weight(x, w[1].shape[-1]),
    }
    bf16_names = [name for name in products if name.startswith("bf16")]
    count = args.experts
    print(
        f"\n{'G x K -> N':>16s} {'rows':>5s} "
        + " ".join(f"{name:>19s}" for name in products)
        + "   (us per grouped GEMM; fastest bf16 / w4a16; less the loop; TB/s)"
    )
    results = []
    for shape in args.grouped_shapes.split(","):
        k, n = parse_shape(shape)
        weights = []
        for copy in range(args.grouped_copies):
            w_float = jax.random.normal(jax.random.key(1 + copy), (count, k, n)) * 0.02
            w_q = jax.vmap(lambda e: nv.quantize(e, axis=0, block="16x16"))(w_float)
            w_bf16 = jax.vmap(lambda e: nv.dequantize(e, jnp.bfloat16))(w_q)
            weights.append((w_q, w_bf16))
            del w_float
        for per_expert in (int(r) for r in args.expert_rows.split(",")):
            sizes = jnp.full((count,), per_expert, jnp.int32)
            x = jax.random.normal(
                jax.random.key(0), (count * per_expert, k), jnp.bfloat16
            )
            row = {"k": k, "n": n, "experts": count, "rows_per_expert": per_expert}
            for name, product in products.items():
                fn = looped(functools.partial(apply, product, sizes), args.iters)
                try:
                    row[name] = time_per_gemm(fn, x, weights, args.iters, args.rounds)
                except Exception as e:  # noqa: BLE001 - report it, go on
                    print(f"{name} failed: {type(e).__name__}: {str(e)[:200]}")
                    row[name] = float("nan")
            results.append(row)
            best = min(row[name] for name in bf16_names if row[name] == row[name])
            times = " ".join(f"{row[name] * 1e6:19.1f}" for name in products)
            expert_bytes = count * n * k * 9 / 16
            ours = row["w4a16 ragged"]
            alone = (best - row["loop"]) / (ours - row["loop"])
            print(
                f"{count:>3d} x {k:>5d}->{n:<5d} {per_expert:5d} {times}   "
                f"{best / ours:.2f}x   {alone:.2f}x   {expert_bytes / ours / 1e12:.2f}"
            )
    return results


if __name__ == "__main__":
    main()
