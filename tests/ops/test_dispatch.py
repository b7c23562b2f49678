"""Which GEMM the matmul primitive lowers to on CUDA (jax_nvfp4.ops.matmul),
on CPU: by compute capability, registered handlers and switches; the one custom
call the primitive lowers to for "cuda"; the decode handler's shape checks."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gemm_cases import CASES, fake_device, random_operands

from jax_nvfp4 import config, ops, reference
from jax_nvfp4.backends import bf16_gemm, devices, fp4_gemm, library
from jax_nvfp4.ops import dispatch

BOTH = {"cuda": frozenset({bf16_gemm.TARGET, fp4_gemm.TARGET})}


# --- dispatch ------------------------------------------------------------------


def test_gemm_path_by_capability_registration_and_switch(monkeypatch):
    registered = dict(BOTH)
    monkeypatch.setattr(library, "registered_targets", lambda: registered)
    path = dispatch.dense_path
    assert path([fake_device("gpu", "10.0")]) == "native_fp4"
    assert path([fake_device("gpu", "12.0")]) == "native_fp4"
    assert path([fake_device("gpu", "9.0")]) == "cublaslt_bf16"
    assert (
        path([fake_device("gpu", "8.0"), fake_device("gpu", "8.9")]) == "cublaslt_bf16"
    )
    # Every device must qualify.
    assert (
        path([fake_device("gpu", "10.0"), fake_device("gpu", "9.0")]) == "cublaslt_bf16"
    )
    assert path([fake_device("gpu", "9.0"), fake_device("gpu", "7.5")]) == "xla_bf16"
    assert path([fake_device("gpu", "7.5")]) == "xla_bf16"
    assert path([fake_device("gpu", None)]) == "xla_bf16"  # e.g. ROCm
    assert path([fake_device("gpu", "gfx90a")]) == "xla_bf16"
    assert path(jax.devices("cpu")) == "xla_bf16"
    assert path([]) == "xla_bf16"  # lowering for "cuda" without a GPU
    # The settings in effect, read at each decision.
    with config.override(cublaslt_gemm=False):
        assert path([fake_device("gpu", "9.0")]) == "xla_bf16"
        assert path([fake_device("gpu", "10.0")]) == "native_fp4"
    with config.override(native_gemm=False):
        assert path([fake_device("gpu", "10.0")]) == "cublaslt_bf16"
        with config.override(cublaslt_gemm=False):
            assert path([fake_device("gpu", "10.0")]) == "xla_bf16"
        assert path([fake_device("gpu", "10.0")]) == "cublaslt_bf16"
    # Handlers that were not built.
    registered["cuda"] = frozenset({bf16_gemm.TARGET})
    assert path([fake_device("gpu", "10.0")]) == "cublaslt_bf16"
    registered["cuda"] = frozenset({fp4_gemm.TARGET})
    assert path([fake_device("gpu", "9.0")]) == "xla_bf16"
    del registered["cuda"]
    assert path([fake_device("gpu", "9.0")]) == "xla_bf16"
    assert not bf16_gemm.cublaslt_gemm_supported([fake_device("gpu", "9.0")])


def test_gemm_path_defaults_to_the_cuda_backend(monkeypatch):
    monkeypatch.setattr(library, "registered_targets", lambda: BOTH)
    monkeypatch.setattr(devices, "cuda_devices", lambda: ())
    assert dispatch.dense_path() == "xla_bf16"
    monkeypatch.setattr(devices, "cuda_devices", lambda: (fake_device("gpu", "9.0"),))
    assert dispatch.dense_path() == "cublaslt_bf16"
    assert bf16_gemm.cublaslt_gemm_supported()


def _lowering_context(platforms, axis_context):
    """As JAX builds it: a multi-platform module's CUDA rule sees its own
    platforms narrowed to ("cuda",), the module's as they are."""
    module = types.SimpleNamespace(platforms=platforms, axis_context=axis_context)
    return types.SimpleNamespace(platforms=["cuda"], module_context=module)


