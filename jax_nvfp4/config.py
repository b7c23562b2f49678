"""Every ``JAX_NVFP4_*`` environment switch, read in one place.

``JAX_NVFP4_FFI_LIBRARY`` (unset): load the CPU handlers from this shared
    library (the Bazel target ``//:jax_nvfp4_cpu``) instead of the extension
    ``jax_nvfp4._ffi``. Read once, when the first primitive is defined.
``JAX_NVFP4_IMPLEMENTATION`` (``auto``): which implementation the primitives
    lower to. ``auto``: the compiled handlers where they were built, else the
    pure-JAX twin (``jax_nvfp4.reference``) with a ``MissingHandlersWarning``
    saying why and how to fix it; ``reference``: the twin everywhere, on
    purpose, without a warning; ``native``: the compiled handlers, and an
    error where a platform has none. Read once, when the first primitive is
    defined (at import).
``JAX_NVFP4_NATIVE_GEMM`` (on): the native Blackwell FP4 GEMM on GPUs with FP4
    tensor cores. Read when a computation is lowered.
``JAX_NVFP4_CUBLASLT_GEMM`` (on): the cuBLASLt bf16 GEMM with alpha in its
    epilogue on other GPUs; off: XLA's bf16 GEMM. Read when lowered.
``JAX_NVFP4_GEMM_GRAPHS`` (on): declare that GEMM safe for XLA's command
    buffers (CUDA graphs). Read when lowered.
``JAX_NVFP4_GROUPED_GEMM`` (on): ``ragged_dot``'s grouped GEMM by the CUDA
    handler on GPUs; off: XLA's ``ragged_dot_general`` on the same decoded
    operands (which XLA expands to a masked dense GEMM). Read when traced.
``JAX_NVFP4_W4A16_GEMM`` (on): ``matmul`` of bfloat16 activations by an
    NVFP4 weight through the CUDA handler that decodes the weight in
    registers, for few rows; off: the decoded weight and a bf16 GEMM. Read
    when traced.
``JAX_NVFP4_DECODED_OPERANDS`` (on): on the cuBLASLt bf16 path, the fused
    quantize writes the GEMM's bfloat16 operands instead of codes. Read when
    traced.
``JAX_NVFP4_CUBLASLT`` (unset): the libcublasLt to load; read by the C++
    loader (``ffi/gemm/cublaslt.cu``) at the first GEMM call.

On/off switches take ``1``/``true``/``on``/``yes`` and ``0``/``false``/``off``/
``no`` (any case, surrounding spaces ignored); unset, empty or anything else
keeps the default. Set them before the computation they affect is lowered or
traced.
"""

from __future__ import annotations

import os

__all__ = ["IMPLEMENTATIONS", "SWITCHES", "enabled", "ffi_library", "implementation"]

# Values of JAX_NVFP4_IMPLEMENTATION.
IMPLEMENTATIONS = ("auto", "reference", "native")

# On/off switches and their defaults.
SWITCHES = {
    "JAX_NVFP4_NATIVE_GEMM": True,
    "JAX_NVFP4_CUBLASLT_GEMM": True,
    "JAX_NVFP4_GEMM_GRAPHS": True,
    "JAX_NVFP4_DECODED_OPERANDS": True,
    "JAX_NVFP4_GROUPED_GEMM": True,
    "JAX_NVFP4_W4A16_GEMM": True,
}
_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def enabled(name: str) -> bool:
    """The current value of the on/off switch ``name`` (a key of ``SWITCHES``)."""
    if name not in SWITCHES:
        raise KeyError(f"{name} is not a jax_nvfp4 switch; known: {sorted(SWITCHES)}")
    value = os.environ.get(name, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    return SWITCHES[name]


def ffi_library() -> str | None:
    """``JAX_NVFP4_FFI_LIBRARY``: a shared library with the CPU handlers, or None."""
    return os.environ.get("JAX_NVFP4_FFI_LIBRARY") or None


def implementation() -> str:
    """``JAX_NVFP4_IMPLEMENTATION``: ``"auto"`` (unset or empty),
    ``"reference"`` or ``"native"``."""
    value = os.environ.get("JAX_NVFP4_IMPLEMENTATION", "").strip().lower() or "auto"
    if value not in IMPLEMENTATIONS:
        raise ValueError(
            f"JAX_NVFP4_IMPLEMENTATION={value!r} is not one of {IMPLEMENTATIONS}: "
            "'reference' runs the pure-JAX twin, 'native' requires the compiled "
            "handlers, 'auto' (or unset) uses the handlers where they were built"
        )
    return value
