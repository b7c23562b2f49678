"""The GPU's SM clock and power during each timed op of a linear_bench run.

    python benchmarks/clock_summary.py linear.json smi.csv

smi.csv: lines "unix_seconds, sm_clock_mhz, power_w, temperature_c", as
bench_session.sh logs them every ~100 ms. linear.json's timeline gives each
measurement's start and end; the first `settle_s` of each (untimed) is left
out. Prints, per op, the median SM clock and mean power of its timed parts.
"""

from __future__ import annotations

import json
import statistics
import sys


def read_log(path):
    rows = []
    with open(path) as f:
        for line in f:
            fields = [x.strip() for x in line.split(",")]
            try:
                rows.append(tuple(float(x) for x in fields[:4]))
            except ValueError:
                continue  # a line nvidia-smi could not fill
    return rows


def summarize(bench, log):
    settle = bench.get("settle_s", 0.0)
    per_op = {}
    for name, start, end in bench["timeline"]:
        rows = [r for r in log if start + settle <= r[0] <= end]
        per_op.setdefault(name, []).extend(rows)
    return {
        name: {
            "sm_clock_mhz": statistics.median(r[1] for r in rows),
            "power_w": statistics.mean(r[2] for r in rows),
            "temperature_c": max(r[3] for r in rows),
            "log_lines": len(rows),
        }
        for name, rows in per_op.items()
        if rows
    }


def main():
    with open(sys.argv[1]) as f:
        bench = json.load(f)
    summary = summarize(bench, read_log(sys.argv[2]))
    print(f"{'op':>22} {'SM MHz':>7} {'power W':>8} {'max C':>6} {'lines':>6}")
    for name in dict.fromkeys(name for name, _, _ in bench["timeline"]):
        s = summary.get(name)
        if s is None:  # its timed parts were shorter than the log's interval
            print(f"{name:>22} {'-':>7} {'-':>8} {'-':>6} {0:6d}")
            continue
        print(
            f"{name:>22} {s['sm_clock_mhz']:7.0f} {s['power_w']:8.1f} "
            f"{s['temperature_c']:6.0f} {s['log_lines']:6d}"
        )


if __name__ == "__main__":
    main()
