"""Sharded NVFP4 equals one device, on 8 virtual CPU devices.

tests/sharding_checks.py runs every case once in a subprocess (XLA_FLAGS is
read when JAX starts) and reports JSON; the tests below assert on it:
quantized bytes (round-to-nearest and stochastic, RHT, 16x16) are identical
under data, column, 2D and combined-axis shardings; dot's output and
gradients differ from one device only by float32 accumulation order; the
compiled HLO gathers no activation and no full-precision weight; a sharding
that splits a 16-element block is refused with a message that says so.
"""

import pathlib
import re

import pytest
from conftest import run_on_virtual_cpus

SCRIPT = pathlib.Path(__file__).with_name("sharding_checks.py")
# Relative to max |one-device result|: sums of <= 128 float32 products in a
# different order (split contraction, per-shard GEMM blocking) differ by
# < 128 * 2^-24 of the sum of |products|; observed <= 1e-7.
ACCUMULATION_BOUND = 2**-16


@pytest.fixture(scope="module")
def results():
    data = run_on_virtual_cpus(SCRIPT, 8)
    assert data["devices"] == 8
    return data


CASES = ["rows over 8", "cols over 8", "2d 4x2", "2d transposed", "rows over both"]


@pytest.mark.parametrize("case", CASES)
def test_quantized_bytes_equal_one_device(results, case):
    r = results["quantize"][case]
    assert r["bytes_equal"]
    assert r["all_gathers"] == []  # each shard quantizes its own block
    assert r["out_spec"] != "P()"  # and the result stays sharded


def test_vmapped_batch_sharded(results):
    # Per-item amaxes of a vmapped quantize follow the sharded batch.
    assert results["vmap batch sharded bytes_equal"]


def test_vmapped_batch_sharded_over_explicit_axes(results):
    assert results["explicit vmap batch"] == {
        "bytes_equal": True,
        "vmap dequantize equal": True,
        "dequantize equal": True,
    }


def test_split_block_is_a_clear_error(results):
    message = results["split_block_error"]
    assert "split a 16-element NVFP4 block" in message
    assert "column (k) axis" in message and "24 elements" in message


DOT_CASES = [
    "data parallel",
    "tensor parallel (column)",
    "tensor parallel (row)",
    "data + tensor 2d",
    "fsdp (jit)",
]


@pytest.mark.parametrize("case", DOT_CASES)
def test_dot_under_jit_shardings(results, case):
    r = results["dot"][case]
    for name in ("y", "dx", "dw"):
        assert r[name] <= ACCUMULATION_BOUND, (name, r[name])
    if case == "fsdp (jit)":
        # The FSDP weight gather moves FP4 codes and E4M3 scales (XLA:CPU
        # carries float8 collectives as f16), never the f32 weight.
        assert r["all_gathers"]
        for t in r["all_gathers"]:
            assert re.match(r"(u8|f8e4m3fn|f16)\[", t), t
    else:
        assert r["all_gathers"] == []


EXPLICIT_CASES = [
    f"{r}, {layout}"
    for r in ("nvfp4", "bf16", "fprop bf16", "dgrad bf16", "wgrad bf16")
    for layout in (
        "data parallel",
        "tensor parallel (column)",
        "tensor parallel (row)",
    )
]


@pytest.mark.parametrize("case", EXPLICIT_CASES)
def test_dot_with_explicit_mesh_axes(results, case):
    """Explicit axes (jax.make_mesh's default in newer JAX): every recipe,
    including the GEMMs kept in bf16, which must name their output sharding
    when they contract a sharded dimension."""
    r = results["explicit"][case]
    assert isinstance(r, float), r
    assert r <= ACCUMULATION_BOUND, r


@pytest.mark.parametrize("case", ["data + tensor 2d", "fsdp (jit)", "shard_map fsdp"])
def test_decoded_gemm_operands_under_shardings(results, case):
    """The fused quantize writing the bf16 GEMM operands (the Hopper path,
    forced on for the CPU devices), bfloat16 x and w: sharded equals one
    device with codes up to one bfloat16 rounding of float32 sums taken in
    another order, and FSDP still gathers codes and scales, never a bf16
    weight or operand."""
    r = results["decoded operands"][case]
    assert r["decoded"]  # the decoded quantize did run
    for name in ("y", "dx", "dw"):
        assert r[name] <= 2**-7, (name, r[name])
    for t in r.get("all_gathers", []):
        assert re.match(r"(u8|f8e4m3fn|f16)\[", t), t


def test_shard_map_fsdp_step(results):
    r = results["shard_map fsdp"]
    for name in ("y", "dx", "dw"):
        assert r[name] <= ACCUMULATION_BOUND, (name, r[name])
    assert r["dw_spec"] == "P('data', None)"  # gradients come back sharded
    # Only the example's own per-layer gather of the weight shard.
    assert r["all_gathers"] == ["f32[128,96]{1,0}"]


def test_shard_map_outputs_keep_the_inputs_variance(results):
    assert results["shard_map drops variance"] == "refused"
    assert results["shard_map full spec"] == [64, 64]


def test_quantize_inside_shard_map(results):
    assert results["shard_map quantize bytes_equal"]
