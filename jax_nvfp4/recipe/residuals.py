"""What the recipe's products keep for the backward pass: the ``checkpoint_name``
labels of their FP4 residuals, output and routing, and the remat policy that
keeps exactly the residuals."""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

__all__ = [
    "OUTPUT",
    "ROUTING",
    "W_RESIDUAL",
    "X_RESIDUAL",
    "named",
    "save_fp4_residuals",
]


# checkpoint_name labels of the recipe's FP4 residuals (codes, scales and
# amax of each): x's column-wise copy for WGRAD and w's copy for DGRAD.
X_RESIDUAL = "nvfp4_x_columnwise"


W_RESIDUAL = "nvfp4_w"


# The label of each NVFP4 product's output, for policies that also keep it
# (save_only_these_names(X_RESIDUAL, W_RESIDUAL, OUTPUT)).
OUTPUT = "nvfp4_output"


# The label of a mixture-of-experts block's routing decisions (the experts
# each token chose). A policy that keeps the FP4 residuals must keep these
# too: ragged_dot's x residual is laid out by the forward pass's routing, and
# a recomputed routing may choose differently for a token near a tie (XLA
# need not round the recomputation as it rounded the forward pass), which
# would pair WGRAD's saved x rows with other tokens' dY rows.
ROUTING = "nvfp4_routing"


# A jax.checkpoint policy that keeps exactly the recipe's FP4 residuals (x's
# column-wise copy and w's copy, with their scales and amaxes) and the
# routing decisions labelled ROUTING, and recomputes everything else: the
# backward pass then quantizes neither x nor w again.
save_fp4_residuals = jax.checkpoint_policies.save_only_these_names(
    X_RESIDUAL, W_RESIDUAL, ROUTING
)


def named(t, name):
    return jax.tree.map(lambda a: checkpoint_name(a, name), t)
