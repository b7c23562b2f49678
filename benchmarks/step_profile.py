"""Trace one linear forward + backward step (or the GEMM alone) and list its kernels.

    python benchmarks/step_profile.py                          # 8192x4096x14336
    python benchmarks/step_profile.py --repeat 4 --calls 3     # sustained, as timed
    python benchmarks/step_profile.py --gemm 8192 --out gemm.json

Each step (common.linear_step: y = x @ w and its vjp with a random cotangent;
bf16 jnp.dot against jax_nvfp4.dot with the full recipe) is compiled, run
untraced, then traced with jax.profiler (CUPTI: no Nsight Systems needed);
the trace's device planes are read back with jax.profiler.ProfileData.
Printed per step and per device line (the streams, and XLA's op lines): the
busy time of the line, its span from first start to last end, the idle gaps
between kernels, and the events grouped by name, largest first. This is where
a step's time goes kernel by kernel (GEMMs, quantize, decode, amax passes).
"""

from __future__ import annotations

import collections
import glob
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
from common import (
    argument_parser,
    gemm_operands,
    header,
    linear_operands,
    linear_step,
    parse_shape,
    write_json,
)

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
    result = {"gemm": s, "repeat": repeat}
    warmup = 20 if repeat > 1 else 2
    for name, op, inputs in (
        ("bf16", jnp.dot, pairs),
        ("nvfp4", nv.matmul, quantized),
    ):
        fn = jax.jit(lambda xs, op=op: [op(*x) for x in xs])
        print(f"{name} GEMM {s}^3 x {repeat}:")
        result[name] = summarize(trace_events(fn, inputs, warmup=warmup))
    if out:
        write_json(out, result)
    return 0


def trace_linear(shape, out=None, repeat=1):
    """The linear step, bf16 and jax_nvfp4; repeat > 1: `repeat` steps in one
    jitted call, traced after 20 back-to-back calls."""
    tokens, k, n = parse_shape(shape)
    operands, key = linear_operands(tokens, k, n)
    inputs = [operands] * repeat

    def step(dot):
        f = linear_step(dot)
        return jax.jit(lambda xs: [f(*a) for a in xs])

    steps = {
        "bf16": step(jnp.dot),
        "nvfp4": step(lambda x, w: nv.dot(x, w, key=key)),
    }
    result = {"shape": shape, "repeat": repeat, "calls": CALLS}
    warmup = 20 if repeat > 1 else 2
    for name, fn in steps.items():
        print(f"{name} step, {shape} x {repeat}:")
        result[name] = summarize(trace_events(fn, inputs, warmup=warmup))
    if out:
        write_json(out, result)
    return 0


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument(
        "--linear", default="8192x4096x14336", help="TOKENSxKxN of the linear step"
    )
    parser.add_argument(
        "--gemm",
        type=int,
        help="trace the GEMM alone at S^3 (bf16 jnp.dot vs jax_nvfp4.matmul "
        "from NVFP4 operands) instead of the linear step",
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
        help="keep XLA's CUDA graphs while tracing (under a profiler XLA runs "
        "the thunks one by one unless told otherwise)",
    )
    parser.add_argument(
        "--host",
        action="store_true",
        help="also summarize the host's trace lines (time spent launching)",
    )
    parser.add_argument("--out", help="write the summaries as JSON")
    args = parser.parse_args(argv)
    if args.graphs_in_trace:  # before the backend starts (XLA reads it then)
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + " --xla_enable_command_buffers_during_profiling=true"
        ).strip()
    global HOST, CALLS
    HOST, CALLS = args.host, args.calls
    print(header())
    if args.gemm:
        return trace_gemm(args.gemm, args.out, args.repeat)
    return trace_linear(args.linear, args.out, args.repeat)


if __name__ == "__main__":
    sys.exit(main())
