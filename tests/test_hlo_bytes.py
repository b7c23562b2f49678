"""The byte count of compiled programs (benchmarks/hlo_bytes.py) on a
hand-written XLA:GPU-style module: a scanned loop that slices a stacked
weight and updates a stacked buffer in place, then a custom call."""

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
  ROOT %t = (s32[], f32[4,8]{1,0}, bf16[4,8]{1,0}) tuple(%i, %w, %new)
}

%cond (q: (s32[], f32[4,8], bf16[4,8])) -> pred[] {
  %q = (s32[], f32[4,8]{1,0}, bf16[4,8]{1,0}) parameter(0)
  ROOT %f = pred[] constant(false)
}

ENTRY %main (a: f32[4,8], b: bf16[4,8]) -> u8[4,4] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = bf16[4,8]{1,0} parameter(1)
  %z = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}, bf16[4,8]{1,0}) tuple(%z, %a, %b)
  %loop = (s32[], f32[4,8]{1,0}, bf16[4,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = bf16[4,8]{1,0} get-tuple-element(%loop), index=2
  ROOT %q = u8[4,4]{1,0} custom-call(%out), custom_call_target="jax_nvfp4_quantize_rows"
}
"""  # noqa: E501


def test_shape_bytes():
    assert hlo_bytes.shape_bytes("bf16[4,8]{1,0}") == 64
    assert hlo_bytes.shape_bytes("(u8[2,3]{1,0}, f32[], f8e4m3fn[5])") == 6 + 4 + 5
    assert hlo_bytes.shape_bytes("(s32[], /*index=1*/bf16[2,2]{1,0})") == 4 + 8


def test_kernels_count_slices_updates_and_trips():
    found = {k.name: k for k in hlo_bytes.kernels(MODULE)}
    assert set(found) == {"row", "cast", "new", "q"}
    # One row of the stacked f32 weight read, written.
    assert found["row"].bytes == 32 + 32 and found["row"].trips == 3
    assert found["cast"].bytes == 32 + 16
    # In place: the update read and written, not the whole buffer.
    assert found["new"].bytes == 16 + 16
    assert found["q"].target == "jax_nvfp4_quantize_rows"
    assert found["q"].bytes == 64 + 16 and found["q"].trips == 1