def test_lowering_devices_are_those_compiled_for(monkeypatch):
    """A lowering for "cuda" alone chooses for the GPUs the computation is
    compiled for (jit's device assignment, shard_map's mesh; e.g. an
    ahead-of-time topology without a GPU here), else for the CUDA backend's;
    a lowering for several platforms (export) for none."""
    hopper, blackwell = fake_device("gpu", "9.0"), fake_device("gpu", "10.0")
    monkeypatch.setattr(devices, "cuda_devices", lambda: (blackwell,))
    assigned = types.SimpleNamespace(device_assignment=(hopper, hopper))
    mesh = types.SimpleNamespace(mesh=types.SimpleNamespace(devices=np.array([hopper])))
    on_cpus = types.SimpleNamespace(device_assignment=tuple(jax.devices("cpu")))
    unnamed = types.SimpleNamespace(device_assignment=None)
    lowered = devices.lowering_devices
    assert lowered(_lowering_context(("cuda",), assigned)) == (hopper, hopper)
    assert lowered(_lowering_context(("cuda",), mesh)) == (hopper,)
    # Lowered for "cuda" from a process whose jit devices are CPUs (tests, or
    # jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))).
    assert lowered(_lowering_context(("cuda",), on_cpus)) == (blackwell,)
    assert lowered(_lowering_context(("cuda",), unnamed)) == (blackwell,)

    class AbstractMesh:  # names no devices
        @property
        def devices(self):
            raise ValueError("an abstract mesh has no devices")

    abstract = types.SimpleNamespace(device_assignment=None, mesh=AbstractMesh())
    assert lowered(_lowering_context(("cuda",), abstract)) == (blackwell,)
    assert lowered(_lowering_context(("cuda", "cpu"), assigned)) == ()


def test_operand_form_follows_the_setting(monkeypatch):
    """gemm_operands: "auto" asks for decoded operands only where the default
    backend is a GPU whose GEMM reads bfloat16 (so never on the CPU), for
    bfloat16 inputs; "codes" and "decoded" force a form, dense and grouped."""
    monkeypatch.setattr(library, "registered_targets", lambda: BOTH)
    monkeypatch.setattr(devices, "cuda_devices", lambda: (fake_device("gpu", "9.0"),))
    on_gpu = jax.default_backend() == "gpu"
    with config.override(gemm_operands="auto"):
        assert dispatch.decoded_operands(jnp.bfloat16) == on_gpu
        assert not dispatch.decoded_operands(jnp.float32)
        assert dispatch.grouped_decoded_operands() == on_gpu
    with config.override(gemm_operands="codes"):
        assert not dispatch.decoded_operands(jnp.bfloat16)
        assert not dispatch.grouped_decoded_operands()
    with config.override(gemm_operands="decoded"):
        assert dispatch.decoded_operands(jnp.bfloat16)
        assert dispatch.grouped_decoded_operands()
        with config.override(gemm_operands="auto"):  # the innermost wins
            assert dispatch.decoded_operands(jnp.bfloat16) == on_gpu


@pytest.mark.parametrize("decoded", [False, True])
@pytest.mark.parametrize("path", ["native_fp4", "cublaslt_bf16", "xla_bf16"])
def test_matmul_cuda_calls_the_chosen_gemm(monkeypatch, path, decoded):
    """Each path's GEMM gets the operands; a decoded operand (bf16 values,
    not codes) takes the bf16 GEMM on Blackwell too."""
    called = []

    def fake(name):
        def fn(*args, dtype, **options):
            called.append((name, len(args), np.dtype(dtype), options))
            return name

        return fn

    monkeypatch.setattr(dispatch, "dense_path", lambda: path)
    monkeypatch.setattr(fp4_gemm, "matmul_native", fake("native_fp4"))
    monkeypatch.setattr(bf16_gemm, "matmul_bf16", fake("cublaslt_bf16"))
    monkeypatch.setattr(reference, "matmul_dequantize_bf16", fake("xla_bf16"))
    chosen = "cublaslt_bf16" if path == "native_fp4" and decoded else path
    args = [np.zeros(1, np.uint8)] * 6
    if decoded:  # b's codes hold its bfloat16 values
        args[3] = np.zeros(2, jnp.bfloat16)
    assert dispatch.matmul_cuda(*args, dtype=jnp.float32) == chosen
    cuda = library.registered_targets().get("cuda", frozenset())
    options = {
        "native_fp4": {},
        "cublaslt_bf16": {
            "decode_handler": bf16_gemm.DECODE_TARGET in cuda,
            "graphs": True,
        },
        "xla_bf16": {},
    }[chosen]
    assert called == [(chosen, 6, np.dtype(np.float32), options)]


def test_matmul_cuda_without_a_gpu_is_xla_bf16_gemm(monkeypatch):
    monkeypatch.setattr(devices, "cuda_devices", lambda: ())
    args = random_operands(1, *CASES[3])
    got = jax.jit(functools.partial(dispatch.matmul_cuda, dtype=jnp.float32))(*args)
    want = jax.jit(
        functools.partial(reference.matmul_dequantize_bf16, dtype=jnp.float32)
    )(*args)
    np.testing.assert_array_equal(got, want)


