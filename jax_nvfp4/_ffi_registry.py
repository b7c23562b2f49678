"""Finds the compiled FFI handlers and registers them with XLA.

The handlers come from the nanobind extension ``jax_nvfp4._ffi`` built by
``pip install .``; setting ``JAX_NVFP4_FFI_LIBRARY`` to a shared library built
another way (the Bazel target ``//:jax_nvfp4_cpu``) loads the CPU handlers from
there instead. Platforms without handlers use the pure-JAX reference.
"""

from __future__ import annotations

import ctypes
import functools
import os

import jax

__all__ = ["TARGETS", "available_platforms", "handler_source", "registered_targets"]

# FFI target name -> C symbol stem (the CPU symbol is stem + "Cpu").
TARGETS = {
    "jax_nvfp4_quantize_rows": "JaxNvfp4QuantizeRows",
    "jax_nvfp4_quantize_cols": "JaxNvfp4QuantizeCols",
    "jax_nvfp4_quantize_rows_cols": "JaxNvfp4QuantizeRowsCols",
    "jax_nvfp4_amax": "JaxNvfp4Amax",
    "jax_nvfp4_dequantize": "JaxNvfp4Dequantize",
    "jax_nvfp4_matmul": "JaxNvfp4Matmul",
}

_source = "none"


def _load() -> dict[str, dict[str, object]]:
    """Returns {xla platform name: {target: capsule}}."""
    global _source
    library = os.environ.get("JAX_NVFP4_FFI_LIBRARY")
    if library:
        lib = ctypes.cdll.LoadLibrary(library)
        _source = library
        cpu = {
            name: jax.ffi.pycapsule(getattr(lib, stem + "Cpu"))
            for name, stem in TARGETS.items()
        }
        return {"cpu": cpu}
    try:
        from jax_nvfp4 import _ffi
    except ImportError:
        return {}
    _source = _ffi.__file__
    return {"cpu": _ffi.cpu_registrations(), "CUDA": _ffi.cuda_registrations()}


@functools.cache
def registered_targets() -> dict[str, frozenset[str]]:
    """Registers every handler once: {lowering platform: target names}."""
    served = {}
    for platform, capsules in _load().items():
        if not capsules:
            continue
        for name, capsule in capsules.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
        served["cuda" if platform == "CUDA" else platform] = frozenset(capsules)
    return served


def available_platforms() -> frozenset[str]:
    """The lowering platforms ("cpu", "cuda") with compiled handlers."""
    return frozenset(registered_targets())


def handler_source() -> str:
    """Where the handlers were loaded from (for diagnostics and tests)."""
    available_platforms()
    return _source
