"""The rule for an amax a caller gives ``quantize`` (instead of letting it
reduce x): checked when concrete, marked into the result when traced."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import reference
from jax_nvfp4.format import NVFP4Tensor

__all__ = ["GivenAmax", "given_amax"]


# A given amax must be a max |x| over x's finite elements: finite and >= 0,
# and 0 only where x has no nonzero finite element. A concrete one is checked
# when the call is traced; a traced one (a jit argument, a pmax) is checked
# against the quantized result: where it is NaN, +-inf or negative, or 0
# while x holds a nonzero finite element, the tensor is marked invalid (see
# quantize's docstring, "amax"), so the error shows as NaN wherever the
# tensor is used instead of as finite garbage or zeros.
#
# The handlers quantize with this amax in place of any amax that is not
# finite and positive: S_enc = 2688 / _PROBE_AMAX = 2^120 exactly and
# S_dec = 2^-120 is normal, so the arithmetic is the same on every backend,
# and every block holding a nonzero finite element (|x| >= 2^-126) gets a
# nonzero scale, which is how an amax of 0 is checked against x.
_PROBE_AMAX = np.float32(2688 * 2.0**-120)


@dataclasses.dataclass(frozen=True)
class GivenAmax:
    """A given amax as the float32 scalar stored in the tensor, and whether
    it is checked against the quantized result (traced, or 0)."""

    value: jax.Array
    checked: bool

    def for_handler(self) -> jax.Array:
        if not self.checked:
            return self.value
        usable = (self.value > 0) & (self.value < np.inf)
        return jnp.where(usable, self.value, _PROBE_AMAX)

    def mark(self, values, scales, *, decoded=False):
        """(values, scales, amax) of the quantized result, marked invalid
        where the amax is: every scale the E4M3 NaN (0x7F), the values NaN
        where they are ``decoded`` bfloat16 (codes stay), the amax NaN."""
        if not self.checked:
            return values, scales, self.value
        amax = self.value
        s = scales.astype(jnp.float32)
        # NaN scales mark non-finite blocks, not data.
        holds_data = jnp.any((s > 0) & (s < np.inf))
        valid = ((amax > 0) & (amax < np.inf)) | ((amax == 0) & ~holds_data)
        scales = jnp.where(valid, scales, jnp.array(np.nan, scales.dtype))
        if decoded:
            values = jnp.where(valid, values, jnp.array(np.nan, values.dtype))
        return values, scales, jnp.where(valid, amax, np.float32(np.nan))


def given_amax(amax, x, name="amax", trusted=False) -> GivenAmax:
    """Checks a given amax; ``trusted``: a max over x's finite |values| (the
    training recipe's, reduced over shards), which needs no check."""
    if isinstance(amax, NVFP4Tensor) or not (
        hasattr(amax, "dtype") or isinstance(amax, (int, float, np.number))
    ):
        raise TypeError(
            f"{name} must be a float32 scalar (the max |x| of the whole tensor), "
            f"got {type(amax).__name__}"
        )
    # Read before the conversion, which under jit may stage a Python float.
    value = concrete(amax) if np.size(amax) == 1 else None
    amax = jnp.asarray(amax)
    if amax.size != 1 or amax.ndim > 1:
        raise ValueError(
            f"{name} must be a scalar (the max |x| of the whole tensor), got shape "
            f"{amax.shape}"
        )
    if not jnp.issubdtype(amax.dtype, jnp.floating):
        raise TypeError(f"{name} must be a float, got {amax.dtype}")
    amax = amax.astype(jnp.float32).reshape(())
    if trusted:
        return GivenAmax(amax, checked=False)
    if value is None:
        return GivenAmax(amax, checked=True)
    if not (np.isfinite(value) and value >= 0):
        raise ValueError(
            f"{name}={value} must be a finite, positive max |x|; pass the "
            "tensor's amax, e.g. jax_nvfp4.global_amax(x), or leave it out"
        )
    if value > 0:
        return GivenAmax(amax, checked=False)
    data = None if isinstance(x, jax.core.Tracer) else concrete(reference.abs_max(x))
    if data is not None and data > 0:
        raise ValueError(
            f"{name}=0 must be a finite, positive max |x|: x holds values up to "
            f"{data} (an amax of 0 would quantize them to zeros); pass the "
            "tensor's amax, e.g. jax_nvfp4.global_amax(x), or leave it out"
        )
    # 0 for x without a nonzero finite element: valid. Under jit x is not
    # known here, so the result is checked.
    return GivenAmax(amax, checked=data is None)


def concrete(a) -> float | None:
    """A scalar's value, or None where it is traced."""
    try:
        return float(a)
    except (jax.errors.ConcretizationTypeError, TypeError):
        return None
