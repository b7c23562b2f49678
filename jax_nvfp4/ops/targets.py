"""What the primitives lower to, as users see it: the platforms with compiled
handlers, the warning when they are missing, and the safety checks that let
``jax.export`` serialize their custom calls."""

from __future__ import annotations

from jax_nvfp4.backends import library
from jax_nvfp4.backends.library import MissingHandlersWarning, available_platforms

__all__ = ["MissingHandlersWarning", "available_platforms", "export_safety_checks"]


def export_safety_checks() -> list:
    """The ``jax.export.DisabledSafetyCheck`` list that lets ``jax.export``
    serialize computations holding jax_nvfp4's custom calls: one for every
    FFI target of the extension (``ffi/targets.inc``), built on this machine
    or not, so that a module lowered here for another platform exports too.

    XLA's export refuses custom calls without a compatibility guarantee; these
    handlers have none across jax_nvfp4 versions, so a module exported with
    these checks disabled must run with the same jax_nvfp4 build::

        exported = jax.export.export(
            jax.jit(step), disabled_checks=jax_nvfp4.export_safety_checks()
        )(*args)
    """
    from jax import export

    return [
        export.DisabledSafetyCheck.custom_call(name)
        for name in sorted(library.target_names())
    ]
