"""The bf16 decode primitive ``ops.decode_bf16`` (e2m1(code) * block scale,
exact, no amax): on the default device (the CUDA handler on a GPU) equal to
the float64 decode and to its twin on the CPU, under jit and vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import has_gpu, on_cpu
from gemm_cases import decode64

from jax_nvfp4 import ops, reference
from jax_nvfp4.backends import bf16_gemm, library


def _every_code_and_scale():
    """Every code byte with every scale byte: codes [256 scales, 256, 8]."""
    codes = np.broadcast_to(
        np.arange(256, dtype=np.uint8)[None, :, None], (256, 256, 8)
    )
    scales = np.broadcast_to(
        np.arange(256, dtype=np.uint8)[:, None, None], (256, 256, 1)
    )
    return jnp.asarray(codes), jnp.asarray(scales).view(jnp.float8_e4m3fn)


def _assert_same(got, want):
    """Equal bits; NaN (scale byte 0x7F or 0xFF) where the twin has NaN."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype == jnp.bfloat16 and got.shape == want.shape
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


def test_every_code_with_every_scale():
    codes, scales = _every_code_and_scale()
    got = jax.jit(ops.decode_bf16)(codes, scales)
    _assert_same(got, on_cpu(reference.decode_bf16, codes, scales))
    finite = np.asarray(scales).view(np.uint8)[:, 0, 0] & 0x7F != 0x7F
    np.testing.assert_array_equal(
        np.asarray(got, np.float64)[finite], decode64(codes, scales)[finite]
    )
    _assert_same(ops.decode_bf16(codes, scales), got)  # eager


@pytest.mark.parametrize("shape", [(3, 5, 24), (1, 7, 8), (2, 1, 4104), (1, 0, 8)])
def test_random_codes_and_scales(shape):
    rng = np.random.default_rng(sum(shape))
    codes = jnp.asarray(rng.integers(0, 256, shape, dtype=np.uint8))
    scale_bytes = rng.integers(0, 256, (*shape[:-1], shape[-1] // 8), dtype=np.uint8)
    scales = jnp.asarray(scale_bytes).view(jnp.float8_e4m3fn)
    got = jax.jit(ops.decode_bf16)(codes, scales)
    assert got.shape == (*shape[:-1], 2 * shape[-1])
    _assert_same(got, on_cpu(reference.decode_bf16, codes, scales))


def test_vmap():
    rng = np.random.default_rng(0)
    codes = jnp.asarray(rng.integers(0, 256, (4, 2, 3, 16), dtype=np.uint8))
    scales = jnp.asarray(rng.integers(0, 0x7F, (4, 2, 3, 2), dtype=np.uint8))
    scales = scales.view(jnp.float8_e4m3fn)
    want = jnp.stack(
        [ops.decode_bf16(c, s) for c, s in zip(codes, scales, strict=True)]
    )
    _assert_same(jax.vmap(ops.decode_bf16)(codes, scales), want)
    _assert_same(
        jax.vmap(ops.decode_bf16, (1, 1), 1)(codes, scales),
        jnp.stack([ops.decode_bf16(codes[:, i], scales[:, i]) for i in range(2)], 1),
    )
    shared = jax.vmap(ops.decode_bf16, (0, None))(codes, scales[0])
    _assert_same(shared[2], ops.decode_bf16(codes[2], scales[0]))


def test_checks_shapes():
    codes = jnp.zeros((2, 4, 8), jnp.uint8)
    with pytest.raises(ValueError, match=r"scales \[b, r, l/16\]"):
        ops.decode_bf16(codes, jnp.zeros((2, 4, 2), jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.decode_bf16(
            jnp.zeros((2, 4, 4), jnp.uint8), jnp.zeros((2, 4, 0), jnp.float8_e4m3fn)
        )
    with pytest.raises(ValueError, match=r"codes \[b, r, l/2\]"):
        ops.decode_bf16(jnp.zeros((4, 8), jnp.uint8), jnp.zeros((4, 1), jnp.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(
    not has_gpu()
    or bf16_gemm.DECODE_TARGET not in library.registered_targets().get("cuda", ()),
    reason="needs the CUDA decode handler",
)
def test_lowers_to_the_cuda_handler():
    codes, scales = _every_code_and_scale()
    text = jax.jit(ops.decode_bf16).lower(codes, scales).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and f"@{bf16_gemm.DECODE_TARGET}(" in calls[0]
