"""Time a mixture-of-experts MLP, forward + backward: NVFP4 against bf16.

    python benchmarks/moe_bench.py                    # 8 experts, d 2048, 32k tokens
    python benchmarks/moe_bench.py --tokens 8192 --rounds 5

The expert MLP of an MoE block: 8 SwiGLU experts (d -> ffn -> d), each token
routed to 2 of them, the rows sorted by expert and unbalanced 2:1 (even
experts get twice the rows of odd ones). One step is y = down(silu(gate(r)) *
up(r)) over the sorted rows r and its vjp with a random cotangent. Rows:
  bf16 ragged_dot      the three projections by jax.lax.ragged_dot, bf16
  nvfp4 ragged_dot     the same by jax_nvfp4.ragged_dot (the full recipe:
                       RHT, stochastic rounding, 16x16 weight tiles)
  bf16 dense batched   the same FLOPs as a dense batched GEMM (every expert
                       with the mean row count, jnp.einsum): how fast the
                       bf16 ragged_dot is, so that a slow baseline cannot
                       flatter the ratio
Each row is a jitted step; the rows take turns over --rounds rounds (each
settles --settle seconds, then --reps steps are timed back to back), and the
ratio to bf16 ragged_dot is taken within each round.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from common import argument_parser, header, write_json

import jax_nvfp4 as nv


def group_sizes(rows: int, experts: int) -> jax.Array:
    """rows split 2:1 between even and odd experts (the remainder to the
    last)."""
    weights = [2 if g % 2 == 0 else 1 for g in range(experts)]
    sizes = [rows * w // sum(weights) for w in weights]
    sizes[-1] += rows - sum(sizes)
    return jnp.array(sizes, jnp.int32)


def swiglu(product):
    def mlp(rows, wg, wu, wd):
        h = jax.nn.silu(product(rows, wg, "gate")) * product(rows, wu, "up")
        return product(h, wd, "down")

    def step(rows, wg, wu, wd, dy):
        y, vjp = jax.vjp(mlp, rows, wg, wu, wd)
        return (y, *vjp(dy))

    return step


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    print(header())
    rows_n, d, ffn, e = args.tokens * args.top_k, args.d, args.ffn, args.experts
    if rows_n % e:
        raise SystemExit("tokens x top-k must be a multiple of the expert count")
    sizes = group_sizes(rows_n, e)
    keys = jax.random.split(jax.random.key(0), 5)
    rows = jax.random.normal(keys[0], (rows_n, d), jnp.bfloat16)
    wg = jax.random.normal(keys[1], (e, d, ffn), jnp.bfloat16) * 0.02
    wu = jax.random.normal(keys[2], (e, d, ffn), jnp.bfloat16) * 0.02
    wd = jax.random.normal(keys[3], (e, ffn, d), jnp.bfloat16) * 0.02
    dy = jax.random.normal(keys[4], (rows_n, d), jnp.bfloat16)
    step_key = jax.random.key(7)
    print(
        f"{e} experts, d {d}, SwiGLU {ffn}, {args.tokens} tokens x top-{args.top_k}"
        f" = {rows_n} rows, group sizes {sizes.tolist()}"
    )

    def bf16_product(x, w, _):
        return jax.lax.ragged_dot(x, w, sizes)

    def nvfp4_product(x, w, name):
        key = jax.random.fold_in(step_key, ("gate", "up", "down").index(name))
        return nv.ragged_dot(x, w, sizes, key=key)

    per = rows_n // e  # the dense baseline: every expert the mean row count

    def dense_product(x, w, _):
        return jnp.einsum("gtk,gkn->gtn", x.reshape(e, per, -1), w).reshape(rows_n, -1)

    steps = {
        "bf16 ragged_dot": jax.jit(swiglu(bf16_product)),
        "nvfp4 ragged_dot": jax.jit(swiglu(nvfp4_product)),
        "bf16 dense batched": jax.jit(swiglu(dense_product)),
    }
    operands = (rows, wg, wu, wd, dy)
    times = {name: [] for name in steps}
    for fn in steps.values():
        jax.block_until_ready(fn(*operands))  # compile
    for _ in range(args.rounds):
        for name, fn in steps.items():
            start = time.perf_counter()
            while time.perf_counter() - start < args.settle:
                jax.block_until_ready(fn(*operands))
            start = time.perf_counter()
            out = [fn(*operands) for _ in range(args.reps)]
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / args.reps * 1e3)
    base = times["bf16 ragged_dot"]
    print(f"{'step (fwd + bwd)':24s} {'ms':>9s} {'vs bf16 ragged_dot':>20s}")
    summary = {}
    for name, values in times.items():
        ratios = [t / b for t, b in zip(values, base, strict=True)]
        summary[name] = {"ms": statistics.median(values), "ratio": ratios}
        print(
            f"{name:24s} {statistics.median(values):9.2f} "
            f"{statistics.median(ratios):9.3f}x ({min(ratios):.3f}..{max(ratios):.3f})"
        )
    flops = 3 * 2 * 3 * rows_n * d * ffn  # 3 GEMMs fwd+bwd, 3 projections
    ms = summary["bf16 ragged_dot"]["ms"]
    print(f"bf16 ragged_dot: {flops / ms / 1e9:.0f} TFLOP/s")
    if args.out:
        write_json(args.out, {"args": vars(args), "ms": times})


if __name__ == "__main__":
    main()
