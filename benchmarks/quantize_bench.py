"""Time the fused row-wise + column-wise NVFP4 quantize; its bandwidth against a copy.

    python benchmarks/quantize_bench.py
    python benchmarks/quantize_bench.py --kernels --out quantize.json

For each shape (bf16 [M, K]) it times, in one run:
  copy       XLA elementwise x + 1 (reads and writes 2 B/elem): the device's
             measured copy bandwidth, the yardstick.
  fused      jax_nvfp4.quantize_rowwise_and_columnwise with the recipe's
             options for dY: rows 1x16 nearest, columns 1x16 with RHT and
             stochastic rounding; the global amax pass included.
  kernel     the same with both amaxes passed in: the fused custom call alone.
  fused_x    the recipe's options for X: columns with RHT, nearest.
  kernel_x   the same with both amaxes passed in (the kernel alone).
  kernel_2d  16x16 blocks both ways, nearest, amaxes passed in (the 2D
             weight quantize).
  amax_rht   the amax pass (plain and RHT amax in one read).
  reference  the pure-JAX twin of `fused` under jit.
  decode     (Hopper GEMM path only) the decode of x's row-wise quantization
             to the bf16 operands the GEMM multiplies.
Minimum bytes of a fused quantize: read 2 B/elem, write 2 x (0.5 + 1/16) B/elem
= 3.125 B/elem; the amax pass reads x once more (2 B/elem); the decode reads
0.5625 and writes 2 B/elem. "TB/s" and "of copy" count those bytes.
Each timing runs the op on REPEAT and on REPEAT/2 distinct inputs inside one
jitted call (no input is reused from L2) and takes the difference of the two
medians over REPEAT/2: the per-op time, free of dispatch overhead ("time").
On a GPU the REPEAT-input call is also traced once (jax.profiler, CUPTI) and
the durations of the kernels it ran are summed ("device": the kernels'
time per op, without the gaps between them; --kernels lists them).
"""

from __future__ import annotations

import functools
import glob
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from common import argument_parser, header, parse_shape, write_json

import jax_nvfp4 as nv
from jax_nvfp4.keys import key_words
from jax_nvfp4.quantize import quantize_shard_rows_cols


def _rows_cols(x, key=None, **options):
    """The recipe's fused quantize (decoded-operand requests allowed), the
    key turned into words as the public call turns it."""
    stochastic = "stochastic" in (
        options.get("row_rounding"),
        options.get("col_rounding"),
    )
    words = key_words(key, stochastic, x.size) if stochastic else None
    return quantize_shard_rows_cols(x, words=words, **options)


REPEAT = 16
CALLS = 15


def _median_call(fn, inputs):
    run = jax.jit(lambda xs: [fn(x) for x in xs])
    jax.block_until_ready(run(inputs))
    samples = []
    for _ in range(CALLS):
        start = time.perf_counter()
        jax.block_until_ready(run(inputs))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def timed(fn, inputs):
    """Seconds per application of fn: the slope between len(inputs) and half."""
    half = len(inputs) // 2
    return (_median_call(fn, inputs) - _median_call(fn, inputs[:half])) / (
        len(inputs) - half
    )


def device_time(fn, inputs):
    """(seconds of kernels per application of fn, {kernel: ns}) from one
    traced call on REPEAT inputs; (None, {}) off a GPU."""
    if jax.default_backend() != "gpu":
        return None, {}
    run = jax.jit(lambda xs: [fn(x) for x in xs])
    jax.block_until_ready(run(inputs))
    with tempfile.TemporaryDirectory() as directory:
        jax.profiler.start_trace(directory)
        jax.block_until_ready(run(inputs))
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    kernels = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue  # the XLA Ops/Modules lines repeat the kernels
            for e in line.events:
                kernels[e.name] = kernels.get(e.name, 0.0) + e.duration_ns
    return sum(kernels.values()) / 1e9 / len(inputs), kernels


