"""Time jax_nvfp4's CPU handlers against XLA's own CPU work on the same tensors.

    python benchmarks/cpu_bench.py                      # 2048 tokens x 1024 -> 1024
    python benchmarks/cpu_bench.py --shape 4096x2048x2048 --calls 5
    python benchmarks/cpu_bench.py --parts              # add where the time goes
    python benchmarks/cpu_bench.py --only-passes        # dequantize, global_amax

Rows, each a jitted call, timed as the median wall time of --calls calls; the
rows take turns, --rounds times (a drift of the machine, such as another
process, then hits them alike), and the table shows the median over rounds
and the ratio to the row's yardstick taken within each round (median, and
min..max over rounds):
  dot fwd+bwd        jax.value_and_grad of sum(dot(x, w) * dy) over x and w,
                     jax_nvfp4.dot with the NVFP4 recipe (RHT, stochastic
                     rounding of dY, 16x16 weight tiles) and a key;
                     yardstick: the same with bf16 jnp.dot.
  matmul             jax_nvfp4.matmul of x quantized along K and w quantized
                     along K (16x16), bfloat16 out; yardstick: bf16 jnp.dot.
  quantize x fused   quantize_rowwise_and_columnwise with x's options in the
                     recipe (columns RHT, nearest), global amaxes included;
  quantize           plain quantize(x) (row-wise 1x16, nearest), amax
                     included; yardstick of both: the XLA elementwise pass
                     (x.astype(float32) * s).astype(bfloat16) over x (reads
                     and writes bf16 once, one fusion).
  dequantize D       jax_nvfp4.dequantize of quantize(x2) to dtype D;
                     yardstick: an XLA elementwise pass that reads the codes
                     and writes the output, (broadcast of each code byte to
                     two elements).astype(f32) * s, as D (one fusion).
  global_amax D      jax_nvfp4.global_amax(x2) (max |x| over the finite
                     values); yardstick: XLA's own reduce jnp.max(jnp.abs(x2)).
The last two for x2 [--pass-shape] in bfloat16 and float32.
With --parts, the primitives the recipe's step runs, each alone (amaxes
given where the primitive takes them), to see where the time goes: the plain
amax (reference.abs_max, XLA), the amax primitive (plain and RHT amax), the
fused quantize kernels of x, dY and w, and one GEMM (the step runs three of
the same size).
Shapes: x [T, K] bf16, w [K, N] bf16, dy [T, N] bf16 (--shape TxKxN).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
from common import argument_parser, header, parse_shape

import jax_nvfp4 as nv
from jax_nvfp4 import ops

ELEMENTWISE = "(x.astype(f32) * s).astype(bf16)"


def median_seconds(fn, args, calls: int) -> float:
    """Median wall time of fn(*args) over `calls` calls, after one warm-up."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def operands(t: int, k: int, n: int):
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (t, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.bfloat16) * 0.02
    dy = jax.random.normal(keys[2], (t, n), jnp.bfloat16)
    return x, w, dy, keys[3]


def step(dot):
    """value_and_grad over (x, w) of sum(dot(x, w) * dy) in float32."""

    def loss(x, w, dy, key):
        y = dot(x, w, key)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def rows(t: int, k: int, n: int):
    """(name, fn, args, yardstick name) for every row of the table."""
    x, w, dy, key = operands(t, k, n)
    scale = jnp.float32(0.5)
    qx = nv.quantize(x)
    qw = nv.quantize(w, 0, block="16x16")
    yield "bf16 jnp.dot fwd+bwd", step(lambda a, b, _: a @ b), (x, w, dy, key), None
    nvfp4 = step(lambda a, b, kk: nv.dot(a, b, key=kk, recipe=nv.NVFP4))
    yield "dot fwd+bwd", nvfp4, (x, w, dy, key), "bf16 jnp.dot fwd+bwd"
    yield "bf16 jnp.dot", jax.jit(jnp.dot), (x, w), None
    matmul = jax.jit(nv.matmul)
    yield "matmul", matmul, (qx, qw), "bf16 jnp.dot"
    elementwise = jax.jit(lambda a, s: (a.astype(jnp.float32) * s).astype(a.dtype))
    yield f"elementwise {ELEMENTWISE}", elementwise, (x, scale), None
    fused = jax.jit(lambda a: nv.quantize_rowwise_and_columnwise(a, col_rht=True))
    yield "quantize x fused", fused, (x,), f"elementwise {ELEMENTWISE}"
    yield "quantize", jax.jit(nv.quantize), (x,), f"elementwise {ELEMENTWISE}"


def passes(r: int, c: int):
    """Rows of the single-pass ops over x2 [r, c], in bfloat16 and float32."""
    scale = jnp.float32(0.5)
    for dtype in (jnp.bfloat16, jnp.float32):
        name = jnp.dtype(dtype).name
        x2 = jax.random.normal(jax.random.key(1), (r, c), dtype)
        q = nv.quantize(x2)
        codes = q.codes

        def pass_over_codes(a, s, dtype=dtype):
            both = jnp.broadcast_to(a[..., None], (*a.shape, 2))
            return (both.reshape(r, c).astype(jnp.float32) * s).astype(dtype)

        base = f"elementwise codes -> {name}"
        yield base, jax.jit(pass_over_codes), (codes, scale), None
        deq = jax.jit(lambda t, dtype=dtype: nv.dequantize(t, dtype))
        yield f"dequantize {name}", deq, (q,), base
        reduce = f"jnp.max(jnp.abs(x)) {name}"
        yield reduce, jax.jit(lambda a: jnp.max(jnp.abs(a))), (x2,), None
        yield f"global_amax {name}", jax.jit(nv.global_amax), (x2,), reduce


