"""The serving matmul ``matmul(x_bf16, w_nvfp4)`` and the bf16 decode under
sharded jit on 4 virtual CPU devices (tests/ops/w4a16_matmul_sharding_checks.py, run in
a subprocess): x's rows, the batch, the weight's rows (N) or both sharded
give one device's bytes (on Auto and on Explicit mesh axes) and the compiled
HLO has no collective (no all-gather of x or of the weight); a sharded
contraction adds only the float32 all-reduce of the partial sums. Bytes are
compared on operands whose float32 sums are exact (each shard's GEMM shape
may change XLA's summation order); real data stays within the float32
summation bound. The grouped form (ragged_dot by NVFP4 experts) partitions
the experts' rows and the contraction the same way."""

import pathlib

import pytest
from conftest import run_on_virtual_cpus

SCRIPT = pathlib.Path(__file__).with_name("w4a16_matmul_sharding_checks.py")
DTYPES = ["bfloat16", "float32"]


@pytest.fixture(scope="module")
def results():
    return run_on_virtual_cpus(SCRIPT, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case,spec",
    [
        ("rows", "P('d',)"),
        ("batch", "P('d',)"),
        ("n", "P(None, 'd')"),
        ("rows and n", "P('a', 'b')"),
    ],
)
def test_partitions_without_collectives(results, case, spec, dtype):
    r = results[f"{case} {dtype}"]
    assert r["bytes_equal"]
    assert r["within_bound"]
    assert r["collectives"] == {} and r["real collectives"] == {}
    assert r["out_spec"] == spec  # the result stays sharded


@pytest.mark.parametrize("dtype", DTYPES)
def test_sharded_contraction_sums_partials_in_float32(results, dtype):
    r = results[f"k {dtype}"]
    assert r["bytes_equal"] and r["within_bound"]
    for found in (r["collectives"], r["real collectives"]):
        # The one collective: the float32 partial sums, [batch, rows, n].
        assert list(found) == ["all-reduce"], found
        assert all(t.startswith("f32[1,64,96]") for t in found["all-reduce"])


@pytest.mark.parametrize("case", ["explicit set_mesh", "explicit typed"])
def test_explicit_axes(results, case):
    assert results[case] == {"bytes_equal": True, "type": "bfloat16[64@d,96]"}


@pytest.mark.parametrize("case", ["decode rows", "decode blocks"])
def test_decode_partitions(results, case):
    r = results[case]
    assert r["bytes_equal"] and r["collectives"] == {}
    assert "'d'" in r["out_spec"]


def test_grouped_form_partitions_the_experts_rows(results):
    r = results["grouped n"]
    assert r["bytes_equal"] and r["collectives"] == {}
    assert r["out_spec"] == "P(None, 'd')"


def test_grouped_form_sums_a_sharded_contraction_in_float32(results):
    r = results["grouped k"]
    assert r["bytes_equal"]
    assert list(r["collectives"]) == ["all-reduce"], r["collectives"]
    assert all(t.startswith("f32[64,96]") for t in r["collectives"]["all-reduce"])


def test_grouped_form_with_sharded_rows_gives_one_devices_bytes(results):
    assert results["grouped rows"]["bytes_equal"]
