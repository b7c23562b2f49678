"""Compiling ahead of time for an H200 on a machine without a GPU (XLA's GPU
compiler through the CUDA PJRT plugin and benchmarks/h200_target.pbtxt):
the GEMMs chosen are the H200's, and an undifferentiated forward pass on
FP4 codes has no amax kernel of its own. Skipped without the plugin or the extension's
CUDA handlers; the plugin compiles without a GPU under JAX_PLATFORMS=cpu
(the test suite's setting)."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4 import config
from jax_nvfp4.backends import bf16_gemm, library, w4a16_gemm

TARGET_CONFIG = os.path.join(
    os.path.dirname(__file__), "..", "benchmarks", "h200_target.pbtxt"
)


@pytest.fixture(scope="module")
def h200():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is attached: the tests that run on it cover this")
    if "cuda" not in nv.available_platforms():
        pytest.skip("the extension was built without its CUDA handlers")
    from jax.experimental import topologies

    with open(TARGET_CONFIG) as f:
        target = f.read()
    try:
        topology = topologies.get_topology_desc(
            "h200", "cuda", target_config=target, topology="1x1x1"
        )
    except Exception as e:  # no CUDA PJRT plugin installed
        pytest.skip(f"no ahead-of-time GPU compiler: {e}")
    return jax.sharding.SingleDeviceSharding(topology.devices[0])


def _targets(fn, *args):
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return re.findall(r'custom_call_target="([^"]+)"', hlo)


def _abstract(sharding, shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def test_serving_matmul_takes_the_engine(h200):
    w = nv.quantize(jnp.asarray(np.random.default_rng(0).normal(size=(512, 1024))))
    w = jax.tree.map(lambda a: _abstract(h200, a.shape, a.dtype), w)
    x = _abstract(h200, (16, 1024))
    assert _targets(lambda x, w: nv.matmul(x, w), x, w) == [w4a16_gemm.ENGINE_TARGET]


def test_serving_ragged_dot_takes_the_grouped_engine(h200):
    experts = jax.vmap(nv.quantize)(
        jnp.asarray(np.random.default_rng(1).normal(size=(4, 512, 1024)))
    )
    experts = jax.tree.map(lambda a: _abstract(h200, a.shape, a.dtype), experts)
    x = _abstract(h200, (64, 1024))
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=h200)
    targets = _targets(lambda x, w, s: nv.ragged_dot(x, w, s), x, experts, sizes)
    assert targets == [w4a16_gemm.RAGGED_ENGINE_TARGET]


def test_recipe_gemms_and_amax(h200):
    """The dense GEMM is cuBLASLt's on the decoded operands; the training
    step has the transformed amax, the evaluation step has none."""
    if bf16_gemm.TARGET not in library.targets_on("cuda"):
        pytest.skip("the extension was built without cuBLASLt")
    x, w = _abstract(h200, (256, 512)), _abstract(h200, (512, 256))
    key = jax.random.key(0)

    def forward(x, w):
        return nv.dot(x, w, key=key)

    def step(x, w):
        loss = lambda x, w: jnp.sum(forward(x, w))  # noqa: E731
        return jax.value_and_grad(loss, (0, 1))(x, w)

    with config.override(gemm_operands="decoded"):
        evaluation, training = _targets(forward, x, w), _targets(step, x, w)
    with config.override(gemm_operands="codes"):
        on_codes = _targets(forward, x, w)
    assert bf16_gemm.GRAPH_TARGET in evaluation
    assert training.count(bf16_gemm.GRAPH_TARGET) == 3  # FPROP, DGRAD, WGRAD
    assert "jax_nvfp4_amax" in training
    # On decoded operands an evaluation keeps the fused pass that writes x's
    # rows; on codes it quantizes FPROP's operands alone, with the plain amax.
    assert "jax_nvfp4_quantize_rows_cols" in evaluation
    assert "jax_nvfp4_amax" not in on_codes
    assert "jax_nvfp4_quantize_rows_cols" not in on_codes


def test_quantize_dequantize_and_grouped_step(h200):
    """quantize, dequantize, dot_general and ragged_dot's training step
    compile for the H200 with its handlers."""
    x = _abstract(h200, (64, 256))
    round_trip = _targets(lambda x: nv.dequantize(nv.quantize(x, rht=True)), x)
    assert "jax_nvfp4_quantize_rows" in round_trip
    assert "jax_nvfp4_dequantize" in round_trip

    key = jax.random.key(0)
    dims = (((1,), (1,)), ((), ()))
    w_nk = _abstract(h200, (128, 256))
    general = _targets(lambda x, w: nv.dot_general(x, w, dims, key=key), x, w_nk)
    assert bf16_gemm.GRAPH_TARGET in general

    experts = _abstract(h200, (4, 256, 128))
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=h200)

    def grouped_step(x, w, sizes):
        loss = lambda x, w: jnp.sum(nv.ragged_dot(x, w, sizes, key=key))  # noqa: E731
        return jax.value_and_grad(loss, (0, 1))(x, w)

    with config.override(gemm_operands="decoded"):
        grouped = _targets(grouped_step, x, experts, sizes)
    assert "jax_nvfp4_grouped_gemm_sm90" in grouped
