"""The grouped GEMM primitives (jax_nvfp4.ops.grouped_matmul): each form
against its twin (reference.grouped_matmul_rows / _tokens) bit for bit on
the CPU (these tests run on the CPU device, whatever the default: they
check the CPU lowering's contract), on a GPU within the float32 summation
bound; decoded operands, non-finite blocks, vmap; every GEMM path's body
called directly (xla_ragged; native_fp4 on an emulation of its handler),
and the custom calls each path lowers to for "cuda"; the dispatcher's
choice. Sharding: tests/ops/test_grouped_matmul_sharding.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gemm_cases import fake_device
from grouped_cases import DTYPES, ROWS, TOKENS, rows_operands, tokens_operands

from jax_nvfp4 import config, ops, reference
from jax_nvfp4.backends import (
    bf16_grouped_gemm,
    devices,
    fp4_gemm,
    fp4_grouped_gemm,
    library,
)
from jax_nvfp4.ops import dispatch, grouped_matmul

FORMS = {
    "rows": (ops.grouped_matmul_rows, reference.grouped_matmul_rows, rows_operands),
    "tokens": (
        ops.grouped_matmul_tokens,
        reference.grouped_matmul_tokens,
        tokens_operands,
    ),
}


@pytest.fixture(autouse=True)
def _cpu_device(request):
    """The CPU lowering's contract (bit-exact, rows past the groups zero):
    on the CPU device; tests marked gpu run on the default device."""
    if "gpu" in request.keywords:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _jit(fn, dtype):
    return jax.jit(functools.partial(fn, dtype=dtype))


def _bits_equal(a, b):
    np.testing.assert_array_equal(
        np.asarray(a, np.float32), np.asarray(b, np.float32), strict=True
    )


def _decoded(codes, scales):
    return reference.decode_bf16(codes, scales)


def _group_of_rows(sizes, rows):
    ends = np.cumsum(sizes)
    return np.searchsorted(ends, np.arange(rows), side="right")


# --- the primitives against their twins ---------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
    "form, case",
    [("rows", c) for c in sorted(ROWS)] + [("tokens", c) for c in sorted(TOKENS)],
)
def test_primitive_equals_twin(form, case, dtype):
    prim, twin, operands = FORMS[form]
    args = operands((ROWS if form == "rows" else TOKENS)[case], seed=len(case))
    got = _jit(prim, dtype)(*args)
    want = _jit(twin, dtype)(*args)
    assert got.dtype == jnp.dtype(dtype)
    _bits_equal(got, want)
    if form == "tokens":  # an empty group's result is exactly zero
        for g, size in enumerate(np.asarray(args[-1])):
            if size == 0:
                assert not np.any(np.asarray(got[g], np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("form", sorted(FORMS))
def test_gpu_primitive_within_float32_bound_of_twin(form):
    """On a GPU (the dispatcher's grouped GEMM): each group's results equal
    the twin's within the float32 summation bound (another order); rows past
    the groups are not the primitive's (unspecified there)."""
    prim, twin, operands = FORMS[form]
    sizes = ROWS["unaligned"] if form == "rows" else TOKENS["unbalanced"]
    args = operands(sizes, seed=11)
    got = np.asarray(_jit(prim, jnp.float32)(*args), np.float64)
    cpu = jax.devices("cpu")[0]
    want = np.asarray(_jit(twin, jnp.float32)(*jax.device_put(args, cpu)), np.float64)
    # |sum| <= sum |a||b|: the bound of a float32 sum of L products.
    if form == "rows":
        a = np.abs(np.asarray(reference.decode_bf16(args[0], args[1])[0], np.float64))
        b = np.abs(np.asarray(reference.decode_bf16(args[3], args[4]), np.float64))
        rows = int(np.sum(sizes))
        group = _group_of_rows(sizes, rows)
        magnitude = np.stack([a[r] @ b[g].T for r, g in enumerate(group)])
        r = np.float64(2688)
        alpha = (np.asarray(args[2]) / r) * (np.asarray(args[5]) / r)
        bound = magnitude * alpha[group][:, None] * a.shape[1] * 2.0**-23
        got, want = got[:rows], want[:rows]
    else:
        bound = np.abs(want) * 1e-4 + 1e-30
    assert np.all(np.abs(got - want) <= bound + np.abs(want) * 2.0**-23)


def test_rows_form_is_a_per_group_product():
    """The twin's meaning, against float64: row r of group g is alpha_g a[r]
    . b[g]^T (exact operands, so float32 is exact too); rows past the groups
    are zeros."""
    sizes = ROWS["unaligned"]
    args = rows_operands(sizes, seed=1, exact=True)
    got = np.asarray(_jit(ops.grouped_matmul_rows, jnp.float32)(*args))
    a = np.asarray(reference.decode_bf16(args[0], args[1])[0], np.float64)
    b = np.asarray(reference.decode_bf16(args[3], args[4]), np.float64)
    r = np.float32(2688)
    alpha = (np.asarray(args[2]) / r) * (np.asarray(args[5]) / r)
    group = _group_of_rows(sizes, a.shape[0])
    for row, g in enumerate(group):
        if g < len(sizes):
            want = (a[row] @ b[g].T).astype(np.float32) * alpha[g]
            np.testing.assert_array_equal(got[row], want)
        else:
            assert not got[row].any()


def test_tokens_form_is_a_per_group_product():
    sizes = TOKENS["unbalanced"]
    args = tokens_operands(sizes, seed=2, exact=True)
    got = np.asarray(_jit(ops.grouped_matmul_tokens, jnp.float32)(*args))

    def tokens(codes, scales):  # [items, F, 16] -> [tokens, F]
        values = np.asarray(reference.decode_bf16(codes, scales), np.float64)
        return np.swapaxes(values, 1, 2).reshape(-1, values.shape[1])

    a, b = tokens(args[0], args[1]), tokens(args[3], args[4])
    r = np.float32(2688)
    alpha = (np.asarray(args[2]) / r) * (np.asarray(args[5]) / r)
    start = 0
    for g, size in enumerate(sizes):
        want = (a[start : start + size].T @ b[start : start + size]).astype(np.float32)
        np.testing.assert_array_equal(got[g], want * alpha[g])
        start += size


@pytest.mark.parametrize("form", sorted(FORMS))
def test_decoded_operands_give_the_same_bits(form):
    """An operand holding its bfloat16 values (what the fused quantize
    writes for the GPUs' GEMMs) gives the codes' results, either side."""
    prim, _, operands = FORMS[form]
    sizes = ROWS["unaligned"] if form == "rows" else TOKENS["unbalanced"]
    args = list(operands(sizes, seed=3))
    want = _jit(prim, jnp.float32)(*args)
    for i in (0, 3):
        decoded = list(args)
        decoded[i] = _decoded(args[i], args[i + 1])
        _bits_equal(_jit(prim, jnp.float32)(*decoded), want)


def test_eager_call_equals_jit():
    args = rows_operands(ROWS["one_group"], seed=4)
    got = ops.grouped_matmul_rows(*args, dtype=jnp.bfloat16)
    _bits_equal(got, _jit(ops.grouped_matmul_rows, jnp.bfloat16)(*args))


def test_origin_places_the_rows():
    """A shard of the buffer's rows with its origin equals those rows of the
    whole (how each shard finds its rows' groups)."""
    args = rows_operands(ROWS["unaligned"], seed=5)
    whole = _jit(ops.grouped_matmul_rows, jnp.float32)(*args)
    for start, stop in [(0, 24), (24, 56), (56, 86)]:
        part = list(args)
        part[0], part[1] = args[0][:, start:stop], args[1][:, start:stop]
        got = jax.jit(lambda *a: ops.grouped_matmul_rows(*a, dtype=jnp.float32))(
            *part, jnp.asarray([start], jnp.int32)
        )
        _bits_equal(got, whole[start:stop])


def test_non_finite_block_stays_in_its_group():
    """A block marked non-finite (scale 0x7F) in b[2] makes group 2's rows
    NaN in that column only (rows form); one in a token item of group 2
    makes dw[2]'s row NaN only (tokens form)."""
    sizes = ROWS["unaligned"]
    args = list(rows_operands(sizes, seed=6))
    scales = np.asarray(args[4]).view(np.uint8).copy()
    scales[2, 7, 1] = 0x7F
    args[4] = jnp.asarray(scales).view(jnp.float8_e4m3fn)
    for fn in (ops.grouped_matmul_rows, reference.grouped_matmul_rows):
        out = np.asarray(_jit(fn, jnp.float32)(*args))
        bad = np.zeros(out.shape, bool)
        bad[20:53, 7] = True  # group 2's rows
        assert np.isnan(out[bad]).all() and np.isfinite(out[~bad]).all()

    sizes = TOKENS["unbalanced"]
    args = list(tokens_operands(sizes, seed=7))
    scales = np.asarray(args[1]).view(np.uint8).copy()
    scales[2, 5, 0] = 0x7F  # item 2 is group 2's first (items 0, 1: group 0)
    args[1] = jnp.asarray(scales).view(jnp.float8_e4m3fn)
    for fn in (ops.grouped_matmul_tokens, reference.grouped_matmul_tokens):
        out = np.asarray(_jit(fn, jnp.float32)(*args))
        bad = np.zeros(out.shape, bool)
        bad[2, 5, :] = True
        assert np.isnan(out[bad]).all() and np.isfinite(out[~bad]).all()


@pytest.mark.parametrize("form", sorted(FORMS))
def test_vmap_is_a_loop(form):
    prim, _, operands = FORMS[form]
    sizes = ROWS["unaligned"] if form == "rows" else TOKENS["unbalanced"]
    one, two = operands(sizes, seed=8), operands(sizes, seed=9)
    # b, its amaxes and the sizes mapped; a shared.
    stacked = [
        x if i in (0, 1, 2) else jnp.stack([x, y])
        for i, (x, y) in enumerate(zip(one, two, strict=True))
    ]
    dims = tuple(None if i in (0, 1, 2) else 0 for i in range(7))
    fn = functools.partial(prim, dtype=jnp.float32)
    got = jax.jit(jax.vmap(fn, in_axes=dims))(*stacked)
    for i, args in enumerate((one, (*one[:3], *two[3:]))):
        _bits_equal(got[i], jax.jit(fn)(*args))


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({0: jnp.zeros((1, 8, 24), jnp.float32)}, TypeError, "a_codes"),
        ({1: jnp.zeros((1, 8, 2), jnp.float8_e4m3fn)}, TypeError, "a_scales"),
        ({2: jnp.ones(3, jnp.float32)}, ValueError, "a_amax must have one value"),
        ({6: jnp.ones(2, jnp.float32)}, TypeError, "integers"),
        ({6: jnp.ones(3, jnp.int32)}, ValueError, "sizes must have one value"),
    ],
)
def test_bad_operands(change, error, match):
    args = list(rows_operands((8, 0), extra=0))
    for i, v in change.items():
        args[i] = v
    with pytest.raises(error, match=match):
        ops.grouped_matmul_rows(*args, dtype=jnp.float32)


