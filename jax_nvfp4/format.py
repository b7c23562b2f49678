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


def holds_values(codes) -> bool:
    """Whether a GEMM operand's ``codes`` array holds its bfloat16 values e2m1
    * block scale (a decoded operand) rather than packed uint8 codes."""
    return getattr(codes, "dtype", None) == jnp.bfloat16


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
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

    A tensor whose ``codes`` are bfloat16 (``decoded``) holds the elements'
    values e2m1 * block scale ``[*stored_shape]`` (exact; the amax not
    applied) instead of packed codes: the operand form of the bf16 GEMM on
    GPUs without FP4 tensor cores, which the training recipe's fused quantize
    writes directly for operands that feed only a GEMM. Only ``matmul`` takes
    such a tensor.
    """

    codes: jax.Array
    scales: jax.Array
    amax: jax.Array
    shape: tuple[int, ...]
    axis: int
    block: Block = "1x16"
    rht: bool = False

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The logical shape with the quantized axis moved last."""
        rest = tuple(d for i, d in enumerate(self.shape) if i != self.axis)
        return (*rest, self.shape[self.axis])

    @property
    def decoded(self) -> bool:
        """``codes`` holds bfloat16 values e2m1 * scale, not packed codes."""
        return holds_values(self.codes)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def batch_ndim(self) -> int:
        """Leading axes that ``vmap`` added to the arrays of a tensor it
        returned (``shape`` is per example); 0 inside the ``vmap``."""
        return self.codes.ndim - len(self.stored_shape)

    def tree_flatten(self):
        return (self.codes, self.scales, self.amax), (
            self.shape,
            self.axis,
            self.block,
            self.rht,
        )

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def __repr__(self) -> str:
        return (
            f"NVFP4Tensor(shape={self.shape}, axis={self.axis}, "
            f"block={self.block!r}, rht={self.rht}"
            + (", decoded=True)" if self.decoded else ")")
        )


def e2m1_decode_table() -> np.ndarray:
    """float32 values of the 16 E2M1 codes (code 8 is -0.0)."""
    return np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)


def is_supported_input_dtype(dtype) -> bool:
    return jnp.dtype(dtype) in (
        jnp.dtype(jnp.float32),
        jnp.dtype(jnp.bfloat16),
        jnp.dtype(jnp.float16),
    )
