"""Summary table and loss plot of a convergence run (benchmarks/convergence.sh).

    python benchmarks/plot_convergence.py benchmarks/results/convergence

Reads ``<dir>/<precision>.csv`` (written by examples/train_common.run_training)
for bf16, nvfp4, nvfp4_no_rht and nvfp4_no_sr (whichever exist), prints a
Markdown table -- final training and held-out loss averaged over the last
``--last`` steps, their ratio to bf16, NaN/Inf, median step time, TFLOP/s and
tokens/s per device -- writes it to ``<dir>/summary.md`` with the numbers in
``<dir>/summary.json``, and draws ``<dir>/loss.png`` (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")
)
import train_common  # noqa: E402

ORDER = ("bf16", "nvfp4", "nvfp4_no_rht", "nvfp4_no_sr")
TOLERANCE = 0.015  # the bound: nvfp4 final loss within 1.5% of bf16


def _finite(rows) -> bool:
    return all(
        math.isfinite(float(r["loss"])) and math.isfinite(float(r["train_loss"]))
        for r in rows
    )


def summarize_dir(directory: str, last: int) -> list[dict]:
    """One dict per run found: precision, steps, losses, ratios, speed."""
    runs = []
    for name in ORDER:
        path = os.path.join(directory, f"{name}.csv")
        if not os.path.exists(path):
            continue
        rows = train_common.read_csv(path)
        if not rows:
            continue
        s = train_common.summarize(rows, last_steps=last)
        runs.append({"precision": name, "finite": _finite(rows), **s})
    base = next((r for r in runs if r["precision"] == "bf16"), None)
    for r in runs:
        for key in ("train_loss", "eval_loss"):
            ratio = r[key] / base[key] - 1.0 if base else math.nan
            r[f"{key}_vs_bf16"] = ratio
    return runs


def table(runs: list[dict], last: int) -> str:
    lines = [
        f"| precision | steps | train loss (last {last}) | held-out loss "
        f"(last {last}) | train vs bf16 | held-out vs bf16 | finite | step ms "
        "| TFLOP/s/device | tokens/s/device |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:

        def pct(x):
            return "" if not math.isfinite(x) else f"{100 * x:+.2f}%"

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
        lines.append("")
        lines.append(
            f"nvfp4 vs bf16 final training loss: "
            f"{100 * nvfp4['train_loss_vs_bf16']:+.2f}% (bound: within "
            f"{100 * TOLERANCE:.1f}%): {'met' if ok else 'NOT met'}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "directory", nargs="?", default="benchmarks/results/convergence"
    )
    parser.add_argument("--last", type=int, default=100, help="steps to average")
    args = parser.parse_args(argv)
    runs = summarize_dir(args.directory, args.last)
    if not runs:
        print(f"no <precision>.csv in {args.directory}", file=sys.stderr)
        return 1
    text = table(runs, args.last)
    print(text)
    with open(os.path.join(args.directory, "summary.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.directory, "summary.json"), "w") as f:
        json.dump(runs, f, indent=2)
    csvs = [os.path.join(args.directory, f"{r['precision']}.csv") for r in runs]
    png = os.path.join(args.directory, "loss.png")
    try:
        train_common.plot_curves(csvs, png)
        print(f"plotted {png}")
    except ImportError as e:
        print(f"no plot: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
