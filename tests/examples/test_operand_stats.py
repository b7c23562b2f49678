"""The Equinox example's --operand-stats and convergence.py's summary of it:
after training, every operand the recipe quantizes, per layer, measured on a
held-out batch."""

import json
import os
import sys

import llama_equinox  # examples/ is on the tests' path (pyproject.toml)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import convergence  # noqa: E402


def test_example_writes_and_convergence_summarizes_operand_stats(tmp_path, capsys):
    out = tmp_path / "runs"
    llama_equinox.main(
        [
            "--steps", "2", "--layers", "3", "--d-model", "32", "--heads", "2",
            "--ffn", "64", "--batch", "2", "--seq-len", "32", "--log-every", "1",
            "--eval-every", "100", "--out", str(out), "--no-plot",
            "--label", "nvfp4", "--remat", "none",
            "--operand-stats", str(out / "nvfp4_operands.json"),
            "--data", str(tmp_path / "missing.bin"),  # the sample in tests/data
        ]
    )  # fmt: skip
    records = json.loads((out / "nvfp4_operands.json").read_text())
    roles = {(r["role"], r["side"]) for r in records}
    # Blocks 0 and 1 in NVFP4 (block 2 is the bf16 tail): x and w forward,
    # dY backward, rows and cols each.
    assert {("x", "rows"), ("x", "cols"), ("w", "rows"), ("dY", "rows")} <= roles
    assert {r["iteration"][0] for r in records} == {0, 1}
    for r in records:
        assert 0.0 <= r["underflow"] <= 1.0 and r["nonfinite"] == 0.0
        assert 0.0 < r["relative_error"] < 0.5
    printed = capsys.readouterr().out
    assert "operand statistics" in printed and "underflow" in printed

    runs = convergence.summarize_dir(str(out), last=100)
    lines = convergence.operand_lines(str(out), runs)
    assert len(lines) == 1 and lines[0].startswith("nvfp4 operands, worst underflow")
