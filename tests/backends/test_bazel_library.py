"""Runs when JAX_NVFP4_FFI_LIBRARY points at the Bazel-built CPU library
(.ci/run does this): the handlers come from there and agree with the reference."""

import functools
import os

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_same_bytes, on_cpu, outlier_data

import jax_nvfp4 as nv

LIBRARY = os.environ.get("JAX_NVFP4_FFI_LIBRARY")
pytestmark = pytest.mark.skipif(
    not LIBRARY, reason="set JAX_NVFP4_FFI_LIBRARY to a Bazel-built library"
)


def test_bazel_library_handlers_match_reference():
    from jax_nvfp4.backends import library

    assert library.handler_source() == LIBRARY
    x = outlier_data(0, (32, 64), jnp.bfloat16)
    key = jax.random.key(0)
    for kw in (
        dict(),
        dict(block="16x16", rht=True),
        dict(axis=0, rounding="stochastic", key=key),
    ):
        got = on_cpu(functools.partial(nv.quantize, **kw), x)
        want = on_cpu(
            functools.partial(nv.quantize, implementation="reference", **kw), x
        )
        assert_same_bytes(got, want)
