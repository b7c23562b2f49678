"""Where a training step's HBM bytes go, counted in the program XLA compiles
for an H200, with or without one.

    python benchmarks/compiled_step.py --sizes d2048-32k
    python benchmarks/compiled_step.py --sizes d2048-8k --hlo-dir /tmp/hlo
    JAX_PLATFORMS=cpu python benchmarks/compiled_step.py   # no GPU here

The step is model_step.py's (the same models, sizes, precisions and
remat policies). It is compiled for the GPU attached or, on a machine
without one, ahead of time for the H200 that h200_target.pbtxt describes
(XLA's GPU compiler through the CUDA PJRT plugin: ``pip install
jax-cuda13-plugin jax-cuda13-pjrt`` at jax's version, and jax_nvfp4 built
with its CUDA handlers, as ``pip install .`` does where nvcc is found).
Every kernel of the compiled program is counted (hlo_bytes.py): per family,
the kernels launched and the GiB read and written per step, then what each
precision adds to bf16's step and what those bytes cost at --bandwidth; and
the step's peak memory as XLA's buffer assignment puts it (arguments,
outputs not aliased to them, the temporaries' peak).

A count, not a measurement (hlo_bytes.py says what it leaves out). Compiled
without a GPU: attention is XLA's (cuDNN picks its kernels on the GPU
itself), so attention's rows are not the GPU's, the same in every precision;
the GEMM operand form is set to "decoded", the choice an H200 makes. XLA's
attention also keeps other residuals than cuDNN's, so the peaks are not the
GPU's; their differences across precisions are the comparable part.
"""

from __future__ import annotations

import collections
import os
import re

import jax
import model_step
from common import argument_parser, write_json
from hlo_bytes import kernels

from jax_nvfp4 import config

TARGET_CONFIG = os.path.join(os.path.dirname(__file__), "h200_target.pbtxt")

# Kernel families, matched in order on a custom call's target or a fusion's
# name and kind ("name kind").
FAMILIES = (
    ("nvfp4 quantize", r"jax_nvfp4_quantize"),
    ("nvfp4 amax", r"jax_nvfp4_(amax|abs_max)"),
    ("nvfp4 decode", r"jax_nvfp4_(decode|dequantize)"),
    ("GEMM", r"jax_nvfp4_(matmul|grouped|ragged)|cublas|gemm|kCustom"),
    ("attention", r"cudnn|fmha|attention"),
    ("XLA transpose", r"transpose"),
    ("XLA reduce", r"reduce|kInput"),
    ("copy", r"^copy"),
)


def family(kernel) -> str:
    text = f"{kernel.name} {kernel.target}"
    for label, pattern in FAMILIES:
        if re.search(pattern, text):
            return label
    return "XLA elementwise"


def compile_devices():
    """(devices, "attached" or "ahead of time"): the GPUs here, else an
    H200 topology for ahead-of-time compilation."""
    if jax.default_backend() == "gpu":
        return jax.devices()[:1], "attached"
    from jax.experimental import topologies

    with open(TARGET_CONFIG) as f:
        target = f.read()
    try:
        topology = topologies.get_topology_desc(
            "h200", "cuda", target_config=target, topology="1x1x1"
        )
    except Exception as e:  # no CUDA PJRT plugin
        raise SystemExit(
            "no GPU here, and compiling for one needs the CUDA PJRT plugin "
            "(pip install jax-cuda13-plugin jax-cuda13-pjrt at jax's version), "
            f"with JAX_PLATFORMS=cpu on a machine without a GPU ({e})"
        ) from e
    return topology.devices[:1], "ahead of time"


def compile_step(size, precision, remat, framework, device, evaluate):
    """(HLO text, XLA's peak-memory estimate in GiB) of the compiled step."""
    step, state, tokens = model_step.build_step(
        size, precision, remat, framework, evaluate
    )
    sharding = jax.sharding.SingleDeviceSharding(device)

    def abstract(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    lowered = step.lower(jax.tree.map(abstract, state), abstract(tokens))
    compiled = lowered.compile()
    return compiled.as_text(), peak_gib(compiled.memory_analysis())


def peak_gib(memory) -> float | None:
    """XLA's buffer assignment: arguments, outputs not aliased to them, and
    the temporaries' peak."""
    if memory is None:
        return None
    live = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )
    return live / 2**30


