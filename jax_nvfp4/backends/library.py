"""Finds the compiled FFI handlers and registers them with XLA.

The handlers come from the nanobind extension ``jax_nvfp4._ffi`` built by
``pip install .``; ``JAX_NVFP4_FFI_LIBRARY`` (``jax_nvfp4.config``) names a
shared library built another way (the Bazel target ``//:jax_nvfp4_cpu``) to
load the CPU handlers from instead; that library lists its own targets
(``JaxNvfp4CpuTarget*``, generated from ``ffi/targets.inc``). Platforms
without handlers use the pure-JAX reference.
"""

from __future__ import annotations

import ctypes
import functools
from types import ModuleType

import jax

from jax_nvfp4 import config

__all__ = [
    "available_platforms",
    "extension",
    "handler_source",
    "registered_targets",
    "targets_on",
]

_source = "none"


def _library_targets(path: str) -> dict[str, object]:
    """{target: capsule} of the CPU handlers in a shared library."""
    lib = ctypes.cdll.LoadLibrary(path)
    lib.JaxNvfp4CpuTargetCount.restype = ctypes.c_int64
    lib.JaxNvfp4CpuTargetName.restype = ctypes.c_char_p
    lib.JaxNvfp4CpuTargetName.argtypes = [ctypes.c_int64]
    lib.JaxNvfp4CpuTargetHandler.restype = ctypes.c_void_p
    lib.JaxNvfp4CpuTargetHandler.argtypes = [ctypes.c_int64]
    handler = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
    return {
        lib.JaxNvfp4CpuTargetName(i).decode(): jax.ffi.pycapsule(
            handler(lib.JaxNvfp4CpuTargetHandler(i))
        )
        for i in range(lib.JaxNvfp4CpuTargetCount())
    }


@functools.cache
def extension() -> ModuleType | None:
    """The nanobind extension ``jax_nvfp4._ffi``, or None where it was not built."""
    try:
        from jax_nvfp4 import _ffi
    except ImportError:
        return None
    return _ffi


def _load() -> dict[str, dict[str, object]]:
    """Returns {xla platform name: {target: capsule}}."""
    global _source
    library = config.ffi_library()
    if library:
        _source = library
        return {"cpu": _library_targets(library)}
    ext = extension()
    if ext is None:
        return {}
    _source = ext.__file__
    return {"cpu": ext.cpu_registrations(), "CUDA": ext.cuda_registrations()}


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


def targets_on(platform: str) -> frozenset[str]:
    """The targets registered for one lowering platform ("cpu", "cuda")."""
    return registered_targets().get(platform, frozenset())


def available_platforms() -> frozenset[str]:
    """The lowering platforms ("cpu", "cuda") with compiled handlers."""
    return frozenset(registered_targets())


def handler_source() -> str:
    """Where the handlers were loaded from (for diagnostics and tests)."""
    available_platforms()
    return _source
