"""benchmarks/convergence.py's report on runs' CSVs: the held-out bounds
against bf16 (met or not) and each ablation against the full recipe."""

import csv
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
convergence = pytest.importorskip("convergence")
train_common = pytest.importorskip("nvfp4_examples.train_common")


def _write_run(directory, name, eval_loss, train_loss=None):
    rows = []
    for step in range(10, 210, 10):
        rows.append(
            {
                "step": step,
                "loss": train_loss or eval_loss,
                "train_loss": train_loss or eval_loss,
                "eval_loss": eval_loss if step % 50 == 0 else "",
                "lr": 1e-3,
                "step_ms": 10.0,
                "tflops_per_device": 1.0,
                "tokens_per_s_per_device": 1000.0,
                "elapsed_s": step / 100,
            }
        )
    with open(os.path.join(directory, f"{name}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=train_common.CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def test_report_bounds_and_ablations(tmp_path, capsys):
    _write_run(tmp_path, "bf16", 2.000)
    _write_run(tmp_path, "nvfp4", 2.010)  # +0.5%: within 1%
    _write_run(tmp_path, "nvfp4_attn", 2.040)  # +2%: past 1.5%
    _write_run(tmp_path, "nvfp4_no_rht", 2.030)
    _write_run(tmp_path, "nvfp4_bf16_wgrad", 2.000)
    assert convergence.report(str(tmp_path), last=100) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "nvfp4 vs bf16 held-out loss: +0.50% (bound: within 1.0%): met" in summary
    assert "nvfp4_attn vs bf16 held-out loss: +2.00% (bound: within 1.5%): NOT met" in (
        summary
    )
    assert (
        "nvfp4_no_rht (without the RHT) vs nvfp4 held-out loss: +1.00%: worse than "
        "the full recipe" in summary
    )
    assert (
        "nvfp4_bf16_wgrad (with WGRAD in bf16) vs nvfp4 held-out loss: -0.50%: "
        "not worse than the full recipe" in summary
    )
    assert "nvfp4_no_sr" not in summary  # no such run in the folder


def test_runs_are_the_examples_precisions():
    """Every run's --precision is one the examples take, and the default runs
    are among them."""
    for name, flags in convergence.RUNS.items():
        assert flags[flags.index("--precision") + 1] in train_common.PRECISIONS, name
    assert set(convergence.DEFAULT_RUNS) <= set(convergence.RUNS)
    assert set(convergence.ABLATIONS) <= set(convergence.RUNS)
