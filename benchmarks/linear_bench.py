"""Time the NVFP4 GEMM and linear layer (forward + backward) against bf16, side by side.

    python benchmarks/linear_bench.py                  # GEMM 8192^3, two linear shapes
    python benchmarks/linear_bench.py --clocks --out linear.json
    python benchmarks/linear_bench.py --pipelined --linear 8192x4096x14336

Rows (each a jitted call applying the op to REPEAT inputs; time per op):
  gemm bf16            jnp.dot, bf16 [S, S] x [S, S], float32 accumulation
  gemm nvfp4           jax_nvfp4.matmul from NVFP4 operands (on Hopper: the
                       FP4 operands decoded to bf16, one bf16 GEMM)
  gemm scaled_matmul   jax.nn.scaled_dot_general with the nvfp4 config
  linear bf16          y = x @ w and its vjp with a random bf16 cotangent dy
  linear nvfp4         the same through jax_nvfp4.dot (RHT, SR, 2D weights)
  linear fake-quant    the same recipe in pure JAX (implementation="reference")
  linear scaled_dot    jax.nn.scaled_dot_general nvfp4 (no FP4 backward)

How it times: the ops of one table take turns, --rounds times, and each
ratio to bf16 is taken within a round, so that a drift of the device
(clocks, temperature, neighbours) cancels out of it; the median and the
min..max over rounds are printed. Before each timing the op runs untimed for
--settle seconds: the GPU's clock follows its power draw, and an op timed
right after another one would run at the clock the other one left.
--clocks samples the SM clock and power during each timed op (nvidia-smi).

Memory, per linear shape: the bytes the forward keeps for the backward (the
vjp closure's arrays; bf16 keeps x and w) and the peak device memory of one
jitted forward + backward step by XLA's compiled memory analysis (arguments
+ outputs + temporaries - aliased).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
from common import (
    ClockLog,
    argument_parser,
    gemm_operands,
    header,
    linear_operands,
    linear_step,
    parse_shape,
    write_json,
)

import jax_nvfp4 as nv

REPEAT = 4  # inputs per jitted call
CALLS = 7  # calls per measurement


@dataclasses.dataclass
class Timing:
    settle_s: float = 0.5
    pipelined: bool = False
    donate: bool = False
    ops: frozenset | None = None  # op names (last word of a row) to time
    # (row, start, end) of every measurement in Unix seconds, settling included
    timeline: list = dataclasses.field(default_factory=list)

    def selected(self, name: str) -> bool:
        return self.ops is None or name.split()[-1] in self.ops | {"bf16"}


def runner(fn, inputs, donate):
    """A call of `fn` on each of `inputs`, jitted into one computation: run()
    returns the list of outputs. With `donate` every call donates the
    previous call's outputs, so its outputs land in the same buffers (stable
    addresses, as a training step's donated state has)."""
    if not donate:
        jitted = jax.jit(lambda xs: [fn(*x) for x in xs])
        return lambda: jitted(inputs)
    # keep_unused: an unused donated argument is otherwise pruned, and then
    # nothing is aliased.
    jitted = jax.jit(
        lambda xs, previous: [fn(*x) for x in xs], donate_argnums=1, keep_unused=True
    )
    outs = [jitted(inputs, None)]

    def run():
        outs[0] = jitted(inputs, outs[0])
        return outs[0]

    return run


def timer(fn, inputs, timing: Timing):
    """A compiled, warmed-up measurement: measure() returns (seconds per op,
    its samples). Waited: the median over CALLS calls, each waited for.
    Pipelined: CALLS calls dispatched back to back and waited for once, as a
    training loop runs; the samples are [time per op, host dispatch per op]."""
    run = runner(fn, inputs, timing.donate)
    jax.block_until_ready(run())
    if timing.pipelined:  # one untimed batch: the first measured one is cold
        for _ in range(CALLS):
            last = run()
        jax.block_until_ready(last)

    def measure():
        end = time.perf_counter() + timing.settle_s
        while time.perf_counter() < end:
            jax.block_until_ready(run())
        if timing.pipelined:
            start = time.perf_counter()
            for _ in range(CALLS):
                last = run()
            dispatched = time.perf_counter()
            jax.block_until_ready(last)  # calls on one stream finish in order
            ops = CALLS * len(inputs)
            t = (time.perf_counter() - start) / ops
            return t, [t, (dispatched - start) / ops]
        samples = []
        for _ in range(CALLS):
            start = time.perf_counter()
            jax.block_until_ready(run())
            samples.append((time.perf_counter() - start) / len(inputs))
        return statistics.median(samples), samples

    return measure


