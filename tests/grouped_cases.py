"""Shared by the grouped GEMM tests (and the sharding checks): buffer group
sizes and random operands of the two forms of ``ops.grouped_matmul``."""

import jax.numpy as jnp
import numpy as np

# Group sizes in the buffer: unaligned rows (the rows form takes any), an
# empty group, all rows in one group, no rows at all; rows past the groups.
ROWS = {"unaligned": (20, 0, 33, 17), "one_group": (0, 48, 0), "none": (0, 0)}
# The tokens form: multiples of 16; items past the groups.
TOKENS = {"unbalanced": (32, 0, 48, 16), "one_group": (0, 64, 0), "none": (0, 0)}
L, M, N = 48, 24, 40
# E4M3 bytes of 1/4 .. 4: with them every sum below is exact in float32, so
# GEMMs that add in different orders agree bit for bit.
POW2_SCALES = np.array([0x28, 0x30, 0x38, 0x40, 0x48], np.uint8)
DTYPES = [jnp.float32, jnp.bfloat16]


def _side(rng, lead, rows, length, exact):
    codes = rng.integers(0, 256, (lead, rows, length // 2), dtype=np.uint8)
    shape = (lead, rows, length // 16)
    if exact:
        scales = rng.choice(POW2_SCALES, shape)
    else:
        scales = rng.integers(0, 0x7F, shape, dtype=np.uint8)
    return jnp.asarray(codes), jnp.asarray(scales).view(jnp.float8_e4m3fn)


def _amax(rng, count):
    return jnp.asarray(rng.uniform(0.5, 40.0, count), jnp.float32)


def rows_operands(sizes, seed=0, *, exact=False, extra=16, length=L, n=N):
    """a [1, R, L] (R = the groups' rows + extra), b [G, N, L], amaxes, sizes."""
    rng = np.random.default_rng(seed)
    a = _side(rng, 1, sum(sizes) + extra, length, exact)
    b = _side(rng, len(sizes), n, length, exact)
    count = len(sizes)
    sizes = jnp.asarray(sizes, jnp.int32)
    return (*a, _amax(rng, count), *b, _amax(rng, count), sizes)


def tokens_operands(sizes, seed=0, *, exact=False, extra=2, m=M, n=N):
    """a [items, M, 16], b [items, N, 16] (16 tokens per item), amaxes, sizes."""
    rng = np.random.default_rng(seed)
    items = sum(sizes) // 16 + extra
    a = _side(rng, items, m, 16, exact)
    b = _side(rng, items, n, 16, exact)
    count = len(sizes)
    sizes = jnp.asarray(sizes, jnp.int32)
    return (*a, _amax(rng, count), *b, _amax(rng, count), sizes)
