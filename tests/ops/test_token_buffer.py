"""The group-aligned token buffer (ops.token_buffer) on one device: every
group starts at a multiple of 16 rows, the inverse restores x with zeros past
the groups, and the buffer's size splits into the pieces a sharded token axis
needs. Its sharded form (halos between neighbouring shards, no all-gather) is
checked on virtual devices by tests/ops/test_grouped_matmul_sharding.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_nvfp4.ops import token_buffer

CASES = {
    "unaligned": (96, [10, 20, 30, 1]),
    "empty groups": (128, [0, 0, 100, 0, 3, 0, 0, 1]),
    "one group": (64, [64]),
    "past the sum": (80, [5, 17, 16]),
    "odd tokens": (37, [4, 30]),
}


def expected_buffer(x, sizes):
    """Group g's rows copied to the next multiple of 16 after group g-1's."""
    rows = token_buffer.buffer_rows(x.shape[0], len(sizes))
    out = np.zeros((rows, x.shape[1]), x.dtype)
    src = dst = 0
    for size in sizes:
        out[dst : dst + size] = x[src : src + size]
        src, dst = src + size, dst + -(-size // 16) * 16
    return out


@pytest.mark.parametrize("case", CASES)
def test_buffer_places_each_group_from_a_block_start(case):
    tokens, sizes = CASES[case]
    x = np.random.default_rng(0).standard_normal((tokens, 24)).astype(np.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(token_buffer.to_buffer)(x, sizes)
    np.testing.assert_array_equal(got, expected_buffer(x, np.asarray(sizes)))
    np.testing.assert_array_equal(token_buffer.to_buffer(x, sizes), got)  # eager


@pytest.mark.parametrize("case", CASES)
def test_from_buffer_is_the_inverse_with_zeros_past_the_groups(case):
    tokens, sizes = CASES[case]
    x = np.random.default_rng(1).standard_normal((tokens, 16)).astype(np.float32)
    x[3] = np.nan  # a NaN row stays where it was
    sizes = jnp.asarray(sizes, jnp.int32)
    back = jax.jit(lambda b: token_buffer.from_buffer(b, sizes, tokens=tokens))
    got = back(token_buffer.to_buffer(x, sizes))
    kept = np.arange(tokens)[:, None] < int(sizes.sum())
    np.testing.assert_array_equal(got, np.where(kept, x, 0))


@pytest.mark.parametrize("tokens", [16, 96, 1024, 65536, 37])
@pytest.mark.parametrize("groups", [1, 8, 64])
def test_buffer_rows_hold_every_layout_in_whole_pieces(tokens, groups):
    rows, pieces = token_buffer.buffer_rows(tokens, groups), token_buffer.pieces(tokens)
    # The padded sizes of any split of T into G groups fit.
    assert rows >= (tokens + 15 * groups) // 16 * 16
    assert rows % (16 * pieces) == 0
    assert tokens % 16 == 0 or pieces == 1
    if pieces > 1:
        assert (tokens // 16) % pieces == 0
    # The rounding to pieces adds fewer than 16 rows per piece.
    assert rows - max(16, (tokens + 15 * groups) // 16 * 16) < 16 * pieces


def test_vmap_is_a_loop_over_examples():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 64, 16)).astype(np.float32)
    sizes = jnp.asarray([[10, 20, 30], [0, 64, 0], [5, 5, 5]], jnp.int32)
    got = jax.vmap(token_buffer.to_buffer)(x, sizes)
    for i in range(3):
        np.testing.assert_array_equal(got[i], token_buffer.to_buffer(x[i], sizes[i]))
    back = jax.vmap(lambda b, s: token_buffer.from_buffer(b, s, tokens=64))(got, sizes)
    for i in range(3):
        np.testing.assert_array_equal(
            back[i], token_buffer.from_buffer(got[i], sizes[i], tokens=64)
        )
