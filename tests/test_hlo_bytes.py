"""The byte count of compiled programs (benchmarks/hlo_bytes.py) on a
hand-written XLA:GPU-style module: a scanned loop that slices a stacked
weight and updates a stacked buffer in place, a conditional, then custom
calls (one with a GEMM's workspace)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
hlo_bytes = pytest.importorskip("hlo_bytes")

MODULE = """\
HloModule scanned

%fused_slice (param_0: f32[4,8]) -> f32[1,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %c = s32[] constant(0)
  ROOT %ds = f32[1,8]{1,0} dynamic-slice(%param_0, %c, %c), dynamic_slice_sizes={1,8}
}

%fused_indexed (param_0.2: f32[4,8], param_1.2: s32[]) -> f32[2,8] {
  %param_0.2 = f32[4,8]{1,0} parameter(0)
  %param_1.2 = s32[] parameter(1)
  %z.2 = s32[] constant(0)
  %s1 = f32[1,8]{1,0} dynamic-slice(%param_0.2, %param_1.2, %z.2), dynamic_slice_sizes={1,8}
  %s2 = f32[1,8]{1,0} dynamic-slice(%param_0.2, %param_1.2, %z.2), dynamic_slice_sizes={1,8}
  ROOT %both = f32[2,8]{1,0} concatenate(%s1, %s2), dimensions={0}
}

%fused_update (param_0.1: bf16[4,8], param_1: bf16[1,8]) -> bf16[4,8] {
  %param_0.1 = bf16[4,8]{1,0} parameter(0)
  %param_1 = bf16[1,8]{1,0} parameter(1)
  %b = bf16[4,8]{1,0} bitcast(%param_0.1)
  %c.1 = s32[] constant(0)
  ROOT %dus = bf16[4,8]{1,0} dynamic-update-slice(%b, %param_1, %c.1, %c.1)
}

%body (p: (s32[], f32[4,8], bf16[4,8])) -> (s32[], f32[4,8], bf16[4,8]) {
  %p = (s32[], f32[4,8]{1,0}, bf16[4,8]{1,0}) parameter(0)
  %w = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %acc = bf16[4,8]{1,0} get-tuple-element(%p), index=2
  %row = f32[1,8]{1,0} fusion(%w), kind=kLoop, calls=%fused_slice
  %cast = bf16[1,8]{1,0} convert(%row)
  %new = bf16[4,8]{1,0} fusion(%acc, %cast), kind=kLoop, calls=%fused_update
  %i = s32[] get-tuple-element(%p), index=0
  %pair = f32[2,8]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_indexed
  ROOT %t = (s32[], f32[4,8]{1,0}, bf16[4,8]{1,0}) tuple(%i, %w, %new)
}

%branch_a (ba: f32[4,8]) -> f32[4,8] {
  %ba = f32[4,8]{1,0} parameter(0)
  ROOT %na = f32[4,8]{1,0} negate(%ba)
}

%branch_b (bb: f32[4,8]) -> f32[4,8] {
  %bb = f32[4,8]{1,0} parameter(0)
  ROOT %cb = f32[4,8]{1,0} copy(%bb)
}

%cond (q: (s32[], f32[4,8], bf16[4,8])) -> pred[] {
  %q = (s32[], f32[4,8]{1,0}, bf16[4,8]{1,0}) parameter(0)
  ROOT %f = pred[] constant(false)
}

ENTRY %main (a: f32[4,8], b: bf16[4,8]) -> (bf16[4,4], u8[4096]) {
  %a = f32[4,8]{1,0} parameter(0)
  %b = bf16[4,8]{1,0} parameter(1)
  %z = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}, bf16[4,8]{1,0}) tuple(%z, %a, %b)
  %loop = (s32[], f32[4,8]{1,0}, bf16[4,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = bf16[4,8]{1,0} get-tuple-element(%loop), index=2
  %which = s32[] constant(1)
  %picked = f32[4,8]{1,0} conditional(%which, %a, %a), branch_computations={%branch_a, %branch_b}
  %q = u8[4,4]{1,0} custom-call(%out), custom_call_target="jax_nvfp4_quantize_rows"
  ROOT %g = (bf16[4,4]{1,0}, u8[4096]{0}) custom-call(%out, %out), custom_call_target="jax_nvfp4_matmul_bf16"
}
"""  # noqa: E501


def test_unknown_element_type_is_an_error():
    with pytest.raises(ValueError, match="unknown HLO element type"):
        hlo_bytes.shape_bytes("q7[4]")


def test_shape_bytes():
    assert hlo_bytes.shape_bytes("bf16[4,8]{1,0}") == 64
    assert hlo_bytes.shape_bytes("(u8[2,3]{1,0}, f32[], f8e4m3fn[5])") == 6 + 4 + 5
    assert hlo_bytes.shape_bytes("(s32[], /*index=1*/bf16[2,2]{1,0})") == 4 + 8
    assert hlo_bytes.shape_bytes("f32[<=8,2]") == 64  # bounded: its bound


def test_kernels_count_slices_updates_and_trips():
    found = {k.name: k for k in hlo_bytes.kernels(MODULE)}
    assert set(found) == {"row", "cast", "new", "pair", "na", "cb", "q", "g"}
    # Both branches of a conditional (an upper bound), each read and written.
    assert found["na"].bytes == found["cb"].bytes == 128 + 128
    # Two slices of the weight read, the index a scalar, the pair written.
    assert found["pair"].bytes == 2 * 32 + 4 + 64
    # One row of the stacked f32 weight read, written.
    assert found["row"].bytes == 32 + 32 and found["row"].trips == 3
    assert found["cast"].bytes == 32 + 16
    # In place: the update read and written, not the whole buffer.
    assert found["new"].bytes == 16 + 16
    assert found["q"].target == "jax_nvfp4_quantize_rows"
    assert found["q"].bytes == 64 + 16 and found["q"].trips == 1
    # A GEMM's workspace (its last, 1-D byte result) is not traffic.
    assert found["g"].bytes == 64 + 64 + 32
