"""The NVFP4 training recipe: which GEMMs of a product run in NVFP4 and how
(``Recipe`` and its presets), and the products built from it.

Modules: ``presets`` (``Recipe`` and the presets), ``residuals`` (the
residual labels and ``save_fp4_residuals``), ``steps`` (the token and weight
quantize steps and the checks every product shares), ``dense`` (the dense
product's custom VJP, behind ``jax_nvfp4.dot``), ``grouped`` (the grouped
product's, behind ``jax_nvfp4.ragged_dot``).
"""

from jax_nvfp4.recipe.presets import BF16, NVFP4, NVFP4_NO_RHT, NVFP4_NO_SR, Recipe
from jax_nvfp4.recipe.residuals import (
    OUTPUT,
    ROUTING,
    W_RESIDUAL,
    X_RESIDUAL,
    save_fp4_residuals,
)
from jax_nvfp4.recipe.steps import MISSING_KEY_MESSAGE  # noqa: F401

__all__ = [
    "BF16",
    "NVFP4",
    "NVFP4_NO_RHT",
    "NVFP4_NO_SR",
    "OUTPUT",
    "Recipe",
    "ROUTING",
    "W_RESIDUAL",
    "X_RESIDUAL",
    "save_fp4_residuals",
]
