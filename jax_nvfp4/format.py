"""The NVFP4 format: constants, E2M1/E4M3 tables and the NVFP4Tensor container.

An NVFP4 tensor stores E2M1 (4-bit) values in blocks of 16 consecutive elements
along one *quantized axis*, one float8_e4m3fn scale per block and one float32
amax per tensor. Storage keeps the quantized axis last:

* ``codes``: uint8 ``[..., L/2]``; byte k holds element 2k in the low nibble and
  element 2k+1 in the high nibble; nibble bit 3 is the sign, bits 0-2 index
  ``E2M1_VALUES``.
* ``scales``: float8_e4m3fn ``[..., L/16]``. With 16x16 (2D) blocks there is one
  scale per 16x16 tile, stored repeated in each of the tile's 16 rows, so both
  block kinds share one layout.
* ``amax``: float32, the max |x| of the whole logical tensor (after the Random
  Hadamard Transform when one was applied).

``...`` is the logical shape with the quantized axis moved last (for a matrix
quantized along axis 0 this is the transposed, column-wise copy).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "SCALE_RANGE",
    "Block",
    "NVFP4Tensor",
    "Rounding",
]

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
SCALE_RANGE = 2688.0  # E4M3_MAX * E2M1_MAX
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)

Block = Literal["1x16", "16x16"]
Rounding = Literal["nearest", "stochastic"]


def check_leaf_dtype(leaf, dtype, what: str) -> None:
    """Refuses a pytree leaf holding an array of another dtype than ``dtype``,
    with ``what`` saying what the leaf must hold. Leaves without a real dtype
    pass: JAX rebuilds pytrees with placeholders (None, ``in_axes`` entries,
    shardings) and gives integer leaves float0 tangents."""
    got = getattr(leaf, "dtype", None)
    if not isinstance(got, np.dtype) or got == jax.dtypes.float0:
        return
    if got != np.dtype(dtype):
        raise TypeError(f"{what}, got {got} {tuple(getattr(leaf, 'shape', ()))}")


class QuantizedArrays:
    """What ``NVFP4Tensor`` and the internal ``DecodedOperand`` share: three
    arrays (the data named by ``_data``, ``scales``, ``amax``) and the layout
    of the tensor they stand for (``shape``, ``axis``, ``block``, ``rht``),
    as a pytree whose leaves are the arrays."""

    _data: str

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The logical shape with the quantized axis moved last."""
        return stored_shape(self.shape, self.axis)

    def tree_flatten(self):
        arrays = (getattr(self, self._data), self.scales, self.amax)
        return arrays, (self.shape, self.axis, self.block, self.rht)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(shape={self.shape}, axis={self.axis}, "
            f"block={self.block!r}, rht={self.rht})"
        )


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, repr=False)
class NVFP4Tensor(QuantizedArrays):
    """A quantized tensor: packed E2M1 codes, E4M3 block scales, float32 amax.

    Attributes:
      codes: uint8 ``[*stored_shape[:-1], L // 2]``.
      scales: float8_e4m3fn ``[*stored_shape[:-1], L // 16]``.
      amax: float32 scalar, the global amax the scales were computed from.
      shape: the logical shape of the tensor that was quantized.
      axis: the quantized axis of ``shape`` (non-negative).
      block: ``"1x16"`` or ``"16x16"`` (2D tiles: 16 along ``axis`` times 16
        along the last axis, or along axis -2 when ``axis`` is the last).
      rht: whether the values are Random-Hadamard-transformed along ``axis``
        (``dequantize`` then returns the transformed values).

    ``codes`` is always packed uint8 codes; constructing one with another
    dtype raises ``TypeError``.
    """

    _data = "codes"

    codes: jax.Array
    scales: jax.Array
    amax: jax.Array
    shape: tuple[int, ...]
    axis: int
    block: Block = "1x16"
    rht: bool = False

    def __post_init__(self):
        check_leaf_dtype(
            self.codes,
            np.uint8,
            "NVFP4Tensor.codes must be packed uint8 E2M1 codes (two per byte); "
            "make NVFP4Tensors with jax_nvfp4.quantize",
        )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def batch_ndim(self) -> int:
        """Leading axes that ``vmap`` added to the arrays of a tensor it
        returned (``shape`` is per example); 0 inside the ``vmap``."""
        return self.codes.ndim - len(self.stored_shape)


def stored_shape(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """``shape`` with the quantized ``axis`` moved last (how it is stored)."""
    rest = tuple(d for i, d in enumerate(shape) if i != axis)
    return (*rest, shape[axis])


def e2m1_decode_table() -> np.ndarray:
    """float32 values of the 16 E2M1 codes (code 8 is -0.0)."""
    return np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)


def is_supported_input_dtype(dtype) -> bool:
    return jnp.dtype(dtype) in (
        jnp.dtype(jnp.float32),
        jnp.dtype(jnp.bfloat16),
        jnp.dtype(jnp.float16),
    )
