"""Finds the compiled FFI handlers and registers them with XLA.

The handlers come from the nanobind extension ``jax_nvfp4._ffi`` built by
``pip install .``; ``JAX_NVFP4_FFI_LIBRARY`` (``jax_nvfp4.config``) names a
shared library built another way (the Bazel target ``//:jax_nvfp4_cpu``) to
load the CPU handlers from instead; that library lists its own targets
(``JaxNvfp4CpuTarget*``, generated from ``ffi/targets.inc``). Platforms
without handlers use the pure-JAX reference: on purpose with
``JAX_NVFP4_IMPLEMENTATION=reference``, otherwise with one
``MissingHandlersWarning`` per platform, at the first computation lowered
for it, saying why the handlers are missing and how to get them.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
import re
import warnings
from types import ModuleType

import jax

from jax_nvfp4 import config

__all__ = [
    "MissingHandlersWarning",
    "api_mismatch",
    "available_platforms",
    "missing_handlers",
    "extension",
    "handler_source",
    "registered_targets",
    "runtime_ffi_api_version",
    "target_names",
    "targets_on",
]

_source = "none"
# Why the extension could not be imported (the ImportError), if it could not.
_import_error: str | None = None
# Why the extension's handlers were not registered although it imported.
_refused: str | None = None
_warned: set[str] = set()


class MissingHandlersWarning(UserWarning):
    """The compiled handlers for a platform are missing: the pure-JAX twin
    runs instead (same results, much slower)."""


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
    global _import_error
    try:
        from jax_nvfp4 import _ffi
    except ImportError as e:
        _import_error = str(e)
        return None
    return _ffi


_API_VERSION = re.compile(r"#define\s+XLA_FFI_API_(MAJOR|MINOR)\s+(\d+)")


def runtime_ffi_api_version(include_dir: str | None = None) -> tuple[int, int] | None:
    """The XLA FFI API version of the running jaxlib, read from the headers
    it ships (``jax.ffi.include_dir()``); None where they cannot be read."""
    try:
        include_dir = include_dir or jax.ffi.include_dir()
        with open(os.path.join(include_dir, "xla", "ffi", "api", "c_api.h")) as f:
            found = dict((k, int(v)) for k, v in _API_VERSION.findall(f.read()))
        return found["MAJOR"], found["MINOR"]
    except (OSError, KeyError, AttributeError):
        return None


def api_mismatch(built, runtime) -> str | None:
    """Why handlers built against XLA FFI API ``built`` cannot run on a jaxlib
    of API ``runtime`` (XLA refuses another major version or a newer minor
    one, and then fails to start the whole backend); None where they can or
    either is unknown."""
    if built is None or runtime is None:
        return None
    # XLA takes handlers of its own major version and a minor no newer.
    if built[0] == runtime[0] and built[1] <= runtime[1]:
        return None
    try:
        running = f"jaxlib {importlib.metadata.version('jaxlib')}, "
    except importlib.metadata.PackageNotFoundError:
        running = ""
    return (
        "its handlers were built against the XLA FFI headers of another "
        f"jaxlib (API {built[0]}.{built[1]}) than the one running ({running}API "
        f"{runtime[0]}.{runtime[1]}), which XLA refuses; rebuild against the "
        "installed jax with `pip install --no-build-isolation --no-deps "
        "--force-reinstall .` (needs scikit-build-core and nanobind "
        "installed), or install a jax at least as new as the one it was built "
        "with"
    )


def _load() -> dict[str, dict[str, object]]:
    """Returns {xla platform name: {target: capsule}}."""
    global _source, _refused
    if config.implementation() == "reference":
        _source = "none: JAX_NVFP4_IMPLEMENTATION=reference"
        return {}
    library = config.ffi_library()
    if library:
        _source = library
        return {"cpu": _library_targets(library)}
    ext = extension()
    if ext is None:
        return {}
    built = ext.ffi_api_version() if hasattr(ext, "ffi_api_version") else None
    _refused = api_mismatch(built, runtime_ffi_api_version())
    if _refused:
        _source = f"none: {ext.__file__} refused ({_refused})"
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


def target_names() -> frozenset[str]:
    """Every FFI target of the extension's own list (``ffi/targets.inc``),
    built here or not; where the extension is missing, the registered ones
    (e.g. those of a Bazel CPU library)."""
    ext = extension()
    if ext is not None and hasattr(ext, "target_names"):
        return frozenset(ext.target_names())
    return frozenset().union(*registered_targets().values())


def available_platforms() -> frozenset[str]:
    """The lowering platforms ("cpu", "cuda") with compiled handlers."""
    return frozenset(registered_targets())


def handler_source() -> str:
    """Where the handlers were loaded from (for diagnostics and tests)."""
    available_platforms()
    return _source


def _package_dir() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Why the extension has no CUDA handlers (``_ffi.cuda_build()``, recorded by
# CMakeLists.txt), and what to do about it.
_NO_CUDA = {
    "JAX_NVFP4_CUDA=OFF": (
        "as JAX_NVFP4_CUDA=OFF asked",
        "reinstall without that setting where nvcc is found to get them",
    ),
    "nvcc unusable": (
        "nvcc was found but CMake could not compile with it: an unsupported "
        "host compiler, say",
        "reinstall with `pip install -v .` to see why, or with "
        "JAX_NVFP4_CUDA=ON to make that an error",
    ),
    "no nvcc": (
        "nvcc was not found when it was built",
        "reinstall with nvcc on PATH, or with JAX_NVFP4_CUDA=ON to make a "
        "missing nvcc an error",
    ),
}


def _why_missing(platform: str) -> str:
    """Why ``platform`` has no handlers, and what to do about it."""
    package = _package_dir()
    if config.ffi_library() and platform != "cpu":
        return (
            "JAX_NVFP4_FFI_LIBRARY loads CPU handlers only; unset it to use the "
            "extension built by pip install"
        )
    if _refused is not None:
        return f"the extension at {extension().__file__} is unusable here: {_refused}"
    if _import_error is None and extension() is not None:
        ext = extension()
        build = getattr(ext, "cuda_build", lambda: "")()
        why, fix = _NO_CUDA.get(build, _NO_CUDA["no nvcc"])
        return f"the extension at {ext.__file__} was built without CUDA ({why}); {fix}"
    source_tree = os.path.exists(
        os.path.join(os.path.dirname(package), "pyproject.toml")
    )
    if source_tree:
        return (
            f"Python imported the source tree at {package}, which holds no "
            "compiled extension, instead of the installed package (scripts run "
            "from the repository root and `python -m pytest` do this); install "
            "with `pip install .` and run from another directory, or with "
            "`python -P` / plain `pytest`"
        )
    return (
        f"the extension jax_nvfp4._ffi could not be imported from {package} "
        f"({_import_error}); reinstall jax_nvfp4 with `pip install .`"
    )


def missing_handlers(platform: str) -> None:
    """Called when a computation is lowered for ``platform`` ("cpu", "cuda")
    that has no handlers: a ``MissingHandlersWarning`` the first time (the
    twin runs), or an error under ``JAX_NVFP4_IMPLEMENTATION=native``."""
    mode = config.implementation()
    if mode == "reference" or platform in _warned:
        return
    why = _why_missing(platform)
    if mode == "native":
        raise RuntimeError(
            f"jax_nvfp4 has no compiled handlers for {platform} and "
            f"JAX_NVFP4_IMPLEMENTATION=native requires them: {why}"
        )
    _warned.add(platform)
    warnings.warn(
        f"jax_nvfp4 has no compiled handlers for {platform}, so its pure-JAX "
        f"twin runs instead (the same results, about 10x slower): {why}. "
        "Set JAX_NVFP4_IMPLEMENTATION=reference to run the twin on purpose "
        "without this warning.",
        MissingHandlersWarning,
        stacklevel=_caller_level(),
    )


def _caller_level() -> int:
    """The warnings stack level of the first frame outside jax and jax_nvfp4
    (the user's call that was being lowered)."""
    import sys

    inside = (_package_dir(), os.path.dirname(os.path.abspath(jax.__file__)))
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level
