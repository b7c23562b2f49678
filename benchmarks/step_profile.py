"""One linear forward+backward step per recipe, for Nsight Compute: where
the step's time goes, kernel by kernel (there is no nsys on the device).

    ncu --clock-control none --profile-from-start off \
        --metrics gpu__time_duration.sum --csv \
        python benchmarks/step_profile.py --linear 8192x4096x14336 > step.csv
    python benchmarks/step_profile.py --summarize step.csv

The step is compiled and run once outside the profiled range (XLA's
autotuning launches many candidate kernels); then cudaProfilerStart, one
step of bf16, one small jax_nvfp4.dequantize (the marker between the
two: bf16's step launches no jax_nvfp4 kernel), one step of jax_nvfp4, and
cudaProfilerStop. `--summarize` adds up the kernel times of each step by
kernel name.
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import io
import sys


def _cudart():
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    import glob

    import nvidia  # noqa: F401  (pip's CUDA runtime, if installed)

    for path in glob.glob(f"{nvidia.__path__[0]}/*/lib/libcudart.so*"):
        return ctypes.CDLL(path)
    raise RuntimeError("libcudart not found: cannot call cudaProfilerStart")


def run(shape):
    import jax
    import jax.numpy as jnp

    import jax_nvfp4 as nv

    tokens, k, n = map(int, shape.split("x"))
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (tokens, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.bfloat16) * 0.02

    def step(dot):
        def f(x, w):
            return jnp.sum(dot(x, w).astype(jnp.float32))

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    steps = {
        "bf16": step(jnp.dot),
        "nvfp4": step(lambda x, w: nv.dot(x, w, key=keys[2])),
    }
    for fn in steps.values():
        jax.block_until_ready(fn(x, w))
        jax.block_until_ready(fn(x, w))
    tiny = nv.quantize(jnp.ones((16, 16), jnp.float32))
    marker = jax.jit(nv.dequantize)
    jax.block_until_ready(marker(tiny))
    cudart = _cudart()
    cudart.cudaProfilerStart()
    jax.block_until_ready(steps["bf16"](x, w))
    jax.block_until_ready(marker(tiny))
    jax.block_until_ready(steps["nvfp4"](x, w))
    cudart.cudaProfilerStop()
    print("profiled:", ", ".join(steps))


def summarize(path):
    """Per step (launches in program order: bf16's kernels, the marker,
    jax_nvfp4's), total time and time per kernel name."""
    text = open(path).read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    kernels = [
        (r["Kernel Name"], float(r["Metric Value"].replace(",", "")))
        for r in rows
        if r.get("Metric Name") == "gpu__time_duration.sum"
    ]
    unit = next(
        (
            r["Metric Unit"]
            for r in rows
            if r.get("Metric Name") == "gpu__time_duration.sum"
        ),
        "",
    )
    marker = next(
        (i for i, (name, _) in enumerate(kernels) if "Dequantize" in name),
        len(kernels),
    )
    print(f"{len(kernels)} kernels; times in {unit}")
    for label, part in (
        ("bf16", kernels[:marker]),
        ("jax_nvfp4", kernels[marker + 1 :]),
    ):
        total = sum(t for _, t in part)
        print(f"\n{label}: {len(part)} kernels, total {total:,.0f} {unit}")
        by_name = collections.OrderedDict()
        for name, t in part:
            short = name.split("(")[0][:90]
            count, acc = by_name.get(short, (0, 0.0))
            by_name[short] = (count + 1, acc + t)
        for short, (count, acc) in by_name.items():
            print(f"  {acc:12,.0f}  x{count:<3} {short}")
        print("  in order:")
        for name, t in part:
            print(f"  {t:12,.0f}  {name.split('(')[0][:90]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--linear", default="8192x4096x14336")
    parser.add_argument("--summarize", metavar="CSV")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
    else:
        run(args.linear)
    return 0


if __name__ == "__main__":
    sys.exit(main())
