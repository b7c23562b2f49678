"""jax_nvfp4: NVFP4 4-bit quantization and training primitives for JAX.

Quantization follows NVIDIA Transformer Engine's NVFP4BlockScaling recipe:
E2M1 values in blocks of 16 with an E4M3 scale per block and a float32 scale
per tensor, optional 16x16 (2D) blocks, Random Hadamard Transform and
stochastic rounding. The work is done by XLA FFI custom calls on CPU and CUDA;
``jax_nvfp4.reference`` is the pure-JAX twin of every handler. Integrations:
``jax_nvfp4.flax`` (linen and NNX) and ``jax_nvfp4.equinox``, with layer
selection by ``jax_nvfp4.policy``.
"""

from jax_nvfp4 import checkpoint, config, policy, reference, statistics
from jax_nvfp4.dot import dot, dot_general
from jax_nvfp4.format import (
    BLOCK_SIZE,
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    SCALE_RANGE,
    NVFP4Tensor,
)
from jax_nvfp4.matmul import matmul
from jax_nvfp4.ops.targets import (
    MissingHandlersWarning,
    available_platforms,
    export_safety_checks,
)
from jax_nvfp4.quantize import (
    dequantize,
    global_amax,
    quantize,
    quantize_rowwise_and_columnwise,
)
from jax_nvfp4.ragged_dot import ragged_dot
from jax_nvfp4.recipe import (
    BF16,
    NVFP4,
    NVFP4_NO_RHT,
    NVFP4_NO_SR,
    OUTPUT,
    ROUTING,
    W_RESIDUAL,
    X_RESIDUAL,
    Recipe,
    save_fp4_residuals,
)
from jax_nvfp4.statistics import quantization_stats

__version__ = "0.1.0"

__all__ = [
    "BF16",
    "NVFP4",
    "NVFP4_NO_RHT",
    "NVFP4_NO_SR",
    "OUTPUT",
    "ROUTING",
    "W_RESIDUAL",
    "X_RESIDUAL",
    "Recipe",
    "dot",
    "dot_general",
    "ragged_dot",
    "save_fp4_residuals",
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "SCALE_RANGE",
    "NVFP4Tensor",
    "MissingHandlersWarning",
    "available_platforms",
    "export_safety_checks",
    "dequantize",
    "global_amax",
    "matmul",
    "quantize",
    "quantize_rowwise_and_columnwise",
    "quantization_stats",
    "checkpoint",
    "config",
    "policy",
    "reference",
    "statistics",
]
