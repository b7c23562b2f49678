"""jax_nvfp4.ragged_dot and its grouped GEMM primitives sharded on 4 virtual
CPU devices equal one device bit for bit (tests/ops/grouped_matmul_sharding_checks.py,
run in a subprocess): each primitive partitioned along each of its axes,
without an all-gather (rows form: buffer rows, N, the contraction; tokens
form: the items, M, N), the token buffer (halos between neighbouring shards);
ragged_dot data parallel (tokens sharded under jit, no all-gather of x, dY
or the results; per-expert amaxes over all shards), on Auto and on Explicit
mesh axes, and expert parallel (experts sharded in shard_map, each device
its experts' rows in a padded capacity buffer, forward and gradients)."""

import pathlib

import pytest
from conftest import run_on_virtual_cpus

SCRIPT = pathlib.Path(__file__).with_name("grouped_matmul_sharding_checks.py")


@pytest.fixture(scope="module")
def results():
    return run_on_virtual_cpus(SCRIPT, 4)


@pytest.mark.parametrize(
    "check",
    [
        "rows_m",
        "rows_n",
        "rows_k",
        "tokens_items",
        "tokens_m",
        "tokens_n",
        "token_buffer",
    ],
)
def test_partitioned_primitive_equals_one_device(results, check):
    assert results[check], check


@pytest.mark.parametrize(
    "check", ["data_parallel", "two_axis_mesh", "explicit_axes", "expert_parallel"]
)
def test_sharded_ragged_dot_equals_one_device(results, check):
    assert results[check], check
