"""Where one linear forward+backward step spends its time, kernel by kernel
(there is no nsys on the device; ncu with a profiled range crashed there).

    python benchmarks/step_profile.py [--linear 8192x4096x14336] [--gemm 8192]
                                      [--out f.json]

Each step (linear_bench.linear_step: y = x @ w and its vjp with a random
cotangent; bf16 jnp.dot, jax_nvfp4.dot with the full recipe) is compiled
and run twice, then traced once with jax.profiler (CUPTI); the trace's
device planes are read back with jax.profiler.ProfileData. Printed per
step and per device line (the streams, and XLA's op lines): the total time
of the line's events and the events grouped by name, largest first.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
from linear_bench import gemm_operands, linear_step

import jax_nvfp4 as nv

HOST = False  # --host: the host planes too (where each launch's host time goes)


CALLS = 1  # --calls C: trace C calls dispatched back to back (no wait between)


def trace_events(fn, *args, warmup=2):
    """{(plane, line): [(event name, duration ns, start ns)]} of CALLS traced
    calls (dispatched back to back, waited for once) after `warmup` untraced
    ones; the device planes, and with HOST the host's lines too (XLA's thunk
    executions, the custom calls' handlers)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as directory:
        jax.profiler.start_trace(directory)
        jax.block_until_ready([fn(*args) for _ in range(CALLS)])
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    lines = {}
    for plane in data.planes:
        if "host" in plane.name.lower() and not HOST:
            continue
        for line in plane.lines:
            events = [
                (e.name, float(e.duration_ns), float(e.start_ns)) for e in line.events
            ]
            if events:
                lines[f"{plane.name} | {line.name}"] = events
    return lines


def summarize(lines, top=25):
    out = {}
    for line, events in lines.items():
        by_name = collections.defaultdict(lambda: [0, 0.0])
        for name, ns, _ in events:
            by_name[name][0] += 1
            by_name[name][1] += ns
        total = sum(ns for _, ns, _ in events)
        # First start to last end: the busy time plus the idle gaps between
        # kernels (launch latency, host work of custom calls).
        span = max(t + ns for _, ns, t in events) - min(t for _, _, t in events)
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
        # The idle gaps (where the line waits for a launch): the time from
        # the latest end so far to the next start, largest first, each named
        # by the event after it (overlapping events leave no gap).
        gaps, end = [], None
        for name, ns, t in sorted(events, key=lambda e: e[2]):
            if end is not None and t > end:
                gaps.append((t - end, name))
            end = t + ns if end is None else max(end, t + ns)
        gaps.sort(reverse=True)
        out[line] = {
            "total_us": total / 1e3,
            "span_us": span / 1e3,
            "events": len(events),
            "by_name_us": [(n, c, ns / 1e3) for n, (c, ns) in ranked],
            "largest_gaps_us": [(ns / 1e3, n) for ns, n in gaps[:10]],
        }
        print(
            f"  {line}: {len(events)} events, {total / 1e3:,.1f} us busy, "
            f"{span / 1e3:,.1f} us first start to last end, "
            f"{sum(g for g, _ in gaps) / 1e3:,.1f} us in gaps"
        )
        for name, (count, ns) in ranked[:top]:
            print(f"    {ns / 1e3:10,.1f} us  x{count:<3} {name[:100]}")
        for ns, name in gaps[:5]:
            print(f"    gap {ns / 1e3:8,.1f} us before {name[:90]}")
    return out


def trace_gemm(s, out=None, repeat=1):
    """The GEMM alone; repeat > 1: as linear_bench times it, `repeat` GEMMs
    on their own operands in one jitted call, traced after 20 back-to-back
    calls (sustained load: clocks as the benchmark sees them)."""
    pairs, quantized = gemm_operands(s, repeat)
    result = {"gemm": s, "repeat": repeat, "device": str(jax.devices()[0])}
    for name, op, inputs in (
        ("bf16", jnp.dot, pairs),
        ("nvfp4", nv.matmul, quantized),
    ):
        fn = jax.jit(lambda xs, op=op: [op(*x) for x in xs])
        print(f"{name} GEMM {s}^3 x {repeat}:")
        warmup = 20 if repeat > 1 else 2
        result[name] = summarize(trace_events(fn, inputs, warmup=warmup))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--linear", default="8192x4096x14336")
    parser.add_argument(
        "--gemm",
        type=int,
        help="trace the GEMM alone at S^3 (bf16 jnp.dot vs jax_nvfp4.matmul "
        "from NVFP4 operands, as linear_bench's) instead of the linear step",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="GEMMs (or linear steps) per call"
    )
    parser.add_argument(
        "--calls",
        type=int,
        default=1,
        help="trace this many calls dispatched back to back (the gaps between "
        "calls show in the largest gaps)",
    )
    parser.add_argument(
        "--graphs-in-trace",
        action="store_true",
        help="keep XLA's CUDA graphs while tracing (XLA runs the thunks one by "
        "one under a profiler unless told otherwise)",
    )
    parser.add_argument(
        "--host",
        action="store_true",
        help="also summarize the host's trace lines (time spent launching)",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.graphs_in_trace:  # before the backend starts (XLA reads it then)
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + " --xla_enable_command_buffers_during_profiling=true"
        ).strip()
    global HOST, CALLS
    HOST, CALLS = args.host, args.calls
    if args.gemm:
        return trace_gemm(args.gemm, args.out, args.repeat)
    tokens, k, n = map(int, args.linear.split("x"))
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (tokens, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.bfloat16) * 0.02

    dy = jax.random.normal(jax.random.key(2), (tokens, n), jnp.bfloat16)

    # repeat > 1: as linear_bench times it, `repeat` steps in one jitted
    # call, traced after 20 back-to-back calls.
    inputs = [(x, w, dy)] * args.repeat

    def step(dot):
        f = linear_step(dot)
        return jax.jit(lambda xs: [f(*a) for a in xs])

    steps = {
        "bf16": step(jnp.dot),
        "nvfp4": step(lambda x, w: nv.dot(x, w, key=keys[2])),
    }
    result = {
        "shape": args.linear,
        "repeat": args.repeat,
        "calls": args.calls,
        "device": str(jax.devices()[0]),
    }
    warmup = 20 if args.repeat > 1 else 2
    for name, fn in steps.items():
        print(f"{name} step, {args.linear} x {args.repeat}:")
        result[name] = summarize(trace_events(fn, inputs, warmup=warmup))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
