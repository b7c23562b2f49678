"""jax.export of a jitted NVFP4 training step: export_safety_checks lets it
serialize; the deserialized step gives the same bytes."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gemm_cases import fake_device
from jax import export

import jax_nvfp4 as nv
from jax_nvfp4.backends import (
    bf16_gemm,
    bf16_grouped_gemm,
    devices,
    fp4_gemm,
    fp4_grouped_gemm,
    library,
    w4a16_gemm,
)


def _step(x, w, key):
    def loss(w):
        return jnp.sum(nv.dot(x, w, key=key).astype(jnp.float32))

    return jax.value_and_grad(loss)(w)


def _args():
    x = jax.random.normal(jax.random.key(0), (48, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (64, 32), jnp.bfloat16)
    return x, w, jax.random.key(2)


def test_export_needs_the_safety_checks():
    with pytest.raises(ValueError, match="custom call"):
        export.export(jax.jit(_step))(*_args())


def test_exported_step_round_trips_with_the_same_bytes():
    args = _args()
    exported = export.export(jax.jit(_step), disabled_checks=nv.export_safety_checks())(
        *args
    )
    restored = export.deserialize(exported.serialize())
    got, want = restored.call(*args), jax.jit(_step)(*args)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape
        np.testing.assert_array_equal(
            np.asarray(g).reshape(-1).view(np.uint8),
            np.asarray(r).reshape(-1).view(np.uint8),
        )


def _targets_inc() -> set[str]:
    """The target names of the extension's own list, ffi/targets.inc."""
    text = (pathlib.Path(__file__).parent.parent / "ffi" / "targets.inc").read_text()
    return set(re.findall(r'^JAX_NVFP4_TARGET\("(\w+)"', text, re.M))


@pytest.mark.skipif(library.extension() is None, reason="needs the compiled extension")
def test_safety_checks_name_every_target():
    """One check per target of ffi/targets.inc, built on this machine or not
    (a CPU-only build exports modules lowered for CUDA too), and every
    target a Python backend names is in that list."""
    listed = _targets_inc()
    assert len(listed) > 10
    assert set(library.target_names()) == listed
    names = {str(c) for c in nv.export_safety_checks()}
    assert names == {f"custom_call:{target}" for target in listed}
    backends = (bf16_gemm, fp4_gemm, bf16_grouped_gemm, fp4_grouped_gemm, w4a16_gemm)
    for module in backends:
        for name in dir(module):
            if name.endswith("TARGET"):
                assert getattr(module, name) in listed, (module.__name__, name)


@pytest.mark.parametrize("tokens", ["t", "16*t"], ids=["t", "16t"])
def test_symbolic_token_dimension(tokens):
    """A shape-polymorphic token count exports once and runs at several sizes
    (multiples of 16 or not), giving the bytes of the step traced at each."""
    _, w, key = _args()
    x_spec = jax.ShapeDtypeStruct(export.symbolic_shape(f"{tokens}, 64"), jnp.bfloat16)
    exported = export.export(jax.jit(_step), disabled_checks=nv.export_safety_checks())(
        x_spec, w, key
    )
    restored = export.deserialize(exported.serialize())
    for n in (1, 3) if tokens == "16*t" else (16, 40):
        x = jax.random.normal(jax.random.key(n), (16 * n if tokens != "t" else n, 64))
        x = x.astype(jnp.bfloat16)
        got, want = restored.call(x, w, key), jax.jit(_step)(x, w, key)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(
                np.asarray(g, np.float32), np.asarray(r, np.float32)
            )


@pytest.mark.filterwarnings("ignore::jax_nvfp4.MissingHandlersWarning")
def test_multi_platform_export_keeps_the_portable_gemms(monkeypatch):
    """Exported for CUDA and the CPU at once, the GEMMs are the portable ones
    (XLA's dot on the decoded operands), even where this process has a
    Hopper GPU: the module must run on either platform."""
    monkeypatch.setattr(devices, "cuda_devices", lambda: (fake_device("gpu", "9.0"),))
    x, w, key = _args()
    w4 = nv.quantize(w.T)

    def serve_and_train(x, w, w4, key):
        return nv.matmul(x, w4), _step(x, w, key)

    exported = export.export(
        jax.jit(serve_and_train),
        platforms=("cuda", "cpu"),
        disabled_checks=nv.export_safety_checks(),
    )(x, w, w4, key)
    text = exported.mlir_module()
    gemm_targets = {
        bf16_gemm.TARGET,
        bf16_gemm.GRAPH_TARGET,
        fp4_gemm.TARGET,
        w4a16_gemm.TARGET,
        w4a16_gemm.ENGINE_TARGET,
    }
    assert not [t for t in gemm_targets if t in text]
    assert "jax_nvfp4_quantize" in text  # the quantize handlers of both platforms
