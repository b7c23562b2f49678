"""The decoded GEMM operand: an NVFP4 operand written as its bfloat16 values.

e2m1 times an E4M3 block scale is exact in bfloat16, so a bf16 GEMM with
float32 accumulation computes NVFP4's exact products (docs/DESIGN.md, section
5). Where the GEMM reads bfloat16 (GPUs without FP4 tensor cores), the
training recipe's fused quantize writes those values for the operands that
only feed a GEMM instead of codes the GEMM would decode right after. This is
that operand's type: internal, made by the recipe's token step
(``recipe.steps.quantize_tokens``) when the dispatcher asks for it
(``ops.dispatch.decoded_operands``) and taken only by
``matmul.matmul_gemm_operands``. Public functions take ``NVFP4Tensor``, which
always holds codes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_nvfp4.format import Block, QuantizedArrays, check_leaf_dtype

__all__ = ["DecodedOperand"]


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, repr=False)
class DecodedOperand(QuantizedArrays):
    """A GEMM operand as bfloat16 e2m1 * block scale, with the metadata of the
    NVFP4Tensor it stands for.

    Attributes:
      values: bfloat16 ``[*stored_shape]``, e2m1(code) * scale (exact; the
        amax not applied); NaN on the blocks the quantize marked non-finite.
      scales: float8_e4m3fn ``[*stored_shape[:-1], L // 16]``, the block
        scales the values were decoded with (the GEMM primitives' operand
        layout counts the contraction's blocks from them).
      amax: float32 scalar, the tensor's global amax (the GEMM's alpha).
      shape, axis, block, rht: as ``NVFP4Tensor``'s.
    """

    _data = "values"

    values: jax.Array
    scales: jax.Array
    amax: jax.Array
    shape: tuple[int, ...]
    axis: int
    block: Block = "1x16"
    rht: bool = False

    def __post_init__(self):
        check_leaf_dtype(
            self.values,
            jnp.bfloat16,
            "DecodedOperand.values must be bfloat16 e2m1 * block scale",
        )
