"""Train the example Llama decoder in bf16 and the NVFP4 variants; compare final losses.

    python examples/text_data.py prepare --out .data/       # once, with network
    python benchmarks/convergence.py                        # every run, 57M
    python benchmarks/convergence.py --size 125m            # every run, 128M
    python benchmarks/convergence.py --runs bf16,nvfp4 --steps 1000 \
        -- --experts 8 --top-k 2                            # the MoE model
    python benchmarks/convergence.py --size 125m --parallel 5   # at once
    python benchmarks/convergence.py --summary-only         # table and plot again

The run: examples/llama_equinox.py, a byte-level Llama-style decoder (--size
57m: d 768, 8 blocks, 12 heads, SwiGLU 2048, 57M parameters, held-out loss
every 50 steps; 125m: d 768, 12 blocks, 12 heads, SwiGLU 3584, 128M, every
100 steps), 2000 steps of 64 x 256 tokens of GCIDE (examples/text_data.py;
about one epoch), AdamW 1e-3 with 100 warmup steps and cosine decay, seed 0:
every run the same initialisation and data order. The NVFP4 runs put the
MLP linears of all blocks but the last in NVFP4
(jax_nvfp4.policy.transformer_policy); the rest stays bf16. Runs (--runs):
bf16; nvfp4 (RHT, stochastic rounding, 2D weights); nvfp4_attn (the
attention projections in NVFP4 too); nvfp4_no_rht and nvfp4_no_sr (the
recipe without one of its parts). On demand, the runs that find why a
bound fails: nvfp4_1d_weights (1x16 weight blocks), nvfp4_bf16_fprop,
nvfp4_bf16_dgrad and nvfp4_bf16_wgrad (that GEMM in bf16, the others in
NVFP4). Sized for one GPU (a few minutes per run
on an H200); --steps and the model flags after "--" shrink it.

Each run writes <out>/<run>.csv and .log (with --operand-stats, each NVFP4
run also measures every operand the recipe quantizes, per layer, on a
held-out batch with its final weights: <out>/<run>_operands.json). Then
the summary: a Markdown table (final training and held-out loss averaged
over the last --last steps, their difference from bf16, NaN/Inf, step time,
TFLOP/s and tokens/s per device) printed and written to <out>/summary.md, the numbers to
<out>/summary.json, and the loss curves to <out>/loss.png (needs matplotlib).
The bounds checked, on the held-out loss against bf16's: nvfp4 within 1%,
nvfp4_attn within 1.5%; each ablation is compared with nvfp4.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

from common import argument_parser  # and examples/ on sys.path
from nvfp4_examples import train_common

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)

# Run name -> the example's flags that make it.
RUNS = {
    "bf16": ["--precision", "bf16"],
    "nvfp4": ["--precision", "nvfp4"],
    "nvfp4_attn": ["--precision", "nvfp4", "--nvfp4-layers", "mlp+attn"],
    "nvfp4_no_rht": ["--precision", "nvfp4_no_rht"],
    "nvfp4_no_sr": ["--precision", "nvfp4_no_sr"],
    "nvfp4_1d_weights": ["--precision", "nvfp4_1d_weights"],
    "nvfp4_bf16_fprop": ["--precision", "nvfp4_bf16_fprop"],
    "nvfp4_bf16_dgrad": ["--precision", "nvfp4_bf16_dgrad"],
    "nvfp4_bf16_wgrad": ["--precision", "nvfp4_bf16_wgrad"],
}
# The runs without --runs. The others find why a bound fails: 1x16 weight
# blocks (the recipe's third part), and each GEMM kept in bf16 in turn.
DEFAULT_RUNS = ("bf16", "nvfp4", "nvfp4_attn", "nvfp4_no_rht", "nvfp4_no_sr")
# Held-out loss within this fraction of bf16's.
BOUNDS = {"nvfp4": 0.01, "nvfp4_attn": 0.015}
# Each compared with the full recipe (nvfp4): a part of the recipe left out,
# or one GEMM's quantization left out.
ABLATIONS = {
    "nvfp4_no_rht": "without the RHT",
    "nvfp4_no_sr": "without stochastic rounding",
    "nvfp4_1d_weights": "with 1x16 weight blocks",
    "nvfp4_bf16_fprop": "with FPROP in bf16",
    "nvfp4_bf16_dgrad": "with DGRAD in bf16",
    "nvfp4_bf16_wgrad": "with WGRAD in bf16",
}

RUN_FLAGS = [
    "--batch", "64", "--seq-len", "256", "--heads", "12", "--keep-last", "1",
    "--lr", "1e-3", "--warmup", "100", "--weight-decay", "0.1", "--seed", "0",
    "--log-every", "10", "--eval-batches", "4", "--no-plot",
]  # fmt: skip
SIZES = {
    "57m": ["--d-model", "768", "--layers", "8", "--ffn", "2048", "--eval-every", "50"],
    "125m": [
        "--d-model", "768", "--layers", "12", "--ffn", "3584", "--eval-every", "100",
    ],
}  # fmt: skip


def _operands_path(directory: str, run: str) -> str:
    return os.path.join(directory, f"{run}_operands.json")


def _command(run: str, args) -> list[str]:
    operands = []
    if args.operand_stats and run != "bf16":
        operands = ["--operand-stats", _operands_path(args.out, run)]
    return [
        sys.executable,
        os.path.join(ROOT, "examples", "llama_equinox.py"),
        *RUNS[run], "--label", run,
        "--steps", str(args.steps), "--data", args.data, "--out", args.out,
        *RUN_FLAGS, *SIZES[args.size], *operands, *args.extra,
    ]  # fmt: skip


def train(runs: list[str], args) -> int:
    """The training runs of examples/llama_equinox.py, --parallel at a time
    on the one device (small models leave a GPU idle between kernels), each
    run's output kept in <out>/<run>.log (printed too when runs go one at a
    time). The number of runs that failed."""
    pending, running, failed = list(runs), {}, 0
    while pending or running:
        while pending and len(running) < args.parallel:
            run = pending.pop(0)
            log = open(os.path.join(args.out, f"{run}.log"), "w")  # noqa: SIM115
            out = subprocess.PIPE if args.parallel == 1 else log
            proc = subprocess.Popen(
                _command(run, args), stdout=out, stderr=subprocess.STDOUT, text=True
            )
            running[run] = (proc, log, time.time())
            print(f"{run}: started")
        for run, (proc, log, start) in list(running.items()):
            if args.parallel == 1:
                for line in proc.stdout:
                    sys.stdout.write(line)
                    log.write(line)
            if proc.poll() is None and args.parallel > 1:
                continue
            ok = proc.wait() == 0
            line = f"{run}: {'ok' if ok else 'FAILED'}, {time.time() - start:.0f} s"
            print(line)
            log.write(line + "\n")
            log.close()
            failed += not ok
            del running[run]
        if running and args.parallel > 1:
            time.sleep(1.0)
    return failed


def _finite(rows) -> bool:
    return all(
        math.isfinite(float(r["loss"])) and math.isfinite(float(r["train_loss"]))
        for r in rows
    )


def summarize_dir(directory: str, last: int) -> list[dict]:
    """One dict per run found: run, steps, losses, ratios, speed."""
    runs = []
    for name in RUNS:
        path = os.path.join(directory, f"{name}.csv")
        if not os.path.exists(path):
            continue
        rows = train_common.read_csv(path)
        if rows:
            s = train_common.summarize(rows, last_steps=last)
            runs.append({"run": name, "finite": _finite(rows), **s})
    base = next((r for r in runs if r["run"] == "bf16"), None)
    for r in runs:
        for key in ("train_loss", "eval_loss"):
            r[f"{key}_vs_bf16"] = r[key] / base[key] - 1.0 if base else math.nan
    return runs


def table(runs: list[dict], last: int) -> str:
    def pct(x):
        return "" if not math.isfinite(x) else f"{100 * x:+.2f}%"

    lines = [
        f"| run | steps | train loss (last {last}) | held-out loss "
        f"(last {last}) | train vs bf16 | held-out vs bf16 | finite | step ms "
        "| TFLOP/s/device | tokens/s/device |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['run']} | {r['steps']} | {r['train_loss']:.4f} | "
            f"{r['eval_loss']:.4f} | {pct(r['train_loss_vs_bf16'])} | "
            f"{pct(r['eval_loss_vs_bf16'])} | {'yes' if r['finite'] else 'NO'} | "
            f"{r['step_ms']:.1f} | {r['tflops_per_device']:.3g} | "
            f"{r['tokens_per_s_per_device']:,.0f} |"
        )
    return "\n".join(lines + [""] + verdicts(runs))


def verdicts(runs: list[dict]) -> list[str]:
    """A line per bound (met or not) and per ablation (against nvfp4)."""
    by_name = {r["run"]: r for r in runs}
    lines = []
    for name, bound in BOUNDS.items():
        r = by_name.get(name)
        if r is None or not math.isfinite(r["eval_loss_vs_bf16"]):
            continue
        ok = r["finite"] and r["eval_loss_vs_bf16"] <= bound
        lines.append(
            f"{name} vs bf16 held-out loss: {100 * r['eval_loss_vs_bf16']:+.2f}% "
            f"(bound: within {100 * bound:.1f}%): {'met' if ok else 'NOT met'}"
        )
    full = by_name.get("nvfp4")
    for name, what in ABLATIONS.items():
        r = by_name.get(name)
        if r is None or full is None:
            continue
        gap = r["eval_loss"] / full["eval_loss"] - 1.0
        worse = "worse than" if gap > 0 else "not worse than"
        lines.append(
            f"{name} ({what}) vs nvfp4 held-out loss: {100 * gap:+.2f}%: "
            f"{worse} the full recipe"
        )
    return lines


def operand_lines(directory: str, runs: list[dict], worst: int = 3) -> list[str]:
    """Per run with operand statistics (--operand-stats): its ``worst``
    quantized operands by underflow, the largest over a stack's layers."""
    lines = []
    for r in runs:
        path = _operands_path(directory, r["run"])
        if not os.path.exists(path):
            continue
        with open(path) as f:
            records = json.load(f)
        top = train_common.worst_operands(records, worst)
        described = ", ".join(
            f"{rec['role']} {rec['side']} {list(rec['shape'])} layer "
            f"{list(rec['iteration'])}: underflow {100 * rec['underflow']:.1f}%, "
            f"zero-scale blocks {100 * rec['zero_scale_blocks']:.2f}%, "
            f"error {100 * rec['relative_error']:.1f}%"
            for rec in top
        )
        lines.append(f"{r['run']} operands, worst underflow: {described}")
    return lines