def test_bad_tokens_operands():
    args = list(tokens_operands((16, 16)))
    args[3], args[4] = args[3][:1], args[4][:1]
    with pytest.raises(ValueError, match=r"a \[items, M, 16\] and b \[items, N"):
        ops.grouped_matmul_tokens(*args, dtype=jnp.float32)


# --- each GEMM path's body -------------------------------------------------------


def _body(form, path, dtype):
    return jax.jit(
        functools.partial(grouped_matmul.lowering_body(form, path), dtype=dtype)
    )


def _origin(start=0):
    return jnp.asarray([start], jnp.int32)


@pytest.mark.parametrize("dtype", [*DTYPES, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_xla_ragged_body_equals_twin(form, dtype):
    """XLA's ragged_dot_general on the decoded operands: the same exact
    products, float32 sums in another order; with operands whose sums are
    exact, the twin's bits (rows past the groups aside, which the GPUs'
    GEMMs leave unspecified)."""
    _, twin, operands = FORMS[form]
    sizes = ROWS["unaligned"] if form == "rows" else TOKENS["unbalanced"]
    args = operands(sizes, seed=10, exact=True)
    got = _body(form, "xla_ragged", dtype)(*args, _origin())
    want = _jit(twin, dtype)(*args)
    if form == "rows":
        got, want = got[: sum(sizes)], want[: sum(sizes)]
    _bits_equal(got, want)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_per_group_body_takes_a_shard_origin(form):
    """The CPU lowering's body and the xla_ragged body on a shard of the
    buffer (rows or items from an origin) equal that part of the whole."""
    _, twin, operands = FORMS[form]
    sizes = ROWS["unaligned"] if form == "rows" else TOKENS["unbalanced"]
    args = list(operands(sizes, seed=11, exact=True))
    whole = _jit(twin, jnp.float32)(*args)
    if form == "rows":
        start, stop = 24, 64
        args[0], args[1] = args[0][:, start:stop], args[1][:, start:stop]
        want = whole[start:stop]
    else:  # items 2..5: part of group 2, group 3 and past them
        start, stop = 2, 6
        for i in (0, 1, 3, 4):
            args[i] = args[i][start:stop]
        want = _jit(twin, jnp.float32)(*args, _origin(start))
    for path in ("per_group", "xla_ragged"):
        got = _body(form, path, jnp.float32)(*args, _origin(start))
        _bits_equal(got, want)


def test_lowering_body_names_its_choices():
    with pytest.raises(ValueError, match="paths"):
        grouped_matmul.lowering_body("rows", "cublaslt_bf16")


# --- the dispatcher and the CUDA lowering -------------------------------------------

BOTH = frozenset({bf16_grouped_gemm.TARGET, fp4_gemm.TARGET, fp4_grouped_gemm.TARGET})


ENGINE = BOTH | {bf16_grouped_gemm.ENGINE_TARGET}


def test_grouped_path_picks_the_engine_on_hopper_for_the_shapes_it_serves(
    monkeypatch,
):
    monkeypatch.setattr(library, "registered_targets", lambda: {"cuda": ENGINE})
    hopper, h20 = fake_device("gpu", "9.0"), fake_device("gpu", "9.0")
    path = dispatch.grouped_path
    assert path([hopper], groups=8, n=2048) == "engine"
    assert path([hopper, h20], groups=64, n=2) == "engine"
    assert path([hopper], groups=65, n=2048) == "bf16_handler"  # too many groups
    assert path([hopper], groups=8, n=2047) == "xla_ragged"  # no handler: N odd
    assert path([hopper]) == "bf16_handler"  # shapes unknown
    assert path([fake_device("gpu", "8.0")], groups=8, n=64) == "bf16_handler"
    assert path([fake_device("gpu", "10.0")], groups=8, n=64) == "native_fp4"
    assert path([hopper, fake_device("gpu", "8.0")], groups=8, n=64) == "bf16_handler"
    with config.override(gemm_engine=False):
        assert path([hopper], groups=8, n=2048) == "bf16_handler"
    with config.override(grouped_gemm=False):
        assert path([hopper], groups=8, n=2048) == "xla_ragged"


def test_grouped_path_by_capability_registration_switch_and_operands(monkeypatch):
    registered = {"cuda": BOTH}
    monkeypatch.setattr(library, "registered_targets", lambda: registered)
    blackwell, hopper = fake_device("gpu", "10.0"), fake_device("gpu", "9.0")
    path = dispatch.grouped_path
    assert path([blackwell]) == "native_fp4"
    assert path([blackwell], decoded=True) == "bf16_handler"
    assert path([hopper]) == "bf16_handler"
    assert path([fake_device("gpu", "7.5")]) == "xla_ragged"
    assert path([blackwell, hopper]) == "bf16_handler"  # every device qualifies
    assert path([]) == "xla_ragged"  # lowering for "cuda" without a GPU
    with config.override(native_gemm=False):
        assert path([blackwell]) == "bf16_handler"
    with config.override(grouped_gemm=False):
        assert path([hopper]) == "xla_ragged"
        assert path([blackwell]) == "native_fp4"
        assert path([blackwell], decoded=True) == "xla_ragged"
    registered["cuda"] = frozenset({fp4_gemm.TARGET, bf16_grouped_gemm.TARGET})
    assert path([blackwell]) == "bf16_handler"  # the grouped FP4 target missing
    del registered["cuda"]
    assert path([hopper]) == "xla_ragged"


def test_decoded_operands_asked_when_traced(monkeypatch):
    """On the CPU (not the default GPU backend) the quantize writes codes."""
    monkeypatch.setattr(library, "registered_targets", lambda: {"cuda": BOTH})
    monkeypatch.setattr(devices, "cuda_devices", lambda: (fake_device("gpu", "9.0"),))
    assert jax.default_backend() != "gpu" or dispatch.grouped_decoded_operands()
    if jax.default_backend() != "gpu":
        assert not dispatch.grouped_decoded_operands()


def _custom_calls(fn, args):
    """The custom calls of ``fn`` lowered for "cuda" (a fresh function: no
    lowering is reused from another device set)."""
    fresh = jax.jit(lambda *a: fn(*a))
    text = fresh.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [line for line in text.splitlines() if "stablehlo.custom_call" in line]


def _targets(calls):
    return [c.split("@", 1)[1].split("(", 1)[0] for c in calls]


# A build without CUDA warns, once, that it has no CUDA handlers.
@pytest.mark.filterwarnings("ignore::jax_nvfp4.MissingHandlersWarning")
@pytest.mark.parametrize("form", sorted(FORMS))
def test_cuda_lowering_calls_the_chosen_gemm(form, monkeypatch):
    """Lowered for "cuda", each form becomes the custom call of the path the
    dispatcher picks for the devices: one grouped FP4 launch on Blackwell,
    one bf16 grouped launch on Hopper (and for decoded operands on
    Blackwell), the engine's on Hopper where it is built, none where XLA's
    ragged_dot_general runs."""
    registered = {"cuda": BOTH}
    monkeypatch.setattr(library, "registered_targets", lambda: registered)
    gpus = [fake_device("gpu", "10.0")]
    monkeypatch.setattr(devices, "cuda_devices", lambda: tuple(gpus))
    prim, _, operands = FORMS[form]
    sizes = ROWS["unaligned"] if form == "rows" else TOKENS["unbalanced"]
    args = list(operands(sizes, seed=13))
    fn = functools.partial(prim, dtype=jnp.bfloat16)
    assert _targets(_custom_calls(fn, args)) == [fp4_grouped_gemm.TARGET]
    decoded = list(args)
    decoded[0] = _decoded(args[0], args[1])
    assert _targets(_custom_calls(fn, decoded)) == [bf16_grouped_gemm.TARGET]
    gpus[0] = fake_device("gpu", "9.0")
    assert _targets(_custom_calls(fn, args)) == [bf16_grouped_gemm.TARGET]
    registered["cuda"] = ENGINE
    assert _targets(_custom_calls(fn, args)) == [bf16_grouped_gemm.ENGINE_TARGET]
    with config.override(gemm_engine=False):
        assert _targets(_custom_calls(fn, args)) == [bf16_grouped_gemm.TARGET]
    with config.override(grouped_gemm=False):
        assert _custom_calls(fn, args) == []
    registered["cuda"] = frozenset()
    assert _custom_calls(fn, args) == []
