"""Why the wall clock exceeds the GPU's busy time: one configuration per run.

    XLA_FLAGS=... JAX_NVFP4_GEMM_GRAPHS=0|1 python benchmarks/wall_gap.py \
        [--label NAME] [--out results.json] [--rounds 3]

Times bf16 and jax_nvfp4 (the GEMM alone at 8192^3 from NVFP4 operands; the
linear forward + backward at 8192 x 4096 -> 14336, linear_bench's step) in
four ways within one process, so that a configuration (XLA's CUDA graphs on
or off, the trace cache, our GEMM inside graphs or not) can be compared with
another run's:
  waited      each call of REPEAT ops waited for (linear_bench's default)
  pipelined   CALLS calls dispatched back to back, waited for once; also the
              host's dispatch time per op
  donated     as waited, each call donating the previous call's outputs
              (stable output addresses: XLA need not update its graphs)
  donated+pipelined
The ratio nvfp4 / bf16 is taken within a round (median over rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
from linear_bench import REPEAT, gemm_operands, linear_step, runner

import jax_nvfp4 as nv

CALLS = 7


def builder(fn, inputs, donate):
    run = runner(fn, inputs, donate)
    jax.block_until_ready(run())
    for _ in range(CALLS):  # warm: clocks and graphs as in a training loop
        last = run()
    jax.block_until_ready(last)

    def waited():
        samples = []
        for _ in range(CALLS):
            start = time.perf_counter()
            jax.block_until_ready(run())
            samples.append((time.perf_counter() - start) / len(inputs))
        return statistics.median(samples), None

    def pipelined():
        start = time.perf_counter()
        for _ in range(CALLS):
            last = run()
        dispatched = time.perf_counter()
        jax.block_until_ready(last)
        ops = CALLS * len(inputs)
        return (time.perf_counter() - start) / ops, (dispatched - start) / ops

    return waited, pipelined


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gemm", type=int, default=8192)
    parser.add_argument("--linear", default="8192x4096x14336")
    parser.add_argument("--out")
    args = parser.parse_args()
    tokens, k, n = map(int, args.linear.split("x"))
    print(
        f"[{args.label}] XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} "
        f"JAX_NVFP4_GEMM_GRAPHS={os.environ.get('JAX_NVFP4_GEMM_GRAPHS', '')!r}"
    )
    pairs, quantized = gemm_operands(args.gemm)
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (tokens, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.bfloat16) * 0.02
    dy = jax.random.normal(jax.random.key(2), (tokens, n), jnp.bfloat16)
    linear_inputs = [(x, w, dy)] * REPEAT
    ops = {
        "gemm bf16": (jnp.dot, pairs),
        "gemm nvfp4": (nv.matmul, quantized),
        "linear bf16": (linear_step(jnp.dot), linear_inputs),
        "linear nvfp4": (
            linear_step(lambda x, w: nv.dot(x, w, key=keys[2])),
            linear_inputs,
        ),
    }
    measures = {}
    for name, (fn, inputs) in ops.items():
        for donate in (False, True):
            waited, pipelined = builder(fn, inputs, donate)
            mode = "donated" if donate else "plain"
            measures[(name, f"{mode} waited")] = waited
            measures[(name, f"{mode} pipelined")] = pipelined
    samples = {key: [] for key in measures}
    for _ in range(args.rounds):
        for key, measure in measures.items():
            samples[key].append(measure())
    result = {"label": args.label, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    print(f"{'op':>14} {'mode':>20} {'ms':>8} {'dispatch ms':>12} {'vs bf16':>8}")
    for (name, mode), rounds in samples.items():
        base = samples[(name.split()[0] + " bf16", mode)]
        ratios = [t / b for (t, _), (b, _) in zip(rounds, base, strict=True)]
        ms = statistics.median(t for t, _ in rounds) * 1e3
        dispatch = [d for _, d in rounds if d is not None]
        d_ms = statistics.median(dispatch) * 1e3 if dispatch else float("nan")
        ratio = statistics.median(ratios)
        print(f"{name:>14} {mode:>20} {ms:8.3f} {d_ms:12.3f} {ratio:8.3f}")
        result[f"{name} | {mode}"] = {
            "ms": ms,
            "dispatch_ms": d_ms,
            "ratio": ratio,
            "rounds_ms": [t * 1e3 for t, _ in rounds],
        }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
