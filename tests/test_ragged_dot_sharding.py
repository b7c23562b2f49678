"""jax_nvfp4.ragged_dot sharded on 4 virtual CPU devices equals one device
bit for bit (tests/ragged_dot_sharding_checks.py, run in a subprocess):
data parallel (tokens sharded under jit; per-expert amaxes over all shards)
and expert parallel (experts sharded in shard_map, each device its experts'
rows in a padded capacity buffer, forward and gradients)."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

SCRIPT = pathlib.Path(__file__).with_name("ragged_dot_sharding_checks.py")


@pytest.fixture(scope="module")
def results():
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        JAX_PLATFORMS="cpu",
    )
    out = subprocess.run(
        [sys.executable, str(SCRIPT)],
        cwd=tempfile.gettempdir(),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", ["data_parallel", "expert_parallel"])
def test_sharded_ragged_dot_equals_one_device(results, check):
    assert results[check], check
