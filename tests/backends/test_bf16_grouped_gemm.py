"""ragged_dot's grouped GEMM (backends/bf16_grouped_gemm.py): each CUDA kernel
(the Hopper engine, the mma.sync handler) against the pure-JAX twin, the twin
against a per-group loop, and the engine's token lines.

Integer-valued operands make every float32 sum exact, so results that may
differ only by summation order must be bit-identical."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import has_gpu

from jax_nvfp4.backends import bf16_grouped_gemm

# Buffer sizes per group (multiples of 16): empty groups, one group past a
# 128-row tile, groups off tile multiples; rows past the groups at the end.
SIZES = {
    "unbalanced": (48, 0, 160, 16, 0, 272),
    "one_group": (0, 512, 0),
    "tail_rows": (32, 64),
}
RESULT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _integers(seed, shape, low=-4, high=5):
    values = np.random.default_rng(seed).integers(low, high, shape)
    return jnp.asarray(values, jnp.bfloat16)


def _alpha(groups, seed=7):
    """Powers of two (exact products with any sum)."""
    exponents = np.random.default_rng(seed).integers(-3, 4, groups)
    return jnp.asarray(2.0**exponents, jnp.float32)


def _rows_operands(sizes, length, n, seed=0):
    rows = sum(sizes) + 48
    a = _integers(seed, (rows, length))
    b = _integers(seed + 1, (len(sizes), n, length))
    return a, b, jnp.asarray(sizes, jnp.int32), _alpha(len(sizes))


def _tokens_operands(sizes, m, n, seed=0):
    items = sum(sizes) // 16 + 2
    a = _integers(seed, (items, m, 16))
    b = _integers(seed + 1, (items, n, 16))
    return a, b, jnp.asarray(sizes, jnp.int32), _alpha(len(sizes))


def _group_rows(sizes):
    """(group, first row, end row) of every non-empty group."""
    start, out = 0, []
    for g, size in enumerate(sizes):
        if size:
            out.append((g, start, start + size))
        start += size
    return out


@pytest.mark.parametrize("case", sorted(SIZES))
def test_twin_rows_is_a_per_group_loop(case):
    sizes = SIZES[case]
    a, b, s, alpha = _rows_operands(sizes, 48, 40)
    got = np.asarray(bf16_grouped_gemm.rows(a, b, s, alpha, jnp.float32, kernel="xla"))
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    for g, start, end in _group_rows(sizes):
        want = a32[start:end] @ b32[g].T * np.float32(alpha[g])
        np.testing.assert_array_equal(got[start:end], want)
    np.testing.assert_array_equal(got[sum(sizes) :], 0)


@pytest.mark.parametrize("case", sorted(SIZES))
def test_twin_tokens_is_a_per_group_loop(case):
    sizes = SIZES[case]
    a, b, s, alpha = _tokens_operands(sizes, 32, 48)
    got = np.asarray(
        bf16_grouped_gemm.tokens(a, b, s, alpha, jnp.float32, kernel="xla")
    )
    tokens_a = np.asarray(jnp.swapaxes(a, 1, 2).reshape(-1, 32), np.float32)
    tokens_b = np.asarray(jnp.swapaxes(b, 1, 2).reshape(-1, 48), np.float32)
    for g, size in enumerate(sizes):
        start = sum(sizes[:g])
        want = tokens_a[start : start + size].T @ tokens_b[start : start + size]
        np.testing.assert_array_equal(got[g], want * np.float32(alpha[g]))


def test_token_lines_put_four_items_to_a_line_each_group_from_a_new_line():
    sizes = (48, 0, 160, 16, 0, 272)  # items 3, 0, 10, 1, 0, 17
    items = sum(sizes) // 16 + 2  # two items past the groups
    values = _integers(3, (items, 5, 16))
    lines = np.asarray(bf16_grouped_gemm.token_lines(values, jnp.asarray(sizes)))
    counts = [s // 16 for s in sizes]
    assert lines.shape == (-(-(items + 3 * len(sizes)) // 4), 5, 64)
    want = np.zeros(lines.shape, np.float32)
    item, line = 0, 0
    for count in counts:
        for i in range(count):  # item i of the group: line + i // 4, slot i % 4
            want[line + i // 4, :, 16 * (i % 4) : 16 * (i % 4 + 1)] = values[item + i]
        item, line = item + count, line + -(-count // 4)
    np.testing.assert_array_equal(lines.astype(np.float32), want)


def test_kernel_names_are_checked():
    a, b, s, alpha = _rows_operands((16,), 16, 8)
    with pytest.raises(ValueError, match="kernel must be one of"):
        bf16_grouped_gemm.rows(a, b, s, alpha, jnp.float32, kernel="cublas")


def _kernels_here():
    """The CUDA kernels this machine runs for these tests' shapes."""
    if not has_gpu():
        return []
    kernels = []
    if bf16_grouped_gemm.engine_supported(groups=len(SIZES["unbalanced"]), n=40):
        kernels.append("engine")
    if bf16_grouped_gemm.handler_supported():
        kernels.append("mma")
    return kernels


