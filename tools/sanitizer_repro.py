"""compute-sanitizer's crash with XLA's parallel GPU compilation, without
jax_nvfp4: one jitted function of many independent fusions, which XLA
compiles on several threads (the LLVM module split, kernels loaded as they
finish).

    compute-sanitizer --tool memcheck python3 tools/sanitizer_repro.py
    XLA_FLAGS=--xla_gpu_force_compilation_parallelism=1 \\
      compute-sanitizer --tool memcheck python3 tools/sanitizer_repro.py

Under the sanitizer, the first can end with the sanitizer's own process
killed by SIGSEGV (exit status 139, no report, nothing from Python's
faulthandler: the program under test did not crash); the second, one
compilation thread, runs clean. tools/gpu_check.sh --sanitizer therefore
compiles on one thread.
"""

import argparse

import jax
import jax.numpy as jnp


def many_fusions(xs):
    """Independent chains of different shapes and ops: one kernel each."""
    outs = []
    for i, x in enumerate(xs):
        y = jnp.sin(x * (i + 1)) + jnp.exp(-x * x)
        outs.append(jnp.sum(y, axis=i % 2) if i % 3 else jnp.cumsum(y, axis=0)[-1])
    return outs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    print("devices:", jax.devices())
    for r in range(args.rounds):
        xs = [
            jnp.full((64 + 8 * i + r, 48 + 16 * (i % 5)), 0.01 * i, jnp.float32)
            for i in range(args.chains)
        ]
        jax.block_until_ready(jax.jit(many_fusions)(xs))
    print("sanitizer repro: ran", args.rounds, "rounds of", args.chains, "fusions")


if __name__ == "__main__":
    main()