# Lowering for "cuda" with the registry faked: where this build has no CUDA
# handlers, the primitives' own CUDA lowerings still say so (once per
# process, so whichever test lowers first would see it).
lowering_for_cuda = pytest.mark.filterwarnings(
    "ignore::jax_nvfp4.MissingHandlersWarning"
)


def _lowered_for_cuda(args, dtype):
    """StableHLO text of the matmul primitive lowered for "cuda" (a fresh jit,
    so that nothing is reused from an earlier lowering)."""

    def f(*xs):
        return ops.matmul(*xs, dtype=dtype)

    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _custom_calls(text):
    return [line for line in text.splitlines() if "stablehlo.custom_call" in line]


@lowering_for_cuda
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("case", [CASES[1], CASES[4]])
def test_lowers_to_one_handler_call_on_hopper(monkeypatch, case, dtype):
    monkeypatch.setattr(library, "registered_targets", lambda: BOTH)
    monkeypatch.setattr(devices, "cuda_devices", lambda: (fake_device("gpu", "9.0"),))
    batch, m, n, k, b_batch, a_per_item, b_per_item = case
    args = random_operands(2, *case)
    # gemm_graphs off: the same handler, kept out of CUDA graphs.
    with config.override(gemm_graphs=False):
        calls = _custom_calls(_lowered_for_cuda(args, dtype))
    assert len(calls) == 1 and f"@{bf16_gemm.TARGET}(" in calls[0], calls
    text = _lowered_for_cuda(args, dtype)
    calls = _custom_calls(text)
    assert len(calls) == 1 and f"@{bf16_gemm.GRAPH_TARGET}(" in calls[0], calls
    out = "bf16" if dtype == jnp.bfloat16 else "f32"
    ws = bf16_gemm.workspace_bytes(batch)
    a_n, b_n = (batch if a_per_item else 1), (b_batch if b_per_item else 1)
    assert (
        f"(tensor<{batch}x{m}x{k}xbf16>, tensor<{b_batch}x{n}x{k}xbf16>, "
        f"tensor<{a_n}xf32>, tensor<{b_n}xf32>) -> "
        f"(tensor<{batch}x{m}x{n}x{out}>, tensor<{ws}xui8>)"
    ) in calls[0]
    assert "dot_general" not in text  # the GEMM is the handler's
    # Switched off: XLA's GEMM, no custom call.
    with config.override(cublaslt_gemm=False):
        text = _lowered_for_cuda(args, dtype)
    assert not _custom_calls(text) and "dot_general" in text


@lowering_for_cuda
def test_hopper_lowering_decodes_with_the_handler_when_built(monkeypatch):
    """With jax_nvfp4_decode_bf16 built, the two operand decodes are its custom
    calls (bf16 out, the codes' shape with K doubled) ahead of the GEMM's."""
    targets = {"cuda": BOTH["cuda"] | {bf16_gemm.DECODE_TARGET}}
    monkeypatch.setattr(library, "registered_targets", lambda: targets)
    monkeypatch.setattr(devices, "cuda_devices", lambda: (fake_device("gpu", "9.0"),))
    batch, m, n, k, b_batch, _, _ = CASES[1]
    calls = _custom_calls(
        _lowered_for_cuda(random_operands(2, *CASES[1]), jnp.bfloat16)
    )
    assert len(calls) == 3, calls
    decodes = [c for c in calls if f"@{bf16_gemm.DECODE_TARGET}(" in c]
    assert len(decodes) == 2 and f"@{bf16_gemm.GRAPH_TARGET}(" in calls[2]
    assert f"-> tensor<{batch}x{m}x{k}xbf16>" in decodes[0]
    assert f"-> tensor<{b_batch}x{n}x{k}xbf16>" in decodes[1]


def test_decode_bf16_cuda_checks_shapes():
    codes = jnp.zeros((2, 4, 8), jnp.uint8)
    with pytest.raises(ValueError, match="scales"):
        bf16_gemm.decode_bf16_cuda(codes, jnp.zeros((2, 4, 2), jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="multiple of 16"):
        bf16_gemm.decode_bf16_cuda(
            jnp.zeros((2, 4, 4), jnp.uint8), jnp.zeros((2, 4, 0), jnp.float8_e4m3fn)
        )


@lowering_for_cuda
def test_lowering_without_a_gpu_keeps_xla_gemm(monkeypatch):
    monkeypatch.setattr(library, "registered_targets", lambda: BOTH)
    monkeypatch.setattr(devices, "cuda_devices", lambda: ())
    text = _lowered_for_cuda(random_operands(3, *CASES[0]), jnp.bfloat16)
    assert not _custom_calls(text) and "dot_general" in text