def _optional(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- an optional row
        print("skipped:", type(e).__name__, str(e)[:200])
        return None


def _decode_op():
    """The Hopper GEMM path's operand decode (codes, scales) -> bf16, the
    primitive ``ops.decode_bf16`` (the CUDA handler where it is built); None
    off a GPU."""
    if jax.default_backend() != "gpu":
        return None
    from jax_nvfp4.ops import decode_bf16

    return lambda codes, scales: decode_bf16(codes[None], scales[None])[0]


def bench_shape(m, k, list_kernels=False):
    keys = jax.random.split(jax.random.key(0), REPEAT)
    xs = [jax.random.normal(kk, (m, k), jnp.bfloat16) for kk in keys]
    n = m * k
    sr_key = jax.random.key(1)
    dy_options = dict(col_rht=True, col_rounding="stochastic")
    x_options = dict(col_rht=True)

    def fused(x, implementation="ffi", **extra):
        return _rows_cols(
            x, key=sr_key, implementation=implementation, **dy_options, **extra
        )

    amaxes = [(nv.global_amax(x), nv.global_amax(x, axis=0, rht=True)) for x in xs]
    # The kernels alone: global_amax's values are valid amaxes, so the check
    # of a traced amax against the result (as the recipe does) is skipped.
    trusted = dict(amax_trusted=True)
    with_amaxes = list(zip(xs, amaxes, strict=True))
    # name: (fn, its inputs); the first four are also timed by the trace.
    ops = {
        "copy": (lambda x: x + 1, xs),
        "kernel": (
            lambda xa: fused(xa[0], row_amax=xa[1][0], col_amax=xa[1][1], **trusted),
            with_amaxes,
        ),
        "kernel_x": (
            lambda xa: _rows_cols(
                xa[0], **x_options, row_amax=xa[1][0], col_amax=xa[1][1], **trusted
            ),
            with_amaxes,
        ),
        "kernel_2d": (
            lambda xa: _rows_cols(
                xa[0],
                row_block="16x16",
                col_block="16x16",
                row_amax=xa[1][0],
                col_amax=xa[1][0],
                **trusted,
            ),
            with_amaxes,
        ),
        "fused": (fused, xs),
        "fused_x": (
            lambda x: nv.quantize_rowwise_and_columnwise(x, **x_options),
            xs,
        ),
        "amax_rht": (lambda x: nv.global_amax(x, axis=0, rht=True), xs),
        "reference": (functools.partial(fused, implementation="reference"), xs),
    }
    traced = ("copy", "kernel", "kernel_x", "kernel_2d")
    results = {name: timed(fn, inputs) for name, (fn, inputs) in ops.items()}
    # Bytes per element each op must move at least (a quantize: read bf16,
    # write two codes + scales; the decode: read codes + scales, write bf16).
    bytes_per_element = {"copy": 4.0, "amax_rht": 2.0}
    decode = _decode_op()
    if decode is not None:
        rows_only = [nv.quantize(x) for x in xs]
        t = _optional(lambda: timed(lambda t: decode(t.codes, t.scales), rows_only))
        if t is not None:
            results["decode"] = t
            bytes_per_element["decode"] = 2.5625
    device = {}
    for name in traced:
        fn, inputs = ops[name]
        device[name], kernels = device_time(fn, inputs)
        if list_kernels and kernels:
            print(f"{m}x{k} {name}: kernels of {len(xs)} applications")
            for kernel, ns in sorted(kernels.items(), key=lambda kv: -kv[1]):
                print(f"    {ns / 1e3:10,.1f} us  {kernel[:110]}")
    copy_bw = 4 * n / results["copy"]
    device_copy_bw = 4 * n / device["copy"] if device.get("copy") else None
    rows = []
    for name, t in results.items():
        moved = bytes_per_element.get(name, 3.125) * n
        dev = device.get(name)
        rows.append(
            {
                "shape": f"{m}x{k}",
                "op": name,
                "time_us": t * 1e6,
                "min_bytes_bandwidth_TBps": moved / t / 1e12,
                "fraction_of_copy_bw": moved / t / copy_bw,
                "device_time_us": dev * 1e6 if dev else None,
                "device_fraction_of_copy_bw": moved / dev / device_copy_bw
                if dev and device_copy_bw
                else None,
                # The reference is of the dY quantize: only the quantizes of
                # the same options compare.
                "vs_reference": results["reference"] / t
                if name in ("fused", "kernel", "reference")
                else None,
            }
        )
    return rows


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--out", help="write the rows as JSON")
    parser.add_argument(
        "--shapes", default="8192x4096,16384x8192", help="comma-separated MxK"
    )
    parser.add_argument(
        "--kernels", action="store_true", help="list the traced kernels per op"
    )
    args = parser.parse_args(argv)
    print(header())
    all_rows = []
    for shape in args.shapes.split(","):
        m, k = parse_shape(shape)
        all_rows += bench_shape(m, k, args.kernels)
    print(
        f"{'shape':>12} {'op':>10} {'time us':>9} {'TB/s*':>7} "
        f"{'of copy':>8} {'ref/this':>9} {'device us':>10} {'of copy':>8}"
    )
    for r in all_rows:
        dev = r["device_time_us"]
        print(
            f"{r['shape']:>12} {r['op']:>10} {r['time_us']:9.1f} "
            f"{r['min_bytes_bandwidth_TBps']:7.2f} "
            f"{r['fraction_of_copy_bw']:8.2f} "
            + (f"{r['vs_reference']:9.2f}" if r["vs_reference"] else f"{'-':>9}")
            + (
                f" {dev:10.1f} {r['device_fraction_of_copy_bw']:8.2f}"
                if dev
                else f" {'-':>10} {'-':>8}"
            )
        )
    print(
        "* TB/s counts the minimum bytes of each op (a quantize 3.125 B/elem, "
        "amax 2, decode 2.5625, copy 4), whatever it reads on top; device: the "
        "traced kernels' time per op (the copy's for 'of copy')"
    )
    if args.out:
        write_json(args.out, {"rows": all_rows})


if __name__ == "__main__":
    main()
