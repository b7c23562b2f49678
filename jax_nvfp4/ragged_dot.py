"""Grouped GEMM (mixture of experts): ``ragged_dot`` with the NVFP4 recipe.

y = ragged_dot(x [T, K], w [G, K, N], group_sizes [G]) as
``jax.lax.ragged_dot``: the rows of x are sorted by group, group g's rows
multiply w[g], rows past sum(group_sizes) give zeros. Each expert's GEMM is a
linear layer of its own, with per-group tensor scales (docs/DESIGN.md,
"Expert projections"). This module is the public function: its operand
checks, the key's conversion to words and the result's sharding type; the
recipe's custom VJP over the group-aligned token buffer is
``recipe/grouped.py``.

With an NVFP4Tensor of expert weights and bfloat16 rows (an imported
checkpoint's experts, serving), ``ragged_dot`` is the grouped weight-only
GEMM (W4A16): the weights stay 4-bit and are decoded inside the GEMM
(``ops.ragged_w4a16_matmul``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jax_nvfp4.format import BLOCK_SIZE, NVFP4Tensor, is_supported_input_dtype
from jax_nvfp4.keys import key_words
from jax_nvfp4.ops import sharding, token_buffer
from jax_nvfp4.ops.ragged_w4a16_matmul import ragged_w4a16_matmul
from jax_nvfp4.recipe import NVFP4, OUTPUT, Recipe
from jax_nvfp4.recipe.grouped import grouped_product
from jax_nvfp4.recipe.steps import refuse_forward_mode

__all__ = ["ragged_dot"]


def _check_operands(x, w, group_sizes, recipe):
    """The operands as arrays, group_sizes int32; clear errors otherwise."""
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"recipe must be a jax_nvfp4.Recipe (e.g. jax_nvfp4.NVFP4), got {recipe!r}"
        )
    x, w = (a if hasattr(a, "dtype") else jnp.asarray(a) for a in (x, w))
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(
            "ragged_dot takes x [T, K] (rows sorted by group) and w [G, K, N]; got "
            f"shapes {x.shape} and {w.shape} (fold x's leading axes into T first)"
        )
    if w.shape[0] == 0:
        raise ValueError("w [G, K, N] has no group (G = 0); pass at least one")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has K={x.shape[1]} features but w is {w.shape} [G, K, N]")
    if x.dtype != w.dtype:
        raise TypeError(
            f"x is {x.dtype} and w is {w.dtype}; cast both to one dtype "
            "(e.g. w.astype(x.dtype))"
        )
    if not is_supported_input_dtype(x.dtype):
        raise TypeError(
            f"x and w are {x.dtype}; ragged_dot takes float32, bfloat16 or float16"
        )
    k, n = w.shape[1:]
    if (recipe.fprop or recipe.dgrad or recipe.wgrad) and (k % 16 or n % 16):
        raise ValueError(
            f"each expert's weight is K={k} by N={n}; NVFP4 GEMMs need K and N "
            "multiples of 16 — pad the experts or keep them in bf16 "
            "(recipe=jax_nvfp4.BF16)"
        )
    return x, w, _group_sizes_int32(group_sizes, w.shape[0], x.shape[0])


def _group_sizes_int32(group_sizes, groups: int, rows: int):
    """group_sizes as int32 [groups]; concrete sizes checked."""
    if not hasattr(group_sizes, "dtype"):
        group_sizes = np.asarray(group_sizes)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(
            f"group_sizes must be integers (int32), one row count per group; got "
            f"{group_sizes.dtype}"
        )
    if group_sizes.shape != (groups,):
        raise ValueError(
            f"group_sizes must have shape ({groups},), one row count per group "
            f"(expert); got shape {group_sizes.shape}"
        )
    try:  # concrete sizes can be checked; traced ones cannot
        sizes = np.asarray(group_sizes).astype(np.int64)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        sizes = None
    if sizes is not None and ((sizes < 0).any() or sizes.sum() > rows):
        raise ValueError(
            f"group_sizes {sizes.tolist()} must be non-negative and sum to at "
            f"most the {rows} rows of x: the rows of x are sorted by group, "
            "group g's rows following group g-1's"
        )
    return jnp.asarray(group_sizes, jnp.int32)


def _weight_only(x, w: NVFP4Tensor, group_sizes, preferred_element_type):
    """bfloat16 rows x [T, K] by NVFP4 expert weights: the grouped W4A16 GEMM."""
    if not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if x.dtype != jnp.bfloat16:
        raise TypeError(
            "ragged_dot of activations by NVFP4 expert weights takes bfloat16 "
            f"activations (exact products with the decoded weights); x is "
            f"{x.dtype}: pass x.astype(jnp.bfloat16)"
        )
    # The experts as stored: [G, N, K], quantized along their last axis,
    # which x's K contracts (as matmul takes a weight stored [N, K]).
    stored = w.stored_shape
    if w.batch_ndim == 1 and len(stored) == 2:
        # One tensor per expert, stacked (an imported checkpoint's experts,
        # [out, in] each, or vmap of quantize over w [G, K, N]): amax [G].
        groups, (n, k) = w.codes.shape[0], stored
    elif w.batch_ndim == 0 and len(stored) == 3 and w.axis != 0:
        # All experts quantized as one tensor: one amax for all.
        groups, n, k = stored
    else:
        raise ValueError(
            "the NVFP4 experts must be one tensor per expert, stacked "
            "(jax.tree.map(lambda *a: jnp.stack(a), *experts), or "
            "jax.vmap(lambda e: quantize(e, axis=0))(w) of w [G, K, N]), or one "
            f"tensor quantize(w, axis=1) of w [G, K, N]; got stored shape {stored} "
            f"(quantized axis {w.axis}) with {w.batch_ndim} vmapped axes"
        )
    if groups == 0:
        raise ValueError(
            "the experts [G, N, K] have no group (G = 0); pass at least one"
        )
    if w.rht:
        raise ValueError(
            "the expert weights are Random-Hadamard-transformed along K, which "
            "only cancels against transformed activations: quantize them "
            "without rht for serving"
        )
    if x.ndim != 2:
        raise ValueError(
            f"x {x.shape} must be [T, K] (fold x's leading axes into T first)"
        )
    if x.shape[1] != k:
        raise ValueError(
            f"x has K={x.shape[1]} features but the experts are stored "
            f"[G, N, K] = {[groups, n, k]}, quantized along K: quantize each "
            "expert along its input (K) axis"
        )
    sizes = _group_sizes_int32(group_sizes, groups, x.shape[0])
    dtype = np.dtype(preferred_element_type or jnp.bfloat16)
    if dtype not in (np.dtype(jnp.bfloat16), np.dtype(np.float32)):
        raise TypeError(
            f"preferred_element_type must be bfloat16 or float32 with NVFP4 "
            f"expert weights, got {dtype}"
        )
    amax = jnp.broadcast_to(jnp.asarray(w.amax, jnp.float32).reshape(-1), (groups,))
    return ragged_w4a16_matmul(
        x,
        w.codes.reshape(groups, n, k // 2),
        w.scales.reshape(groups, n, k // BLOCK_SIZE),
        amax,
        sizes,
        dtype=dtype,
    )


def ragged_dot(
    x: jax.Array,
    w: jax.Array | NVFP4Tensor,
    group_sizes: jax.Array,
    precision=None,
    preferred_element_type=None,
    group_offset=None,
    *,
    key: jax.Array | None = None,
    recipe: Recipe = NVFP4,
) -> jax.Array:
    """A drop-in for ``jax.lax.ragged_dot`` running the NVFP4 recipe per group
    (mixture-of-experts layers: each expert's GEMM is a linear layer of its
    own, with its own tensor scales).

    With ``w`` an NVFP4Tensor of expert weights (serving an imported
    checkpoint) it is the grouped weight-only GEMM (W4A16): bfloat16 x times
    the weights decoded inside the GEMM, no bf16 copy of them, forward only
    (``key`` and ``recipe`` do not apply).

    Args:
      x: [T, K] rows sorted by group (float32, bfloat16 or float16;
        bfloat16 with NVFP4 weights).
      w: [G, K, N] one weight per group, x's dtype; K and N multiples of 16.
        Or NVFP4 expert weights quantized along K (stored [G, N, K]): the
        experts' tensors stacked, each with its own amax (an imported
        checkpoint's [out, in] tensors, ``jax.tree.map(lambda *a:
        jnp.stack(a), *experts)``, or ``jax.vmap(lambda e: quantize(e,
        axis=0))(w)`` of w [G, K, N]).
      group_sizes: int [G], the rows of each group, non-negative, summing to
        at most T: rows past their sum give zeros in y and dx and add nothing
        to dw (as in ``lax.ragged_dot``). Concrete sizes are checked; traced
        ones (under ``jit``) cannot be, and negative sizes or a sum past T
        then give unspecified values.
      precision: accepted and ignored (the GEMMs are NVFP4).
      preferred_element_type: the output dtype (default: x's dtype).
      group_offset: not supported (must be None).
      key: PRNG key for stochastic rounding of dY in the backward pass; pass
        a new key each step (required when ``recipe.stochastic_rounding``
        to differentiate; the forward pass runs without one).
      recipe: a ``Recipe``; a GEMM switched off runs as ``lax.ragged_dot``
        in the input dtype, and ``BF16`` is exactly ``lax.ragged_dot``.

    Returns:
      [T, N]; gradients flow to x and w (float32 accumulation).
    """
    if group_offset is not None:
        raise NotImplementedError(
            "ragged_dot's group_offset (a shard of the groups) is not supported; "
            "pass all groups"
        )
    if isinstance(w, NVFP4Tensor):
        return _weight_only(x, w, group_sizes, preferred_element_type)
    x, w, group_sizes = _check_operands(x, w, group_sizes, recipe)
    words = None  # no key where the recipe needs one: forward only
    if not recipe.needs_key or key is not None:
        rows = token_buffer.buffer_rows(x.shape[0], w.shape[0])
        words = key_words(key, recipe.needs_key, rows * max(w.shape[1:]))
    return ragged_product(
        x,
        w,
        group_sizes,
        words=words,
        recipe=recipe,
        preferred_element_type=preferred_element_type,
    )


def ragged_product(
    x, w, group_sizes, *, words, recipe: Recipe, preferred_element_type=None
) -> jax.Array:
    """``ragged_dot`` after its key became stochastic-rounding words
    (``quantize.key_words``, [1, 2]; None where the recipe needs a key and
    there is none: forward only): what a layer with its own key source
    calls."""
    x, w, group_sizes = _check_operands(x, w, group_sizes, recipe)
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    if not (recipe.fprop or recipe.dgrad or recipe.wgrad):
        return lax.ragged_dot(
            x, w, group_sizes, preferred_element_type=preferred_element_type
        )
    refuse_forward_mode(x, w)

    def run(x, w, group_sizes, words):
        return grouped_product(
            x, w, group_sizes, words=words, recipe=recipe, out_dtype=out_dtype
        )

    out = sharding.on_auto_axes(
        run, (x, w, group_sizes, words), lambda: _output_spec(x, w)
    )
    return checkpoint_name(out, OUTPUT)


def _spec_entry(a, dim: int):
    """The mesh axes that ``a``'s type shards dimension ``dim`` over."""
    spec = getattr(getattr(jax.typeof(a), "sharding", None), "spec", None)
    return spec[dim] if spec is not None and dim < len(spec) else None


def _output_spec(x, w):
    """y [T, N] is sharded as x's rows and w's N, as ``lax.ragged_dot``'s
    result is on Explicit axes (rows only where both use one axis)."""
    rows, n = _spec_entry(x, 0), _spec_entry(w, 2)

    def names(entry):
        return set(entry if isinstance(entry, tuple) else (entry,)) - {None}

    return P(rows, None if names(rows) & names(n) else n)
