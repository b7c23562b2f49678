"""The native Blackwell grouped FP4 GEMM's host-side logic, on the CPU: the
realigned token buffer, the group-major scale layout, the handler's plan
(its launches, offsets and zeroed ranges, C++ through
jax_nvfp4._ffi_testing; tested on their own in tests/cpp) and a NumPy
emulation of those launches, run as the grouped GEMM primitives' native
path against their twins. The handler itself has not run on Blackwell
hardware."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grouped_cases import DTYPES, ROWS, TOKENS, rows_operands, tokens_operands

from jax_nvfp4 import config, reference
from jax_nvfp4.backends import fp4_gemm, fp4_grouped_gemm, group_alignment, library
from jax_nvfp4.format import E2M1_VALUES
from jax_nvfp4.ops import dispatch, grouped_matmul

try:
    from jax_nvfp4 import _ffi_testing
except ImportError:
    _ffi_testing = None
needs_plan = pytest.mark.skipif(
    _ffi_testing is None, reason="needs jax_nvfp4._ffi_testing (pip install .)"
)


def _e4m3_bytes(rng, shape):
    """Finite, non-negative E4M3 scale bytes."""
    raw = rng.integers(0, 0x7F, size=shape, dtype=np.uint8)
    return jnp.asarray(raw)


def test_group_major_scales_swizzle_each_group():
    """Group g's [rows, tokens_g / 16] block is fp4_gemm.swizzle_scales of
    its columns, at byte start_g * rows / 16; columns past the groups are
    dropped."""
    rng = np.random.default_rng(0)
    rows, sizes = 256, np.array([128, 0, 384, 256], np.int32)
    cols = sizes.sum() // 16 + 8  # a tail past the groups
    scales = _e4m3_bytes(rng, (rows, cols))
    got = np.asarray(fp4_grouped_gemm.group_major_scales(scales, jnp.asarray(sizes)))
    assert got.shape == (rows * cols,)
    start = 0
    for size in sizes:
        block = scales[:, start // 16 : (start + size) // 16]
        want = np.asarray(fp4_gemm.swizzle_scales(block)) if size else []
        at = start * rows // 16
        np.testing.assert_array_equal(got[at : at + rows * size // 16], want)
        start += size
    assert not got[start * rows // 16 :].any()


def test_realigned_rows_put_groups_on_tiles():
    """Each group's rows move to a multiple of 128, in order, zeros between;
    scattering back by the same indices restores the buffer."""
    padded = jnp.asarray([32, 0, 144, 16], jnp.int32)
    rows = 256  # ragged_dot's buffer: the groups, then unused rows
    buffer = jnp.arange(1, rows + 1, dtype=jnp.int32)
    src, out_rows = group_alignment.realigned_rows(
        padded, rows, granule=16, alignment=fp4_grouped_gemm.GROUP_ALIGNMENT
    )
    assert out_rows % 128 == 0 and out_rows >= 3 * 128
    moved = np.asarray(group_alignment.take(buffer, src))
    sizes = np.asarray(fp4_grouped_gemm.aligned_sizes(padded))
    np.testing.assert_array_equal(sizes, [128, 0, 256, 128])
    at, old = 0, 0
    for size, aligned in zip(np.asarray(padded), sizes, strict=True):
        np.testing.assert_array_equal(moved[at : at + size], np.arange(size) + old + 1)
        assert not moved[at + size : at + aligned].any()
        at, old = at + aligned, old + size
    assert not moved[at:].any()
    back = jnp.zeros(rows, jnp.int32).at[src].set(jnp.asarray(moved), mode="drop")
    np.testing.assert_array_equal(back[:old], buffer[:old])


def _emulate(plan, operands, a_amax, b_amax, shape, dtype):
    """What the handler computes for ``plan`` on these operands: each launch
    reads its slices as cuBLASLt would (codes with the launch's leading
    dimension, block scales swizzled from the launch's offset), float64
    sums, float32 alpha, one rounding."""
    a_codes, a_scales, b_codes, b_scales = (np.asarray(t).reshape(-1) for t in operands)
    values = np.asarray(E2M1_VALUES, np.float64)
    out = np.zeros(int(np.prod(shape)), np.float32)

    def matrix(codes, scales, code_at, scale_at, rows, k, ld):
        at = code_at + np.arange(rows)[:, None] * (ld // 2) + np.arange(k // 2)
        packed = codes[at]
        nibbles = np.stack([packed & 0xF, packed >> 4], -1).reshape(rows, k)
        e2m1 = np.where(nibbles & 8, -1.0, 1.0) * values[nibbles & 7]
        cols = k // 16
        r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        off = ((r // 128) * (cols // 4) + c // 4) * 512 + (r % 32) * 16
        off = off + ((r % 128) // 32) * 4 + c % 4
        s = np.asarray(scales[scale_at + off].view(jnp.float8_e4m3fn), np.float64)
        return e2m1 * np.repeat(s, 16, axis=1)

    for x in plan["launches"]:
        m, n, k, ld, g = x["m"], x["n"], x["k"], x["ld"], x["group"]
        a = matrix(a_codes, a_scales, x["a"], x["a_scales"], m, k, ld)
        b = matrix(b_codes, b_scales, x["b"], x["b_scales"], n, k, ld)
        alpha = (np.float32(a_amax[g]) / np.float32(2688)) * (
            np.float32(b_amax[g]) / np.float32(2688)
        )
        block = (a @ b.T).astype(np.float32) * alpha
        out[x["out"] : x["out"] + m * n] = block.ravel()
    return np.asarray(jnp.asarray(out.reshape(shape)).astype(dtype))


def _emulated_call(operands, sizes, a_amax, b_amax, shape, dtype, *, tokens_form):
    """fp4_grouped_gemm.handler_call with the handler replaced by its plan (C++,
    through jax_nvfp4._ffi_testing) and the emulation, on the host."""

    def host(*args):
        *ops, sizes, a_amax, b_amax = (np.asarray(a) for a in args)
        count = sizes.shape[0]
        plan = _ffi_testing.plan_grouped_fp4_gemm(
            tokens_form, *(list(t.shape) for t in ops), [count], [count],
            list(shape), [1 << 20], sizes.tolist(),
        )  # fmt: skip
        return _emulate(plan, ops, a_amax, b_amax, shape, dtype)

    return jax.pure_callback(
        host,
        jax.ShapeDtypeStruct(shape, dtype),
        *operands,
        sizes.astype(jnp.int32),
        jnp.asarray(a_amax, jnp.float32).reshape(-1),
        jnp.asarray(b_amax, jnp.float32).reshape(-1),
    )


def _body(form, path, dtype):
    return jax.jit(
        functools.partial(grouped_matmul.lowering_body(form, path), dtype=dtype)
    )


def _origin(start=0):
    return jnp.asarray([start], jnp.int32)


FORMS = {
    "rows": (reference.grouped_matmul_rows, rows_operands, ROWS["unaligned"]),
    "tokens": (reference.grouped_matmul_tokens, tokens_operands, TOKENS["unbalanced"]),
}


def _bits_equal(a, b):
    np.testing.assert_array_equal(
        np.asarray(a, np.float32), np.asarray(b, np.float32), strict=True
    )


@needs_plan
@pytest.mark.parametrize("dtype", [*DTYPES, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_native_path_on_the_emulated_handler(form, dtype):
    """The grouped GEMM's native path (ops.grouped_matmul's body: groups
    realigned to 128 rows, padded operands, swizzled scales, the handler's
    plan) with the emulated handler equals the twin on operands whose sums
    are exact: unbalanced groups, an empty one, rows off multiples of 16,
    rows past the groups; and on a shard of the buffer (an origin off the
    groups' starts)."""
    with fp4_grouped_gemm.handler_replaced_by(_emulated_call):
        _check_native_path(form, dtype)


def _check_native_path(form, dtype):
    twin, operands, sizes = FORMS[form]
    args = list(operands(sizes, seed=12, exact=True))
    got = _body(form, "native_fp4", dtype)(*args, _origin())
    want = jax.jit(functools.partial(twin, dtype=dtype))(*args)
    used = sum(sizes)  # rows past the groups are unspecified
    _bits_equal(
        got[:used] if form == "rows" else got, want[:used] if form == "rows" else want
    )
    start, stop = (24, 64) if form == "rows" else (3, 6)
    if form == "rows":
        args[0], args[1] = args[0][:, start:stop], args[1][:, start:stop]
    else:
        for i in (0, 1, 3, 4):
            args[i] = args[i][start:stop]
    got = _body(form, "native_fp4", dtype)(*args, _origin(start))
    want = jax.jit(functools.partial(twin, dtype=dtype))(*args, _origin(start))
    if form == "rows":
        got, want = got[: used - start], want[: used - start]
    _bits_equal(got, want)
    if form == "tokens":
        assert not np.asarray(got[1], np.float32).any()  # the empty group


def test_supported_needs_its_target_and_a_blackwell_gpu(monkeypatch):
    """The native grouped path needs its own target registered besides the
    2-D native GEMM's, FP4 tensor cores, and JAX_NVFP4_NATIVE_GEMM on."""
    gpu = types.SimpleNamespace(platform="gpu", compute_capability="10.0")
    hopper = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
    both = {"cuda": frozenset({fp4_gemm.TARGET, fp4_grouped_gemm.TARGET})}
    monkeypatch.setattr(library, "registered_targets", lambda: both)
    assert fp4_grouped_gemm.supported(gpu)
    assert not fp4_grouped_gemm.supported(hopper)
    assert dispatch.grouped_path([gpu]) == "native_fp4"
    with config.override(native_gemm=False):  # the dispatcher's switch
        assert dispatch.grouped_path([gpu]) != "native_fp4"
    only_2d = {"cuda": frozenset({fp4_gemm.TARGET})}
    monkeypatch.setattr(library, "registered_targets", lambda: only_2d)
    assert not fp4_grouped_gemm.supported(gpu)
    assert not fp4_grouped_gemm.supported()  # this process: no CUDA devices
