"""The library's configuration: which GEMM implementations it may choose.

``settings()`` is the configuration in effect: the ``JAX_NVFP4_*`` environment
switches below, read once when jax_nvfp4 is imported, with any ``override``
scopes applied over them. The scope is part of what JAX caches on (it is a
``jax.make_user_context``), so a function jitted inside ``override(...)`` is
traced and compiled again for that configuration, not served from another's
cache::

    with jax_nvfp4.config.override(grouped_gemm=False):
        y = step(params, batch)   # ragged_dot's GEMM by XLA, traced anew

Only ``jax_nvfp4.ops.dispatch`` (which chooses every GEMM) reads the settings.

Settings (environment variable, default):

``native_gemm`` (``JAX_NVFP4_NATIVE_GEMM``, on): the native FP4 GEMMs
    (dense and grouped) on GPUs with FP4 tensor cores.
``cublaslt_gemm`` (``JAX_NVFP4_CUBLASLT_GEMM``, on): the cuBLASLt bf16 GEMM
    with alpha in its epilogue on other GPUs; off: XLA's bf16 GEMM.
``gemm_graphs`` (``JAX_NVFP4_GEMM_GRAPHS``, on): that GEMM declared safe for
    XLA's command buffers (CUDA graphs).
``grouped_gemm`` (``JAX_NVFP4_GROUPED_GEMM``, on): ``ragged_dot``'s grouped
    GEMM by the CUDA handler on GPUs; off: XLA's ``ragged_dot_general`` on the
    same decoded operands (which XLA expands to a masked dense GEMM).
``gemm_engine`` (``JAX_NVFP4_GEMM_ENGINE``, on): that grouped GEMM, and the
    W4A16 GEMM below, by the Hopper engine (wgmma and TMA kernels) on
    compute capability 9.0 GPUs, for the shapes it serves; off: the mma.sync
    handlers there too.
``w4a16_gemm`` (``JAX_NVFP4_W4A16_GEMM``, on): ``matmul`` of bfloat16
    activations by an NVFP4 weight through a CUDA handler that decodes the
    weight in registers (the engine's for up to 512 rows on compute
    capability 9.0 and K a multiple of 256, the mma.sync one for up to 64
    rows elsewhere); off: the decoded weight and a bf16 GEMM.
``gemm_operands`` (``JAX_NVFP4_GEMM_OPERANDS``, ``auto``): the form in which
    the training recipe's fused quantize writes the operands that only feed a
    GEMM (same values in either form). ``auto``: decoded bfloat16 values where
    the default backend is a GPU whose GEMM reads them (the bf16 GEMMs, for
    bfloat16 inputs), codes elsewhere; ``codes``: always codes; ``decoded``:
    decoded values wherever the fused kernel writes them (bfloat16 input, the
    options it serves), on any platform (on the CPU the GEMM then runs its
    pure-JAX twin). Forcing a form is for tests and comparisons.

Read elsewhere: ``JAX_NVFP4_IMPLEMENTATION`` (``auto``): which implementation
the primitives lower to. ``auto``: the compiled handlers where they were
built, else the pure-JAX twin (``jax_nvfp4.reference``) with a
``MissingHandlersWarning`` saying why and how to fix it; ``reference``: the
twin everywhere, on purpose, without a warning; ``native``: the compiled
handlers, and an error where a platform has none. Read once, when the first
primitive is defined (at import). ``JAX_NVFP4_FFI_LIBRARY`` (unset): load the
CPU handlers from this shared library (the Bazel target ``//:jax_nvfp4_cpu``)
instead of the extension ``jax_nvfp4._ffi``; read at import.
``JAX_NVFP4_CUBLASLT`` (unset): the libcublasLt to load; read by the C++
loader at the first GEMM call. ``JAX_NVFP4_CPU_KERNELS``: read by the C++ CPU
handlers.

On/off switches take ``1``/``true``/``on``/``yes`` and ``0``/``false``/``off``/
``no``, ``JAX_NVFP4_GEMM_OPERANDS`` one of ``GEMM_OPERANDS`` (any case,
surrounding spaces ignored); unset or empty keeps the default; any other
value is an error at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import jax

__all__ = [
    "GEMM_OPERANDS",
    "IMPLEMENTATIONS",
    "SWITCHES",
    "Settings",
    "ffi_library",
    "implementation",
    "override",
    "settings",
]

# Values of JAX_NVFP4_IMPLEMENTATION.
IMPLEMENTATIONS = ("auto", "reference", "native")
# Values of JAX_NVFP4_GEMM_OPERANDS (the setting gemm_operands).
GEMM_OPERANDS = ("auto", "codes", "decoded")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Which GEMM implementations the dispatcher may choose (see the module
    docstring for each field)."""

    native_gemm: bool = True
    cublaslt_gemm: bool = True
    gemm_graphs: bool = True
    grouped_gemm: bool = True
    gemm_engine: bool = True
    w4a16_gemm: bool = True
    gemm_operands: str = "auto"