def parts(t: int, k: int, n: int):
    """The primitives of one training step, each alone."""
    x, w, dy, key = operands(t, k, n)
    x3, dy3, w3 = x[None], dy[None], w[None]
    words = jnp.asarray(jax.random.key_data(key), jnp.uint32).reshape(1, 2)
    one = jnp.ones((1,), jnp.float32)
    spec = ops.QuantizeSpec

    def fused(rows_spec, cols_spec):
        return jax.jit(
            lambda a: ops.quantize_rows_cols(
                a, one, one, words, rows=rows_spec, cols=cols_spec
            )
        )

    yield "amax plain (XLA)", jax.jit(nv.reference.abs_max), (x,)
    yield "amax primitive (plain+RHT)", jax.jit(lambda a: ops.amax(a, cols=True)), (x3,)
    yield "quantize_rows_cols x", fused(spec(), spec(rht=True, stream=1)), (x3,)
    sr = spec(stochastic=True)
    yield (
        "quantize_rows_cols dY",
        fused(sr, spec(stochastic=True, rht=True, stream=1)),
        (dy3,),
    )
    tile = spec(block_rows=16)
    yield "quantize_rows_cols w", fused(tile, tile), (w3,)
    yield (
        "quantize_rows x",
        jax.jit(lambda a: ops.quantize_rows(a, one, words, rows=spec())),
        (x3,),
    )
    qx = nv.quantize(x)
    qw = nv.quantize(w, 0, block="16x16")
    yield (
        "matmul [T,K]x[K,N] f32 out",
        jax.jit(lambda a, b: nv.matmul(a, b, out_dtype=jnp.float32)),
        (qx, qw),
    )
    yield (
        "matmul reference (twin)",
        jax.jit(lambda a, b: nv.matmul(a, b, implementation="reference")),
        (qx, qw),
    )


def timed_rounds(entries, calls: int, rounds: int) -> dict[str, list[float]]:
    """{name: [seconds per round]} for (name, fn, args, ...) entries."""
    for _, fn, fn_args, *_ in entries:
        jax.block_until_ready(fn(*fn_args))  # compile
    samples: dict[str, list[float]] = {e[0]: [] for e in entries}
    for _ in range(rounds):
        for name, fn, fn_args, *_ in entries:
            samples[name].append(median_seconds(fn, fn_args, calls))
    return samples


def main():
    parser = argument_parser(__doc__)
    parser.add_argument("--shape", default="2048x1024x1024", help="TxKxN")
    parser.add_argument("--calls", type=int, default=5, help="timed calls a round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every row")
    parser.add_argument("--parts", action="store_true", help="time each primitive")
    parser.add_argument(
        "--pass-shape", default="4096x4096", help="RxC of the single-pass rows"
    )
    parser.add_argument(
        "--only-passes", action="store_true", help="only the single-pass rows"
    )
    parser.add_argument("--out", help="also write the timings as JSON here")
    args = parser.parse_args()
    t, k, n = parse_shape(args.shape)
    r, c = parse_shape(args.pass_shape)
    print(header())
    print(f"cores: {os.cpu_count()} | load average: {os.getloadavg()[0]:.2f}")
    print(
        f"x [{t}, {k}] bf16, w [{k}, {n}] bf16; median of {args.calls} calls, "
        f"{args.rounds} rounds"
    )
    print(f"single-pass rows: x2 [{r}, {c}]")
    entries = [] if args.only_passes else list(rows(t, k, n))
    entries += list(passes(r, c))
    samples = timed_rounds(entries, args.calls, args.rounds)
    print(f"{'op':<48} {'ms':>9} {'ratio':>7} {'min..max':>12}")
    for name, _, _, base in entries:
        ms = statistics.median(samples[name]) * 1e3
        if base is None:
            print(f"{name:<48} {ms:>9.2f} {'-':>7}")
            continue
        ratios = [a / b for a, b in zip(samples[name], samples[base], strict=True)]
        spread = f"{min(ratios):.2f}..{max(ratios):.2f}"
        print(f"{name:<48} {ms:>9.2f} {statistics.median(ratios):>6.2f}x {spread:>12}")
    if args.parts:
        part_entries = list(parts(t, k, n))
        part_samples = timed_rounds(part_entries, args.calls, args.rounds)
        samples.update(part_samples)
        print(f"\n{'primitive (alone)':<48} {'ms':>9}")
        for name, *_ in part_entries:
            print(f"{name:<48} {statistics.median(part_samples[name]) * 1e3:>9.2f}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": [t, k, n], "seconds": samples}, f, indent=1)


if __name__ == "__main__":
    main()
