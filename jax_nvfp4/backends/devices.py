"""Which devices a computation is lowered for, and what they can do.

The one parser of CUDA compute capabilities: the GEMM backends ask
``all_capable(devices, minimum)`` and nothing else reads
``device.compute_capability``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

__all__ = [
    "ENGINE_CAPABILITY",
    "all_capable",
    "all_engine_capable",
    "capability",
    "cuda_devices",
    "lowering_devices",
]


def capability(device: Any) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device; None for other devices (CPU, ROCm) or
    an unknown capability."""
    if getattr(device, "platform", None) != "gpu":
        return None
    try:
        major, minor = (int(v) for v in str(device.compute_capability).split(".")[:2])
    except (AttributeError, ValueError):  # not CUDA (e.g. ROCm's "gfx90a")
        return None
    return major, minor


def all_capable(devices: Sequence[Any], minimum: tuple[int, int]) -> bool:
    """Whether there are devices and every one is a CUDA GPU of at least
    compute capability ``minimum``."""
    capabilities = [capability(d) for d in devices]
    return bool(capabilities) and all(
        c is not None and c >= minimum for c in capabilities
    )


# The Hopper GEMM engine's kernels are compiled for sm_90a, which runs on
# compute capability 9.0 alone.
ENGINE_CAPABILITY = (9, 0)


def all_engine_capable(devices: Sequence[Any]) -> bool:
    """Whether there are devices and every one is a GPU of compute
    capability 9.0 exactly (``ENGINE_CAPABILITY``)."""
    return bool(devices) and all(capability(d) == ENGINE_CAPABILITY for d in devices)


def cuda_devices() -> tuple[Any, ...]:
    """The devices of this process's CUDA backend; () without one."""
    try:
        return tuple(jax.devices("cuda"))
    except RuntimeError:  # no CUDA backend in this process
        return ()


def _compiled_for(module_context) -> tuple[Any, ...]:
    """The GPUs a module is compiled for, where its context names them (the
    device assignment of jit, the mesh of shard_map); () otherwise."""
    axis_context = getattr(module_context, "axis_context", None)
    try:
        assigned = getattr(axis_context, "device_assignment", None)
        if assigned is None:
            mesh = getattr(axis_context, "mesh", None)
            mesh_devices = getattr(mesh, "devices", None)
            assigned = None if mesh_devices is None else list(mesh_devices.flat)
    except Exception:  # an abstract mesh, or a context of another JAX version
        return ()
    if not assigned or any(getattr(d, "platform", None) != "gpu" for d in assigned):
        return ()
    return tuple(assigned)


def lowering_devices(target: Any = None) -> tuple[Any, ...]:
    """The devices a GEMM is lowered for.

    ``target``: a lowering rule's context (if it lowers for "cuda" alone: the
    GPUs the computation is compiled for, e.g. those of an ahead-of-time
    topology, else the CUDA backend's devices; none for a module lowered for
    several platforms, e.g. by ``jax.export``, which then keeps the portable
    GEMM), a device, a sequence of devices, or None for the CUDA backend's
    devices.
    """
    if target is None:
        return cuda_devices()
    if hasattr(target, "module_context"):  # mlir.LoweringRuleContext
        # The module's platforms: a multi-platform lowering calls the CUDA
        # rule with the context's own platforms narrowed to ("cuda",).
        module_platforms = getattr(target.module_context, "platforms", None)
        platforms = tuple(module_platforms or target.platforms or ())
        if platforms != ("cuda",):
            return ()
        return _compiled_for(target.module_context) or cuda_devices()
    if hasattr(target, "platform"):
        return (target,)
    if isinstance(target, Sequence):
        return tuple(target)
    raise TypeError(
        "target must be a lowering context, a device, a sequence of devices "
        f"or None, got {type(target).__name__}"
    )