def interleaved(timers, rounds, timing: Timing):
    """Times every op once per round, the ops taking turns. Returns {name:
    [(seconds, samples) per round]}; an op without a timer (None) gets NaNs."""
    times = {name: [] for name in timers}
    for _ in range(rounds):
        for name, measure in timers.items():
            start = time.time()
            times[name].append(measure() if measure else (float("nan"), []))
            timing.timeline.append((name, start, time.time()))
    return times


def ratio_summary(times, base):
    """Median time per op and the per-round ratio to `base` (min, median, max)."""
    medians = {name: [t for t, _ in rounds] for name, rounds in times.items()}
    out = {}
    for name, ts in medians.items():
        ratios = [t / b for t, b in zip(ts, medians[base], strict=True)]
        out[name] = {
            "ms": statistics.median(ts) * 1e3,
            "ms_per_round": [t * 1e3 for t in ts],
            "samples_ms": [[s * 1e3 for s in samples] for _, samples in times[name]],
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    return out


def scaled_dot(x, w):
    configs = [jax.nn.get_scaled_dot_general_config("nvfp4")] * 3
    return jax.nn.scaled_dot_general(
        x,
        w,
        (((x.ndim - 1,), (0,)), ((), ())),
        preferred_element_type=x.dtype,
        configs=configs,
    )


def optional(fn, fallback=None):
    """fn(), or `fallback` where an optional baseline is not available here."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- an optional baseline
        print("skipped:", type(e).__name__, str(e)[:200])
        return fallback


def bench_gemm(s, rounds, timing, hlo_dir=None):
    pairs, quantized = gemm_operands(s, REPEAT)
    if hlo_dir:
        text = jax.jit(nv.matmul).lower(*quantized[0]).compile().as_text()
        with open(f"{hlo_dir}/gemm_nvfp4_{s}.hlo.txt", "w") as f:
            f.write(text)
    builders = {
        "gemm bf16": lambda: timer(jnp.dot, pairs, timing),
        "gemm nvfp4": lambda: timer(nv.matmul, quantized, timing),
        "gemm scaled_matmul": lambda: optional(
            lambda: timer(scaled_dot, pairs, timing)
        ),
    }
    timers = {n: build() for n, build in builders.items() if timing.selected(n)}
    return ratio_summary(interleaved(timers, rounds, timing), "gemm bf16")


def residual_bytes(dot, x, w):
    _, vjp_fn = jax.vjp(dot, x, w)
    return sum(leaf.nbytes for leaf in jax.tree.leaves(vjp_fn))


def step_peak_bytes(step, *args):
    m = jax.jit(step).lower(*args).compile().memory_analysis()
    if m is None:
        return float("nan")
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def bench_linear(tokens, k, n, rounds, timing, hlo_dir=None):
    (x, w, dy), key = linear_operands(tokens, k, n)
    inputs = [(x, w, dy)] * REPEAT
    fake = nv.Recipe(implementation="reference")
    dots = {
        "bf16": jnp.dot,
        "nvfp4": lambda x, w: nv.dot(x, w, key=key),
        "fake-quant": lambda x, w: nv.dot(x, w, key=key, recipe=fake),
        "scaled_dot": scaled_dot,
    }
    dots = {name: d for name, d in dots.items() if timing.selected(name)}
    timers = {
        f"linear {name}": optional(lambda d=d: timer(linear_step(d), inputs, timing))
        for name, d in dots.items()
    }
    times = ratio_summary(interleaved(timers, rounds, timing), "linear bf16")
    nan = float("nan")
    memory = {
        name: {
            "residual_bytes": optional(lambda d=d: residual_bytes(d, x, w), nan),
            "step_peak_bytes": optional(
                lambda d=d: step_peak_bytes(linear_step(d), x, w, dy), nan
            ),
        }
        for name, d in dots.items()
    }
    if hlo_dir:
        for name in ("bf16", "nvfp4"):
            if name in dots:
                text = jax.jit(linear_step(dots[name])).lower(x, w, dy)
                with open(
                    f"{hlo_dir}/linear_{name}_{tokens}x{k}x{n}.hlo.txt", "w"
                ) as f:
                    f.write(text.compile().as_text())
    return times, memory


def print_times(summary, clocks=None):
    extra = f" {'SM MHz':>7} {'W':>5}" if clocks is not None else ""
    print(f"{'op':>22} {'ms':>8} {'vs bf16':>8} {'(min..max over rounds)':>24}{extra}")
    for name, r in summary.items():
        line = (
            f"{name:>22} {r['ms']:8.3f} {r['ratio_median']:8.2f}"
            f"   ({r['ratio_min']:.2f}..{r['ratio_max']:.2f})"
        )
        if clocks is not None:
            c = clocks.get(name)
            line += (
                f"{'':>9}{c['sm_clock_mhz']:7.0f} {c['power_w']:5.0f}"
                if c
                else f"{'':>9}{'-':>7} {'-':>5}"
            )
        print(line)


def print_memory(memory):
    print(f"{'':>22} {'residual MB':>12} {'vs bf16':>8} {'step peak MB':>13}")
    base = memory.get("bf16", {}).get("residual_bytes", float("nan"))
    for name, m in memory.items():
        r, p = m["residual_bytes"], m["step_peak_bytes"]
        print(f"{name:>22} {r / 2**20:12.1f} {r / base:8.3f} {p / 2**20:13.1f}")


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--out", help="write every sample and the summary as JSON")
    parser.add_argument("--hlo-dir", help="write the compiled HLO of the ops here")
    parser.add_argument("--gemm", type=int, default=8192, help="GEMM size S (S^3)")
    parser.add_argument(
        "--linear",
        default="8192x4096x14336,16384x8192x28672",
        help="comma-separated TOKENSxKxN linear shapes",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds in which the ops take turns"
    )
    parser.add_argument(
        "--ops",
        help="comma-separated ops to time besides bf16 (nvfp4, scaled_matmul, "
        "fake-quant, scaled_dot); default all",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=0.5,
        help="seconds each op runs untimed before it is timed",
    )
    parser.add_argument(
        "--pipelined",
        action="store_true",
        help="time calls dispatched back to back and waited for once (as a "
        "training loop runs) instead of waiting for each call",
    )
    parser.add_argument(
        "--donate",
        action="store_true",
        help="each call donates the previous call's outputs (stable addresses)",
    )
    parser.add_argument(
        "--clocks",
        action="store_true",
        help="sample the GPU's SM clock and power (nvidia-smi) during each op",
    )
    args = parser.parse_args(argv)
    timing = Timing(
        settle_s=args.settle,
        pipelined=args.pipelined,
        donate=args.donate,
        ops=frozenset(args.ops.split(",")) if args.ops else None,
    )
    mode = "pipelined" if timing.pipelined else "each call waited for"
    print(f"{header()} | {mode}")
    log = ClockLog() if args.clocks and ClockLog.available() else None
    if args.clocks and log is None:
        print("--clocks: no nvidia-smi here; clocks not logged")
    results = {"linear": {}}
    with log if log else contextlib.nullcontext():
        results["gemm"] = bench_gemm(args.gemm, args.rounds, timing, args.hlo_dir)
        tables = [("gemm", results["gemm"], None)]
        for shape in args.linear.split(","):
            times, memory = bench_linear(
                *parse_shape(shape), args.rounds, timing, args.hlo_dir
            )
            results["linear"][shape] = {"times": times, "memory_bytes": memory}
            tables.append((shape, times, memory))
    clocks = log.summarize(timing.timeline, timing.settle_s) if log else None
    for shape, times, memory in tables:
        if memory is not None:
            print(f"linear {shape} (forward + backward)")
        print_times(times, clocks)
        if memory is not None:
            print_memory(memory)
    if args.out:
        write_json(
            args.out,
            {
                "gemm_size": args.gemm,
                "rounds": args.rounds,
                "calls_per_measurement": CALLS,
                "inputs_per_call": REPEAT,
                **{k: v for k, v in dataclasses.asdict(timing).items() if k != "ops"},
                "ops": sorted(timing.ops) if timing.ops else "all",
                "clocks": clocks,
                "results": results,
            },
        )


if __name__ == "__main__":
    main()
