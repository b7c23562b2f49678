"""FP4 GEMM and the NVFP4 linear layer (forward + backward) against bf16.

    python benchmarks/linear_bench.py [--out results.json]

Rows, in one run (median of several calls of a jitted function that applies
the op to REPEAT distinct inputs; time per op):
  gemm bf16            jnp.dot, bf16 [S, S] x [S, S], float32 accumulation
  gemm nvfp4           jax_nvfp4.matmul from NVFP4 operands (Hopper: bf16
                       decode + bf16 GEMM)
  gemm scaled_matmul   jax.nn.scaled_dot_general with the nvfp4 config
  linear bf16          value_and_grad of sum(x @ w) w.r.t. x and w
  linear nvfp4         the same through jax_nvfp4.dot (RHT, SR, 2D weights)
  linear fake-quant    the same recipe, pure JAX (implementation="reference")
  linear scaled_dot    jax.nn.scaled_dot_general nvfp4 (no FP4 backward)
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


def timed(fn, inputs):
    run = jax.jit(lambda xs: [fn(*x) for x in xs])
    jax.block_until_ready(run(inputs))
    samples = []
    for _ in range(CALLS):
        start = time.perf_counter()
        jax.block_until_ready(run(inputs))
        samples.append((time.perf_counter() - start) / len(inputs))
    return statistics.median(samples)


def _scaled_dot(x, w):
    configs = [jax.nn.get_scaled_dot_general_config("nvfp4")] * 3
    return jax.nn.scaled_dot_general(
        x, w, (((x.ndim - 1,), (0,)), ((), ())), configs=configs
    )


def _try(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- an optional baseline
        print("skipped:", type(e).__name__, str(e)[:200])
        return float("nan")


def bench_gemm(s):
    keys = jax.random.split(jax.random.key(0), 2 * REPEAT)
    pairs = [
        (
            jax.random.normal(keys[2 * i], (s, s), jnp.bfloat16),
            jax.random.normal(keys[2 * i + 1], (s, s), jnp.bfloat16),
        )
        for i in range(REPEAT)
    ]
    quantized = [(nv.quantize(a), nv.quantize(b, 0, block="16x16")) for a, b in pairs]
    return {
        "gemm bf16": timed(jnp.dot, pairs),
        "gemm nvfp4": timed(nv.matmul, quantized),
        "gemm scaled_matmul": _try(lambda: timed(_scaled_dot, pairs)),
    }


def bench_linear(tokens, k, n):
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (tokens, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.bfloat16) * 0.02
    key = keys[2]
    inputs = [(x, w)] * REPEAT

    def step(dot):
        def f(x, w):
            return jnp.sum(dot(x, w).astype(jnp.float32))

        return jax.value_and_grad(f, argnums=(0, 1))

    fake = nv.Recipe(implementation="reference")
    return {
        "linear bf16": timed(step(jnp.dot), inputs),
        "linear nvfp4": timed(step(lambda x, w: nv.dot(x, w, key=key)), inputs),
        "linear fake-quant": timed(
            step(lambda x, w: nv.dot(x, w, key=key, recipe=fake)), inputs
        ),
        "linear scaled_dot": _try(lambda: timed(step(_scaled_dot), inputs)),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--gemm", type=int, default=8192)
    parser.add_argument("--linear", default="8192x4096x14336")
    args = parser.parse_args()
    rows = {}
    rows.update(bench_gemm(args.gemm))
    rows.update(bench_linear(*map(int, args.linear.split("x"))))
    print(f"device: {jax.devices()[0].device_kind} | jax {jax.__version__}")
    print(f"{'op':>22} {'ms':>8} {'vs bf16':>8}")
    for name, t in rows.items():
        base = rows["gemm bf16"] if name.startswith("gemm") else rows["linear bf16"]
        print(f"{name:>22} {t * 1e3:8.3f} {t / base:8.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "date": datetime.date.today().isoformat(),
                    "device": jax.devices()[0].device_kind,
                    "gemm": args.gemm,
                    "linear": args.linear,
                    "ms": {k: v * 1e3 for k, v in rows.items()},
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
