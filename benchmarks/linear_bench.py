"""FP4 GEMM and the NVFP4 linear layer (forward + backward) against bf16.

    python benchmarks/linear_bench.py [--out results.json] [--hlo-dir DIR] [--rounds 3]
                                      [--pipelined] [--donate] [--ops nvfp4,...]

Rows, in one run (median of CALLS calls of a jitted function that applies
the op to REPEAT inputs, each call waited for; time per op; --pipelined: CALLS
calls dispatched back to back and waited for once, as a training loop runs;
--donate: each call donates the previous call's outputs, so that they stay at
the same addresses).
The ops of one table are timed in turns, --rounds times, and each ratio to
bf16 is taken within a round: the bf16 baseline moved up to 10% between
device sessions, and interleaving keeps such drift out of the ratios
(median, min and max over rounds; every sample is kept in --out's JSON;
--ops times only the named ops next to bf16):
  gemm bf16            jnp.dot, bf16 [S, S] x [S, S], float32 accumulation
  gemm nvfp4           jax_nvfp4.matmul from NVFP4 operands (Hopper: bf16
                       decode + bf16 GEMM)
  gemm scaled_matmul   jax.nn.scaled_dot_general with the nvfp4 config
  linear bf16          y = x @ w and its vjp with a random bf16 cotangent dy
                       (linear_step: dy is an input, as in training)
  linear nvfp4         the same through jax_nvfp4.dot (RHT, SR, 2D weights)
  linear fake-quant    the same recipe, pure JAX (implementation="reference")
  linear scaled_dot    jax.nn.scaled_dot_general nvfp4 (no FP4 backward)

Memory, per linear shape: the bytes the forward pass keeps for the backward
(the vjp closure's arrays; inputs counted for bf16, which keeps x and w) and
the peak device memory of one jitted forward+backward step as XLA's compiled
memory analysis reports it (arguments + outputs + temporaries; aliasing none).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import jax
import jax.numpy as jnp

import jax_nvfp4 as nv

REPEAT = 4
CALLS = 7


SETTLE_S = 0.5  # --settle: untimed calls of the same op before each timing
PIPELINED = False  # --pipelined: dispatch CALLS calls, then wait once
DONATE = False  # --donate: each call's outputs reuse the previous call's buffers
# (op, start, end) of every measurement in Unix seconds (settling included):
# lines up with a log of the GPU's clocks and power (bench_session.sh).
TIMELINE = []


def runner(fn, inputs, donate):
    """A call of `fn` on each of `inputs`, jitted into one computation: run()
    returns the list of outputs. With `donate` every call donates the
    previous call's outputs, so its outputs land in the same buffers (stable
    addresses, as a training step's donated state has; XLA need not update
    its CUDA graphs)."""
    if not donate:
        jitted = jax.jit(lambda xs: [fn(*x) for x in xs])
        return lambda: jitted(inputs)
    # keep_unused: an unused donated argument is otherwise pruned, and
    # nothing is aliased (checked: addresses stable with it, not without).
    jitted = jax.jit(
        lambda xs, previous: [fn(*x) for x in xs],
        donate_argnums=1,
        keep_unused=True,
    )
    outs = [jitted(inputs, None)]

    def run():
        outs[0] = jitted(inputs, outs[0])
        return outs[0]

    return run


def timer(fn, inputs):
    """A compiled, warmed-up measurement: each call returns the median over
    CALLS calls of the time per op (each call waited for), or with PIPELINED
    the time per op of CALLS calls dispatched back to back and waited for
    once, as a training loop runs (the host's dispatch overlaps the device's
    work). DONATE: see runner."""
    run = runner(fn, inputs, DONATE)
    jax.block_until_ready(run())
    if PIPELINED:  # one untimed batch: the first measured one was cold
        for _ in range(CALLS):
            last = run()
        jax.block_until_ready(last)

    def measure():
        """(seconds per op, the samples it is the median of; pipelined: [the
        time per op, the part of it the host spent dispatching]). First the
        op runs untimed for SETTLE_S seconds: the H200's clocks follow its
        power draw within milliseconds, and an op timed right after another
        would run at the clocks the other one left (a bf16 GEMM draws more
        power than one on decoded FP4 values)."""
        end = time.perf_counter() + SETTLE_S
        while time.perf_counter() < end:
            jax.block_until_ready(run())
        if PIPELINED:
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


def interleaved(timers, rounds):
    """Times every op once per round, the ops taking turns, so that a drift
    of the device (clocks, temperature, neighbours) shows in all of them
    alike. Returns {name: [(seconds per round, its samples)]}; an op whose
    timer could not be built (None) gets NaNs. With OPS, only those ops (and
    the bf16 baseline) are timed."""
    times = {name: [] for name in timers if _selected(name)}
    for _ in range(rounds):
        for name in times:
            measure = timers[name]
            start = time.time()
            times[name].append(measure() if measure else (float("nan"), []))
            TIMELINE.append((name, start, time.time()))
    return times


OPS = None  # --ops: the op names (last word: bf16, nvfp4, ...) to time


def _selected(name):
    return OPS is None or name.split()[-1] in OPS | {"bf16"}


def _ratio_summary(times, base):
    """Median time per op and the per-round ratio to `base` (min, median,
    max): the ratio of the same round is what drift cancels out of."""
    out = {}
    medians = {name: [t for t, _ in rounds] for name, rounds in times.items()}
    for name, ts in medians.items():
        ratios = [t / b for t, b in zip(ts, medians[base], strict=True)]
        out[name] = {
            "ms": statistics.median(ts) * 1e3,
            "ms_per_round": [t * 1e3 for t in ts],
            # every sample of every round (per op; diagnoses bimodal timings)
            "samples_ms": [[s * 1e3 for s in samples] for _, samples in times[name]],
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    return out


def _scaled_dot(x, w):
    configs = [jax.nn.get_scaled_dot_general_config("nvfp4")] * 3
    return jax.nn.scaled_dot_general(
        x,
        w,
        (((x.ndim - 1,), (0,)), ((), ())),
        preferred_element_type=x.dtype,
        configs=configs,
    )


def _try(fn, fallback=float("nan")):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- an optional baseline
        print("skipped:", type(e).__name__, str(e)[:200])
        return fallback


def gemm_operands(s, repeat=REPEAT):
    """`repeat` pairs of bf16 [s, s] operands and their NVFP4 forms (a along
    K, b 2D along its K axis 0)."""
    keys = jax.random.split(jax.random.key(0), 2 * repeat)
    pairs = [
        (
            jax.random.normal(keys[2 * i], (s, s), jnp.bfloat16),
            jax.random.normal(keys[2 * i + 1], (s, s), jnp.bfloat16),
        )
        for i in range(repeat)
    ]
    quantized = [(nv.quantize(a), nv.quantize(b, 0, block="16x16")) for a, b in pairs]
    return pairs, quantized


def bench_gemm(s, rounds, hlo_dir=None):
    pairs, quantized = gemm_operands(s)
    if hlo_dir:
        text = jax.jit(nv.matmul).lower(*quantized[0]).compile().as_text()
        with open(f"{hlo_dir}/gemm_nvfp4_{s}.hlo.txt", "w") as f:
            f.write(text)
    builders = {
        "gemm bf16": lambda: timer(jnp.dot, pairs),
        "gemm nvfp4": lambda: timer(nv.matmul, quantized),
        "gemm scaled_matmul": lambda: _try(lambda: timer(_scaled_dot, pairs), None),
    }
    timers = {name: build() for name, build in builders.items() if _selected(name)}
    return _ratio_summary(interleaved(timers, rounds), "gemm bf16")


def _residual_bytes(dot, x, w):
    _, vjp_fn = jax.vjp(dot, x, w)
    return sum(leaf.nbytes for leaf in jax.tree.leaves(vjp_fn))


def _step_peak_bytes(step, *args):
    m = jax.jit(step).lower(*args).compile().memory_analysis()
    if m is None:
        return float("nan")
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def linear_step(dot):
    """y = dot(x, w) and its vjp with the cotangent dy: (y, dx, dw). dy is
    an input, as in training, where it comes from the next layer (a loss
    such as sum(y) would make dy a constant that bf16's GEMMs fuse and a
    quantizing backward has to materialize)."""

    def f(x, w, dy):
        y, vjp = jax.vjp(dot, x, w)
        return (y, *vjp(dy))

    return f


def bench_linear(tokens, k, n, rounds, hlo_dir=None):
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (tokens, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.bfloat16) * 0.02
    key = keys[2]
    dy = jax.random.normal(jax.random.key(2), (tokens, n), jnp.bfloat16)
    inputs = [(x, w, dy)] * REPEAT
    step = linear_step

    fake = nv.Recipe(implementation="reference")
    dots = {
        "bf16": jnp.dot,
        "nvfp4": lambda x, w: nv.dot(x, w, key=key),
        "fake-quant": lambda x, w: nv.dot(x, w, key=key, recipe=fake),
        "scaled_dot": _scaled_dot,
    }
    dots = {name: d for name, d in dots.items() if _selected(name)}
    timers = {
        f"linear {name}": _try(lambda d=d: timer(step(d), inputs), None)
        for name, d in dots.items()
    }
    times = _ratio_summary(interleaved(timers, rounds), "linear bf16")
    memory = {
        name: {
            "residual_bytes": _try(lambda d=d: _residual_bytes(d, x, w)),
            "step_peak_bytes": _try(lambda d=d: _step_peak_bytes(step(d), x, w, dy)),
        }
        for name, d in dots.items()
    }
    if hlo_dir:
        for name in ("bf16", "nvfp4"):
            text = jax.jit(step(dots[name])).lower(x, w, dy).compile().as_text()
            with open(f"{hlo_dir}/linear_{name}_{tokens}x{k}x{n}.hlo.txt", "w") as f:
                f.write(text)
    return times, memory


def _print_times(summary):
    print(f"{'op':>22} {'ms':>8} {'vs bf16':>8} {'(min..max over rounds)':>24}")
    for name, r in summary.items():
        print(
            f"{name:>22} {r['ms']:8.3f} {r['ratio_median']:8.2f}"
            f"   ({r['ratio_min']:.2f}..{r['ratio_max']:.2f})"
        )


def main():
    global PIPELINED, OPS, DONATE, SETTLE_S
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--hlo-dir", default=None, help="write compiled HLO here")
    parser.add_argument("--gemm", type=int, default=8192)
    parser.add_argument(
        "--linear",
        default="8192x4096x14336,16384x8192x28672",
        help="comma-separated TOKENSxKxN shapes",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="each op is timed once per round, the ops taking turns; ratios "
        "are taken within a round (median, min and max are reported)",
    )
    parser.add_argument(
        "--ops",
        help="comma-separated ops to time besides bf16 (nvfp4, scaled_matmul, "
        "fake-quant, scaled_dot); default all",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=SETTLE_S,
        help="seconds each op runs untimed before it is timed (clocks settle "
        "at the op's own power draw)",
    )
    parser.add_argument(
        "--donate",
        action="store_true",
        help="each call donates the previous call's outputs (stable output addresses)",
    )
    parser.add_argument(
        "--pipelined",
        action="store_true",
        help="time calls dispatched back to back, waited for once (as a "
        "training loop runs), instead of waiting for each call",
    )
    args = parser.parse_args()
    PIPELINED, DONATE, SETTLE_S = args.pipelined, args.donate, args.settle
    OPS = set(args.ops.split(",")) if args.ops else None
    print(
        f"device: {jax.devices()[0].device_kind} | jax {jax.__version__} | "
        f"{'pipelined' if PIPELINED else 'each call waited for'}"
    )
    results = {"gemm": bench_gemm(args.gemm, args.rounds, args.hlo_dir), "linear": {}}
    _print_times(results["gemm"])
    for shape in args.linear.split(","):
        times, memory = bench_linear(
            *map(int, shape.split("x")), args.rounds, args.hlo_dir
        )
        results["linear"][shape] = {"times": times, "memory_bytes": memory}
        print(f"linear {shape} (forward + backward)")
        _print_times(times)
        print(f"{'':>22} {'residual MB':>12} {'vs bf16':>8} {'step peak MB':>13}")
        for name, m in memory.items():
            r, p = m["residual_bytes"], m["step_peak_bytes"]
            ratio = r / memory["bf16"]["residual_bytes"]
            print(f"{name:>22} {r / 2**20:12.1f} {ratio:8.3f} {p / 2**20:13.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "date": datetime.date.today().isoformat(),
                    "device": jax.devices()[0].device_kind,
                    "jax": jax.__version__,
                    "gemm_size": args.gemm,
                    "rounds": args.rounds,
                    "calls_per_measurement": CALLS,
                    "pipelined": PIPELINED,
                    "donate": DONATE,
                    "settle_s": SETTLE_S,
                    "timeline": TIMELINE,
                    "ops": sorted(OPS) if OPS else "all",
                    "results": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