# {environment variable: the Settings field it sets}.
SWITCHES = {
    "JAX_NVFP4_NATIVE_GEMM": "native_gemm",
    "JAX_NVFP4_CUBLASLT_GEMM": "cublaslt_gemm",
    "JAX_NVFP4_GEMM_GRAPHS": "gemm_graphs",
    "JAX_NVFP4_GROUPED_GEMM": "grouped_gemm",
    "JAX_NVFP4_GEMM_ENGINE": "gemm_engine",
    "JAX_NVFP4_W4A16_GEMM": "w4a16_gemm",
}
# The settings that choose among named values: {environment variable:
# (Settings field, its values)}.
_CHOICES = {"JAX_NVFP4_GEMM_OPERANDS": ("gemm_operands", GEMM_OPERANDS)}
_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def _from_environment() -> Settings:
    values = {}
    for variable, field in SWITCHES.items():
        value = os.environ.get(variable, "").strip().lower()
        if value in _ON:
            values[field] = True
        elif value in _OFF:
            values[field] = False
        elif value:
            raise ValueError(
                f"{variable}={os.environ[variable]!r}: use 1/true/on/yes or "
                "0/false/off/no (or leave it unset for the default)"
            )
    for variable, (field, choices) in _CHOICES.items():
        value = os.environ.get(variable, "").strip().lower()
        if value in choices:
            values[field] = value
        elif value:
            raise ValueError(
                f"{variable}={os.environ[variable]!r}: use one of {choices} (or "
                "leave it unset for the default)"
            )
    return Settings(**values)


_DEFAULTS = _from_environment()
# The overrides in effect, as sorted (field, value) pairs: hashable, so that
# JAX keys its caches on them.
_SCOPE = jax.make_user_context(())


def settings() -> Settings:
    """The configuration in effect: the environment's, with the enclosing
    ``override`` scopes applied (the innermost wins)."""
    return dataclasses.replace(_DEFAULTS, **dict(_SCOPE.value))


@contextlib.contextmanager
def override(**changes: bool | str) -> Iterator[Settings]:
    """A scope with some settings changed, e.g. ``override(grouped_gemm=False)``
    or ``override(gemm_operands="codes")``; yields the settings in effect
    inside it. Computations traced inside it are cached apart from those
    traced outside."""
    fields = {f.name for f in dataclasses.fields(Settings)}
    choices = dict(_CHOICES.values())
    for name, value in changes.items():
        if name not in fields:
            raise TypeError(
                f"{name!r} is not a jax_nvfp4 setting; known: {sorted(fields)}"
            )
        if name in choices:
            if not isinstance(value, str):
                raise TypeError(f"{name} must be one of {choices[name]}, got {value!r}")
            if value not in choices[name]:
                raise ValueError(
                    f"{name} must be one of {choices[name]}, got {value!r}"
                )
        elif not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    merged = dict(_SCOPE.value) | changes
    with _SCOPE(tuple(sorted(merged.items()))):
        yield settings()


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
