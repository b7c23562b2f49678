"""Shared by the GEMM tests: problem cases, random operands, and the exact
float64 result with its float32-accumulation bound."""

import types

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_nvfp4.format import e2m1_decode_table

MIB32 = 32 * 1024 * 1024

# (batch, M, N, K, b batch, per-item a amax, per-item b amax): M and N odd or
# unaligned, K a multiple of 16. Together they cover the handler's three call
# plans: items stacked along M (one alpha, shared b), a strided batch (one
# alpha, b per item) and one call per item (one alpha per item).
CASES = [
    (1, 37, 53, 48, 1, False, False),
    (3, 29, 71, 80, 1, False, False),
    (3, 29, 71, 80, 3, False, False),
    (2, 33, 17, 64, 1, True, False),
    (4, 19, 45, 32, 4, True, True),
    (2, 128, 256, 256, 2, False, True),
]


def fake_device(platform, capability):
    return types.SimpleNamespace(platform=platform, compute_capability=capability)


def random_operands(seed, batch, m, n, k, b_batch, a_per_item, b_per_item):
    """Random codes, non-negative E4M3 scale bytes (0x00-0x7E) and amaxes."""
    rng = np.random.default_rng(seed)

    def side(items, rows, per_item):
        codes = rng.integers(0, 256, (items, rows, k // 2), dtype=np.uint8)
        scales = rng.integers(0, 0x7F, (items, rows, k // 16), dtype=np.uint8)
        amax = rng.uniform(0.5, 40.0, items if per_item else 1).astype(np.float32)
        return (
            jnp.asarray(codes),
            jnp.asarray(scales).view(jnp.float8_e4m3fn),
            jnp.asarray(amax),
        )

    return (*side(batch, m, a_per_item), *side(b_batch, n, b_per_item))


def decode64(codes, scales):
    """e2m1(code) * block scale in float64: [.., rows, K]."""
    codes = np.asarray(codes)
    nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(
        *codes.shape[:-1], -1
    )
    values = e2m1_decode_table().astype(np.float64)[nibbles]
    scales = np.asarray(scales).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return values * np.repeat(scales, 16, axis=-1)


def alpha64(a_amax, b_amax, batch):
    """alpha per item as the handlers compute it: float32 IEEE division in the
    spec's order, broadcast over the batch."""
    r = np.float32(2688.0)
    a = np.broadcast_to(np.asarray(a_amax, np.float32).reshape(-1), (batch,))
    b = np.broadcast_to(np.asarray(b_amax, np.float32).reshape(-1), (batch,))
    return (a / r) * (b / r)


def exact_result(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax):
    """The spec in float64 (alpha as float32), and a bound on the error of any
    float32 accumulation order: 2 K 2^-24 sum_k |a b| alpha, with a margin,
    plus the rounding of alpha * acc to float32."""
    a = decode64(a_codes, a_scales)
    b = decode64(b_codes, b_scales)
    b = np.broadcast_to(b, (a.shape[0], *b.shape[1:]))
    alpha = alpha64(a_amax, b_amax, a.shape[0]).astype(np.float64)[:, None, None]
    exact = np.einsum("bmk,bnk->bmn", a, b) * alpha
    mag = np.einsum("bmk,bnk->bmn", np.abs(a), np.abs(b)) * alpha
    bound = 2 * a.shape[-1] * 2.0**-24 * mag * 1.01 + np.abs(exact) * 2.0**-23
    return exact, bound


def assert_within(got, exact, bound, dtype):
    """float32: |got - exact| <= bound. bfloat16: got is the rounding of a
    float32 within the bound, so (rounding being monotonic) it lies between
    the roundings of exact - bound and exact + bound."""
    got = np.asarray(got).astype(np.float64)
    if np.dtype(dtype) == np.float32:
        assert np.all(np.abs(got - exact) <= bound)
        return

    def to_bf16(x):
        return x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)

    assert np.all(to_bf16(exact - bound) <= got)
    assert np.all(got <= to_bf16(exact + bound))
