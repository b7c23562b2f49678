"""Shared pieces of the benchmarks: operands, the linear step, timing, clock log.

Not a script: the benchmarks import it (benchmarks/ is on sys.path when one
of them runs), and through it the examples' shared code, the package
``nvfp4_examples`` in examples/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp

import jax_nvfp4 as nv

# examples/ rather than the repository root, whose jax_nvfp4 holds no compiled
# extension; appended, so nothing installed is hidden.
_EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "examples"))
if _EXAMPLES not in sys.path:
    sys.path.append(_EXAMPLES)


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose --help shows the script's docstring: its first line as
    the description, the rest (usage examples, what it measures) after the
    options."""
    first, _, rest = doc.partition("\n")
    return argparse.ArgumentParser(
        description=first,
        epilog=rest,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def parse_shape(text: str) -> tuple[int, ...]:
    """'8192x4096x14336' -> (8192, 4096, 14336)."""
    return tuple(int(s) for s in text.lower().split("x"))


def header() -> str:
    """One line naming the device, the JAX version and where handlers run."""
    return (
        f"device: {jax.devices()[0].device_kind} | jax {jax.__version__} | "
        f"jax_nvfp4 handlers on {sorted(nv.available_platforms())}"
    )


def gemm_operands(s: int, repeat: int):
    """`repeat` pairs of bf16 [s, s] operands and their NVFP4 forms (a along
    K, b 2D along its K axis 0, as the recipe quantizes weights)."""
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


def linear_operands(tokens: int, k: int, n: int):
    """(x [tokens, k], w [k, n], dy [tokens, n]) in bf16, and a PRNG key for
    the recipe's stochastic rounding."""
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (tokens, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.bfloat16) * 0.02
    dy = jax.random.normal(jax.random.key(2), (tokens, n), jnp.bfloat16)
    return (x, w, dy), keys[2]


def linear_step(dot):
    """y = dot(x, w) and its vjp with the cotangent dy: (y, dx, dw). dy is an
    input, as in training, where it comes from the next layer (a loss such as
    sum(y) would make dy a constant that bf16's GEMMs fuse and a quantizing
    backward has to materialize)."""

    def f(x, w, dy):
        y, vjp = jax.vjp(dot, x, w)
        return (y, *vjp(dy))

    return f


def median_seconds(fn, *args, reps: int = 20) -> float:
    """Median wall time of fn(*args), each call waited for, after one warm-up."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def write_json(path: str, payload: dict) -> None:
    """Writes payload with the date, device and JAX version added."""
    record = {
        "date": datetime.date.today().isoformat(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        **payload,
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


class ClockLog:
    """The GPU's SM clock, power and temperature, sampled by nvidia-smi every
    `interval` seconds in a background thread while the benchmark runs.

    Why: under large GEMMs an H200 runs at its power limit, and the power
    sets the SM clock; a GEMM on decoded FP4 values draws less power than
    one on random bf16 data and so runs at a higher clock. A ratio to bf16
    is only readable with the clocks next to it. summarize() joins the
    samples with a timeline of (name, start, end) in Unix seconds.
    """

    QUERY = "clocks.sm,power.draw,temperature.gpu"

    def __init__(self, interval: float = 0.1):
        self.interval = interval
        self.samples: list[tuple[float, float, float, float]] = []
        self._stop = threading.Event()
        self._thread = None

    @staticmethod
    def available() -> bool:
        return shutil.which("nvidia-smi") is not None

    def __enter__(self):
        if self.available():
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self):
        command = ["nvidia-smi", f"--query-gpu={self.QUERY}"]
        command += ["--format=csv,noheader,nounits", "--id=0"]
        while not self._stop.is_set():
            now = time.time()
            out = subprocess.run(command, capture_output=True, text=True).stdout
            try:
                clock, power, temp = (float(v) for v in out.split(",")[:3])
                self.samples.append((now, clock, power, temp))
            except ValueError:
                pass  # a line nvidia-smi could not fill
            self._stop.wait(self.interval)

    def summarize(self, timeline, skip: float = 0.0) -> dict:
        """{name: median SM MHz, mean W, max C, samples} over the samples
        inside each (name, start, end) of `timeline`, the first `skip`
        seconds of each left out (untimed settling)."""
        per_name: dict[str, list] = {}
        for name, start, end in timeline:
            rows = [s for s in self.samples if start + skip <= s[0] <= end]
            per_name.setdefault(name, []).extend(rows)
        return {
            name: {
                "sm_clock_mhz": statistics.median(r[1] for r in rows),
                "power_w": statistics.mean(r[2] for r in rows),
                "temperature_c": max(r[3] for r in rows),
                "samples": len(rows),
            }
            for name, rows in per_name.items()
            if rows
        }


def stub_xprof() -> bool:
    """Empty stand-ins for the xprof modules tokamax's top-level import
    reaches (its benchmarking helpers only), where xprof is missing; True if
    stubbed."""
    import importlib
    import types

    try:
        importlib.import_module("xprof.cli.tools")
        return False
    except ImportError:
        pass
    names = (
        "xprof",
        "xprof.cli",
        "xprof.cli.tools",
        "xprof.cli.tools.get_kernel_stats_tool",
    )
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    for parent, child in zip(names[:-1], names[1:], strict=True):
        setattr(sys.modules[parent], child.rsplit(".", 1)[1], sys.modules[child])
    return True


def tokamax_ragged_dot():
    """tokamax's ``ragged_dot``, or the reason it does not import (it needs
    jax >= 0.11.1; its top-level import reaches xprof, for its own
    benchmarking helpers only, which is stubbed where missing)."""
    stub_xprof()
    try:
        import tokamax
    except Exception as e:  # noqa: BLE001 - any failure: report it, go on
        return None, f"{type(e).__name__}: {e}"
    return tokamax.ragged_dot, None
