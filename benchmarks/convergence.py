"""Train the example Llama decoder in bf16 and the NVFP4 variants; compare final losses.

    python examples/text_data.py prepare --out .data/       # once, with network
    python benchmarks/convergence.py                        # all four precisions
    python benchmarks/convergence.py --precisions bf16,nvfp4
    python benchmarks/convergence.py --summary-only         # table and plot again

The run: examples/llama_equinox.py, a 57M-parameter byte-level Llama-style
decoder (d 768, 8 blocks, 12 heads, SwiGLU 2048), 2000 steps of 64 x 256
tokens of GCIDE (examples/text_data.py; about one epoch), AdamW 1e-3 with 100
warmup steps and cosine decay, seed 0. The NVFP4 runs put the MLP linears of
all blocks but the last in NVFP4 (jax_nvfp4.policy.transformer_policy); the
rest stays bf16. Precisions: bf16, nvfp4 (RHT, stochastic rounding, 2D
weights), nvfp4_no_rht, nvfp4_no_sr. Sized for one GPU (a few minutes per
run on an H200); --steps and the model flags shrink it.

Each run writes <out>/<precision>.csv and .log. Then the summary: a Markdown
table (final training and held-out loss averaged over the last --last steps,
their difference from bf16, NaN/Inf, step time, TFLOP/s and tokens/s per
device) printed and written to <out>/summary.md, the numbers to
<out>/summary.json, and the loss curves to <out>/loss.png (needs matplotlib).
The bound checked: nvfp4's final training loss within 1.5% of bf16's.
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

PRECISIONS = ("bf16", "nvfp4", "nvfp4_no_rht", "nvfp4_no_sr")
TOLERANCE = 0.015  # nvfp4's final training loss within 1.5% of bf16's

MODEL_FLAGS = [
    "--batch", "64", "--seq-len", "256",
    "--d-model", "768", "--layers", "8", "--heads", "12", "--ffn", "2048",
    "--keep-last", "1",
    "--lr", "1e-3", "--warmup", "100", "--weight-decay", "0.1", "--seed", "0",
    "--log-every", "10", "--eval-every", "50", "--eval-batches", "4", "--no-plot",
]  # fmt: skip


def train(precision: str, args) -> bool:
    """One training run of examples/llama_equinox.py; its output is printed
    and kept in <out>/<precision>.log. True if it succeeded."""
    command = [
        sys.executable,
        os.path.join(ROOT, "examples", "llama_equinox.py"),
        "--precision", precision, "--label", precision,
        "--steps", str(args.steps), "--data", args.data, "--out", args.out,
        *MODEL_FLAGS, *args.extra,
    ]  # fmt: skip
    start = time.time()
    with open(os.path.join(args.out, f"{precision}.log"), "w") as log:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        ok = proc.wait() == 0
        line = f"{precision}: {'ok' if ok else 'FAILED'}, {time.time() - start:.0f} s"
        print(line)
        log.write(line + "\n")
    return ok


def _finite(rows) -> bool:
    return all(
        math.isfinite(float(r["loss"])) and math.isfinite(float(r["train_loss"]))
        for r in rows
    )


def summarize_dir(directory: str, last: int) -> list[dict]:
    """One dict per run found: precision, steps, losses, ratios, speed."""
    runs = []
    for name in PRECISIONS:
        path = os.path.join(directory, f"{name}.csv")
        if not os.path.exists(path):
            continue
        rows = train_common.read_csv(path)
        if rows:
            s = train_common.summarize(rows, last_steps=last)
            runs.append({"precision": name, "finite": _finite(rows), **s})
    base = next((r for r in runs if r["precision"] == "bf16"), None)
    for r in runs:
        for key in ("train_loss", "eval_loss"):
            r[f"{key}_vs_bf16"] = r[key] / base[key] - 1.0 if base else math.nan
    return runs


def table(runs: list[dict], last: int) -> str:
    def pct(x):
        return "" if not math.isfinite(x) else f"{100 * x:+.2f}%"

    lines = [
        f"| precision | steps | train loss (last {last}) | held-out loss "
        f"(last {last}) | train vs bf16 | held-out vs bf16 | finite | step ms "
        "| TFLOP/s/device | tokens/s/device |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['precision']} | {r['steps']} | {r['train_loss']:.4f} | "
            f"{r['eval_loss']:.4f} | {pct(r['train_loss_vs_bf16'])} | "
            f"{pct(r['eval_loss_vs_bf16'])} | {'yes' if r['finite'] else 'NO'} | "
            f"{r['step_ms']:.1f} | {r['tflops_per_device']:.3g} | "
            f"{r['tokens_per_s_per_device']:,.0f} |"
        )
    nvfp4 = next((r for r in runs if r["precision"] == "nvfp4"), None)
    if nvfp4 is not None and math.isfinite(nvfp4["train_loss_vs_bf16"]):
        ok = abs(nvfp4["train_loss_vs_bf16"]) <= TOLERANCE and nvfp4["finite"]
        lines += [
            "",
            f"nvfp4 vs bf16 final training loss: "
            f"{100 * nvfp4['train_loss_vs_bf16']:+.2f}% (bound: within "
            f"{100 * TOLERANCE:.1f}%): {'met' if ok else 'NOT met'}",
        ]
    return "\n".join(lines)


def report(directory: str, last: int) -> int:
    runs = summarize_dir(directory, last)
    if not runs:
        print(f"no <precision>.csv in {directory}", file=sys.stderr)
        return 1
    text = table(runs, last)
    print(text)
    with open(os.path.join(directory, "summary.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(directory, "summary.json"), "w") as f:
        json.dump(runs, f, indent=2)
    csvs = [os.path.join(directory, f"{r['precision']}.csv") for r in runs]
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
        "--precisions",
        default=",".join(PRECISIONS),
        help=f"comma-separated subset of {', '.join(PRECISIONS)}",
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--data", default=".data/corpus.bin")
    parser.add_argument("--out", default="runs/convergence", help="results folder")
    parser.add_argument("--last", type=int, default=100, help="steps to average")
    parser.add_argument(
        "--summary-only", action="store_true", help="summarize the runs in --out"
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
        for precision in args.precisions.split(","):
            if precision not in PRECISIONS:
                parser.error(f"unknown precision {precision!r}")
            status |= 0 if train(precision, args) else 1
    return report(args.out, args.last) or status


if __name__ == "__main__":
    sys.exit(main())
