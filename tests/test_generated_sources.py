"""Sources written by a generator equal what the generator writes now."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wgmma_wrappers_match_their_generator():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_wgmma.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    committed = (ROOT / "ffi" / "gemm" / "engine" / "wgmma.cuh").read_text()
    rerun = "python tools/gen_wgmma.py > ffi/gemm/engine/wgmma.cuh"
    assert out == committed, f"the wrappers are stale: {rerun}"