KERNELS_HERE = _kernels_here()
needs_handler = pytest.mark.skipif(
    not KERNELS_HERE, reason="needs a CUDA grouped GEMM handler on a GPU"
)
each_kernel = pytest.mark.parametrize(
    "kernel", KERNELS_HERE or ["none"], ids=lambda k: f"kernel={k}"
)


@needs_handler
@pytest.mark.gpu
@each_kernel
@pytest.mark.parametrize("dtype", RESULT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("length,n", [(48, 40), (256, 384), (1040, 136)])
def test_handler_rows_equals_twin(case, dtype, length, n, kernel):
    sizes = SIZES[case]
    a, b, s, alpha = _rows_operands(sizes, length, n, seed=len(case))
    got = jax.jit(
        bf16_grouped_gemm.rows, static_argnums=(4,), static_argnames="kernel"
    )(a, b, s, alpha, dtype, kernel=kernel)
    want = bf16_grouped_gemm.rows(a, b, s, alpha, dtype, kernel="xla")
    rows = sum(sizes)  # the handler leaves rows past the groups unwritten
    np.testing.assert_array_equal(
        np.asarray(got[:rows], np.float32), np.asarray(want[:rows], np.float32)
    )


@needs_handler
@pytest.mark.gpu
@each_kernel
@pytest.mark.parametrize("dtype", RESULT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("m,n", [(32, 48), (384, 256), (144, 1040)])
def test_handler_tokens_equals_twin(case, dtype, m, n, kernel):
    sizes = SIZES[case]
    a, b, s, alpha = _tokens_operands(sizes, m, n, seed=len(case))
    got = jax.jit(
        bf16_grouped_gemm.tokens, static_argnums=(4,), static_argnames="kernel"
    )(a, b, s, alpha, dtype, kernel=kernel)
    want = bf16_grouped_gemm.tokens(a, b, s, alpha, dtype, kernel="xla")
    np.testing.assert_array_equal(
        np.asarray(got, np.float32), np.asarray(want, np.float32)
    )


@needs_handler
@pytest.mark.gpu
@each_kernel
def test_handler_on_real_values_is_within_float32_summation_order(kernel):
    """Random bf16 values: sums differ from the twin's by accumulation order
    only (|error| <= L * 2^-23 * sum |terms|)."""
    sizes = SIZES["unbalanced"]
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (sum(sizes) + 16, 2048), jnp.bfloat16)
    b = jax.random.normal(key_b, (len(sizes), 256, 2048), jnp.bfloat16)
    s, alpha = jnp.asarray(sizes, jnp.int32), _alpha(len(sizes))
    got = np.asarray(bf16_grouped_gemm.rows(a, b, s, alpha, jnp.float32, kernel=kernel))
    want = np.asarray(bf16_grouped_gemm.rows(a, b, s, alpha, jnp.float32, kernel="xla"))
    rows = sum(sizes)
    a32 = np.abs(np.asarray(a, np.float32))
    b32 = np.abs(np.asarray(b, np.float32))
    for g, start, end in _group_rows(sizes):
        bound = 2048 * 2**-23 * (a32[start:end] @ b32[g].T) * float(alpha[g])
        assert (np.abs(got[start:end] - want[start:end]) <= bound).all()
    assert np.isfinite(got[:rows]).all()


@needs_handler
@pytest.mark.gpu
@each_kernel
def test_handler_keeps_a_nan_in_its_group(kernel):
    """A NaN in one group's weight reaches that group's rows only (XLA's
    masked dense expansion spreads it to every row)."""
    sizes = SIZES["unbalanced"]
    a, b, s, alpha = _rows_operands(sizes, 48, 40)
    b = b.at[2, 5, 7].set(jnp.nan)
    got = np.asarray(bf16_grouped_gemm.rows(a, b, s, alpha, jnp.float32, kernel=kernel))
    start, end = 48, 48 + 160  # group 2
    assert np.isnan(got[start:end, 5]).all()
    assert np.isfinite(np.delete(got[start:end], 5, 1)).all()
    assert np.isfinite(np.delete(got[: sum(sizes)], np.s_[start:end], 0)).all()


@needs_handler
@pytest.mark.gpu
@each_kernel
def test_handler_keeps_a_nan_token_in_its_group(kernel):
    """The tokens form: a NaN in one group's token reaches that group's
    weight gradient only, though the engine's lines pack groups' items."""
    sizes = SIZES["unbalanced"]
    a, b, s, alpha = _tokens_operands(sizes, 32, 48)
    a = a.at[3 + 2, 4, 9].set(jnp.nan)  # group 2's third item
    got = np.asarray(
        bf16_grouped_gemm.tokens(a, b, s, alpha, jnp.float32, kernel=kernel)
    )
    assert np.isnan(got[2, 4]).all()
    assert np.isfinite(np.delete(got[2], 4, 0)).all()
    assert np.isfinite(np.delete(got, 2, 0)).all()


@pytest.mark.gpu
@pytest.mark.skipif("engine" not in KERNELS_HERE, reason="needs the Hopper engine")
@pytest.mark.parametrize("form", ["rows", "tokens"])
def test_engine_keeps_sizes_past_the_buffer_inside_it(form):
    """Group sizes (read on the device) that add up past the buffer: the
    groups are cut off at its end; no read or write outside it."""
    sizes = (32, 64, 4096)
    if form == "rows":
        a, b, s, alpha = _rows_operands((32, 64), 48, 40)  # 144 rows
        got = bf16_grouped_gemm.rows(
            a,
            b[:1].repeat(3, 0),
            jnp.asarray(sizes),
            alpha[:1].repeat(3),
            jnp.float32,
            kernel="engine",
        )
        want = bf16_grouped_gemm.rows(
            a,
            b[:1].repeat(3, 0),
            jnp.asarray((32, 64, 48)),
            alpha[:1].repeat(3),
            jnp.float32,
            kernel="xla",
        )
    else:
        a, b, s, alpha = _tokens_operands((32, 64), 32, 48)  # 8 items
        got = bf16_grouped_gemm.tokens(
            a, b, jnp.asarray(sizes), alpha[:1].repeat(3), jnp.float32, kernel="engine"
        )
        want = bf16_grouped_gemm.tokens(
            a,
            b,
            jnp.asarray((32, 64, 32)),
            alpha[:1].repeat(3),
            jnp.float32,
            kernel="xla",
        )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@needs_handler
@pytest.mark.gpu
@each_kernel
def test_handler_under_vmap_is_a_loop(kernel):
    sizes = SIZES["tail_rows"]
    a, b, s, alpha = _rows_operands(sizes, 48, 40)
    a2 = jnp.stack([a, a[::-1]])

    def rows(x):
        return bf16_grouped_gemm.rows(x, b, s, alpha, jnp.float32, kernel=kernel)

    got = jax.vmap(rows)(a2)
    for i in range(2):
        np.testing.assert_array_equal(got[i][:96], rows(a2[i])[:96])


@needs_handler
@pytest.mark.gpu
@each_kernel
def test_handler_refuses_malformed_operands(kernel):
    a, b, s, alpha = _rows_operands((16, 16), 48, 40)
    target = {
        "engine": bf16_grouped_gemm.ENGINE_TARGET,
        "mma": bf16_grouped_gemm.TARGET,
    }
    with pytest.raises(Exception, match=target[kernel].removeprefix("jax_nvfp4_")):
        jax.ffi.ffi_call(
            target[kernel],
            jax.ShapeDtypeStruct((a.shape[0], 40), jnp.float32),
        )(a[:, :40], b, s, alpha, tokens=False).block_until_ready()