def ledger(text: str) -> dict[str, dict[str, float]]:
    """{family: {"kernels": launches per step, "gib": GiB per step}}."""
    out = collections.defaultdict(lambda: {"kernels": 0, "gib": 0.0})
    for kernel in kernels(text):
        row = out[family(kernel)]
        row["kernels"] += kernel.trips
        row["gib"] += kernel.bytes * kernel.trips / 2**30
    return dict(out)


def print_table(size, results, bandwidth):
    precisions = list(results)
    families = {p: results[p]["families"] for p in precisions}
    names = sorted(
        {f for r in families.values() for f in r},
        key=lambda f: -max(r.get(f, {"gib": 0})["gib"] for r in families.values()),
    )
    print(f"\n{size}: kernels launched / GiB moved per step")
    print(f"{'family':18s}" + "".join(f"{p:>22s}" for p in precisions))
    for name in names + ["total"]:
        cells = []
        for p in precisions:
            rows = families[p].values() if name == "total" else [families[p].get(name)]
            rows = [r for r in rows if r]
            n, gib = sum(r["kernels"] for r in rows), sum(r["gib"] for r in rows)
            cells.append(f"{n:9d} / {gib:9.2f}")
        print(f"{name:18s}" + "".join(f"{c:>22s}" for c in cells))
    peaks = [results[p]["peak_gib"] for p in precisions]
    shown = ["n/a" if v is None else f"{v:.2f} GiB" for v in peaks]
    print(f"{'peak memory':18s}" + "".join(f"{c:>22s}" for c in shown))
    base = sum(r["gib"] for r in families["bf16"].values())
    for p, peak in zip(precisions[1:], peaks[1:], strict=True):
        extra = sum(r["gib"] for r in families[p].values()) - base
        memory = f"; peak memory {peak / peaks[0]:.2f}x" if peak and peaks[0] else ""
        print(
            f"{p}: {extra:+.2f} GiB per step against bf16, "
            f"{extra * 2**30 / (bandwidth * 1e12) * 1e3:+.2f} ms at "
            f"{bandwidth:g} TB/s{memory}"
        )


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--sizes", default="d2048-8k,d2048-32k,d4096-8k")
    parser.add_argument("--framework", default="flax", choices=model_step.FRAMEWORKS)
    parser.add_argument("--precisions", default=",".join(model_step.PRECISIONS))
    parser.add_argument(
        "--remat", default="none", choices=model_step.llama_flax.REMAT_POLICIES
    )
    parser.add_argument(
        "--eval", action="store_true", help="the loss alone: an evaluation step"
    )
    parser.add_argument("--bandwidth", type=float, default=4.0, help="TB/s")
    parser.add_argument("--hlo-dir", help="write each compiled program here")
    parser.add_argument("--out", help="write the ledgers as JSON here")
    args = parser.parse_args(argv)
    precisions = args.precisions.split(",")
    if precisions[0] != "bf16":
        raise SystemExit("--precisions must start with bf16 (the baseline)")
    devices, how = compile_devices()
    step_kind = "evaluation step" if args.eval else f"training step, remat={args.remat}"
    print(
        f"compiled for {devices[0].device_kind} ({how}) | jax {jax.__version__} "
        f"| {step_kind}"
    )
    settings = {} if how == "attached" else {"gemm_operands": "decoded"}
    everything = {}
    for size in args.sizes.split(","):
        results = {}
        for precision in precisions:
            with config.override(**settings):
                text, peak = compile_step(
                    size, precision, args.remat, args.framework, devices[0], args.eval
                )
            if args.hlo_dir:
                os.makedirs(args.hlo_dir, exist_ok=True)
                kind = "eval" if args.eval else args.remat
                name = f"{size}-{precision}-{args.framework}-{kind}.hlo"
                with open(os.path.join(args.hlo_dir, name), "w") as f:
                    f.write(text)
            results[precision] = {"families": ledger(text), "peak_gib": peak}
        print_table(size, results, args.bandwidth)
        everything[size] = results
    if args.out:
        write_json(
            args.out,
            {
                "compiled_for": f"{devices[0].device_kind} ({how})",
                "eval": args.eval,
                "remat": args.remat,
                "ledgers": everything,
            },
        )


if __name__ == "__main__":
    main()