def report(directory: str, last: int) -> int:
    runs = summarize_dir(directory, last)
    if not runs:
        print(f"no <run>.csv in {directory}", file=sys.stderr)
        return 1
    text = table(runs, last)
    operands = operand_lines(directory, runs)
    if operands:
        text += "\n\n" + "\n".join(operands)
    print(text)
    with open(os.path.join(directory, "summary.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(directory, "summary.json"), "w") as f:
        json.dump(runs, f, indent=2)
    csvs = [os.path.join(directory, f"{r['run']}.csv") for r in runs]
    png = os.path.join(directory, "loss.png")
    try:
        train_common.plot_curves(csvs, png)
        print(f"plotted {png}")
    except ImportError as e:
        print(f"no plot: {e}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument(
        "--runs",
        default=",".join(DEFAULT_RUNS),
        help=f"comma-separated subset of {', '.join(RUNS)} (default: "
        f"{', '.join(DEFAULT_RUNS)})",
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="57m")
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="runs training at once on the one device (their step times then "
        "are not comparable)",
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--data", default=".data/corpus.bin")
    parser.add_argument("--out", default="runs/convergence", help="results folder")
    parser.add_argument("--last", type=int, default=100, help="steps to average")
    parser.add_argument(
        "--summary-only", action="store_true", help="summarize the runs in --out"
    )
    parser.add_argument(
        "--operand-stats",
        action="store_true",
        help="after each NVFP4 run, measure every operand the recipe quantizes "
        "(x, w, dY per layer) on a held-out batch: <out>/<run>_operands.json, "
        "and the worst by underflow in the summary",
    )
    parser.add_argument(
        "extra",
        nargs="*",
        help="more flags for every run, after '--' (e.g. -- --attention cudnn)",
    )
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    status = 0
    if not args.summary_only:
        if not os.path.exists(args.data):
            print(
                f"missing {args.data}: run 'python examples/text_data.py prepare "
                f"--out {os.path.dirname(args.data) or '.'}'",
                file=sys.stderr,
            )
            return 1
        if args.parallel < 1:
            parser.error(f"--parallel must be at least 1, got {args.parallel}")
        runs = args.runs.split(",")
        for run in runs:
            if run not in RUNS:
                parser.error(f"unknown run {run!r}; choose from {', '.join(RUNS)}")
        status |= 1 if train(runs, args) else 0
    return report(args.out, args.last) or status


if __name__ == "__main__":
    sys.exit(main())
