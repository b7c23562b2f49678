"""One launch of each fused-quantize kernel configuration, for Nsight Compute:

    ncu --clock-control none -k regex:Quantize --metrics \
        gpu__time_duration.sum,smsp__inst_executed.sum \
        python benchmarks/quantize_profile.py [--shape 8192x4096]

Where the idle issue slots go (the v4 kernel issues in 63% of cycles; not
profiled yet): add `--section WarpStateStats --section SchedulerStats
--section Occupancy --section InstructionStats` to the same command.

Amaxes are passed in, so the custom call of the fused quantize is the only
quantize kernel launched per configuration: x (columns RHT, nearest) and
dY (columns RHT, stochastic), bf16.
"""

import argparse

import jax
import jax.numpy as jnp

import jax_nvfp4 as nv


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="8192x4096")
    m, k = map(int, parser.parse_args().shape.split("x"))
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    amaxes = dict(
        row_amax=nv.global_amax(x), col_amax=nv.global_amax(x, axis=0, rht=True)
    )
    key = jax.random.key(1)
    for name, options in (
        ("x", dict(col_rht=True)),
        ("dy", dict(col_rht=True, col_rounding="stochastic", key=key)),
    ):
        fn = jax.jit(
            lambda x, o=options: nv.quantize_rowwise_and_columnwise(x, **o, **amaxes)
        )
        jax.block_until_ready(fn(x))
        print(name, "done")


if __name__ == "__main__":
    main()
