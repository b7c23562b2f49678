"""The NVFP4 linear-layer training recipe: ``dot(x, w)`` with a custom VJP.

y = x . w with x [..., K] and w [K, N]; leading axes of x are folded into one
token axis T. The three GEMMs (docs/DESIGN.md, "The linear-layer recipe"):

  FPROP  y  = x  . w    x: 1x16 nearest along K; w: 16x16 along K
  DGRAD  dx = dy . w^T  dy: 1x16 stochastic along N; w: the same 16x16 values
  WGRAD  dw = x^T . dy  x and dy along T, RHT on both, dy stochastic

One fused pass quantizes x for FPROP and (column-wise, transformed) for
WGRAD, and one quantizes w for FPROP and DGRAD; the backward pass keeps the
FP4 tensors as residuals, never bf16 copies. T is zero-padded to a multiple
of 16 for the column-wise quantizations (zeros change neither the amax nor
x^T dy). K and N must be multiples of 16.

``jax_nvfp4.dot`` and every layer reach it through ``dot2d``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_nvfp4 import ops
from jax_nvfp4.format import is_supported_input_dtype
from jax_nvfp4.keys import key_words
from jax_nvfp4.matmul import matmul_gemm_operands
from jax_nvfp4.ops import dispatch
from jax_nvfp4.quantize import wrap_quantized
from jax_nvfp4.recipe.residuals import OUTPUT, W_RESIDUAL, X_RESIDUAL, named
from jax_nvfp4.recipe.steps import (
    MISSING_KEY_MESSAGE,
    TokenAmaxes,
    axis_names,
    bf16_dot,
    check_recipe,
    explicit_specs,
    gemm_dtype,
    pad_tokens,
    quantize_tokens,
    quantize_weights,
    refuse_forward_mode,
    token_sharding,
    undifferentiated,
)

__all__ = ["dot2d"]


@dataclasses.dataclass(frozen=True)
class _Tokens:
    """The dense product's token layout (``steps.TokenLayout``): a [T, F] as
    one item [1, T zero-padded to a multiple of 16, F] with one amax. Inside
    shard_map with the tokens sharded over ``axis_name``, the amaxes are
    reduced over the shards (one collective) and each shard's
    stochastic-rounding index starts at its first token."""

    axis_name: tuple[str, ...] | None

    def items(self, a):
        return pad_tokens(a, a.shape[0])[None]

    def item_abs_max(self, a, items, impl):
        return impl.abs_max(a).reshape(1)

    def reduce(self, plain, transformed):
        both = jnp.concatenate([plain, transformed])
        names = axis_names(self.axis_name)
        if names:  # one collective for both
            both = jax.lax.pmax(both, names)
        return TokenAmaxes(both[:1], both[1:], both[0], both[1])

    def placement(self, a):
        place = token_sharding(a, self.axis_name)
        if place is None:
            return None, None
        first, tokens = place
        origin = jnp.stack([jnp.int32(0), jnp.asarray(first, jnp.int32), jnp.int32(0)])
        return origin, ops.Place(global_m=tokens, global_k=a.shape[1])

    def elements(self, a):
        place = token_sharding(a, self.axis_name)
        return a.size if place is None else a.shape[1] * place[1]

    def operand(self, values, scales, amax, *, along_tokens, spec):
        """An NVFP4Tensor of the padded tokens [T', F] (a DecodedOperand
        where ``spec.decoded``), quantized along T' or along F."""
        rows, blocks = scales.shape[1:]
        shape = (blocks * 16, rows) if along_tokens else (rows, blocks * 16)
        return wrap_quantized(
            values,
            scales,
            amax,
            shape,
            0 if along_tokens else 1,
            "1x16",
            spec.rht,
            spec.decoded,
        )


def _weights(w, recipe, nk):
    """w [K, N] (or [N, K] if ``nk``): (along K for FPROP, along N for
    DGRAD) as NVFP4Tensors, None where not asked; either orientation is read
    as stored, and the stored results are the same bytes for w and w.T.
    (Along K stays codes even where the GEMM reads decoded operands: under
    FSDP-sharded jit the partitioner gathers it, and codes move 4x fewer
    bytes than a bf16 operand.)"""
    along_k, along_n = quantize_weights(w[None], recipe, k_last=nk)
    block = "16x16" if recipe.weight_2d else "1x16"
    k_axis, n_axis = (1, 0) if nk else (0, 1)

    def tensor(side, axis):
        if side is None:
            return None
        values, scales, amax = side
        return wrap_quantized(values, scales, amax[0], w.shape, axis, block, False)

    return tensor(along_k, k_axis), tensor(along_n, n_axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _dot2(x2, w, words, recipe, static):
    forward = undifferentiated(recipe, dispatch.decoded_operands(x2.dtype))
    out, _ = _dot2_fwd(x2, w, words, forward, static)
    return out


def _dot2_fwd(x2, w, words, recipe, static):
    """static: (input dtype, output dtype, axis_name, explicit specs, nk: w
    is [N, K])."""
    _, out_dtype, axis_name, specs, nk = static
    tokens = x2.shape[0]
    x_rows, x_cols = quantize_tokens(
        x2,
        recipe,
        _Tokens(axis_name),
        rows=recipe.fprop,
        cols=recipe.wgrad,
        decoded=dispatch.decoded_operands(x2.dtype),
    )
    w_along_k, w_along_n = _weights(w, recipe, nk)
    if recipe.fprop:
        out = matmul_gemm_operands(x_rows, w_along_k, out_dtype=gemm_dtype(out_dtype))
        out = out[:tokens].astype(out_dtype)
    else:
        out = bf16_dot(
            x2,
            w,
            specs and specs[2],
            None if out_dtype == x2.dtype else out_dtype,
            b_t=nk,
        )
    residuals = (
        named(x_cols, X_RESIDUAL) if recipe.wgrad else x2,
        named(w_along_n, W_RESIDUAL) if recipe.dgrad else w,
        words,
    )
    return out, residuals


def _dot2_bwd(recipe, static, residuals, dy):
    in_dtype, _, axis_name, specs, nk = static
    x_saved, w_saved, words = residuals
    tokens = dy.shape[0]
    dy_rows, dy_cols = quantize_tokens(
        dy,
        recipe,
        _Tokens(axis_name),
        rows=recipe.dgrad,
        cols=recipe.wgrad,
        stochastic=recipe.stochastic_rounding,
        words=words,
        decoded=dispatch.decoded_operands(dy.dtype),
        decoded_cols=True,  # dY's column-wise copy feeds WGRAD only
    )
    if recipe.dgrad:
        dx = matmul_gemm_operands(dy_rows, w_saved, out_dtype=gemm_dtype(in_dtype))
        dx = dx[:tokens]
    else:
        dx = bf16_dot(dy.astype(w_saved.dtype), w_saved, specs and specs[0], b_t=not nk)
    dw_dtype = gemm_dtype(in_dtype)
    if recipe.wgrad and nk:  # dW [N, K] directly: the operands swapped
        dw = matmul_gemm_operands(dy_cols, x_saved, out_dtype=dw_dtype)
    elif recipe.wgrad:
        dw = matmul_gemm_operands(x_saved, dy_cols, out_dtype=dw_dtype)
    elif nk:
        dw = bf16_dot(dy.astype(x_saved.dtype), x_saved, specs and specs[1], a_t=True)
    else:
        dw = bf16_dot(x_saved, dy.astype(x_saved.dtype), specs and specs[1], a_t=True)
    return dx.astype(in_dtype), dw.astype(in_dtype), None


_dot2.defvjp(_dot2_fwd, _dot2_bwd)


def _check_operands(x2, w2, nk, recipe):
    if x2.dtype != w2.dtype:
        raise TypeError(
            f"x is {x2.dtype} and w is {w2.dtype}; cast both to one dtype "
            "(e.g. w.astype(x.dtype))"
        )
    quantized = recipe.fprop or recipe.dgrad or recipe.wgrad
    if quantized and not is_supported_input_dtype(x2.dtype):
        raise TypeError(
            f"x and w are {x2.dtype}; the NVFP4 recipe quantizes float32, "
            "bfloat16 or float16 operands — cast them (e.g. x.astype("
            "jnp.bfloat16)) or keep this product in its dtype "
            "(recipe=jax_nvfp4.BF16)"
        )
    n, k = w2.shape if nk else w2.shape[::-1]
    if quantized and (k % 16 or n % 16):
        raise ValueError(
            f"the weight is K={k} by N={n} (contracted by free sizes); NVFP4 "
            "GEMMs need K and N multiples of 16 — pad the layer or keep it in "
            "bf16 (recipe=jax_nvfp4.BF16)"
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _forward_only(x2, w2, recipe, static, message):
    """The recipe's forward pass, which never reads the key (stochastic
    rounding is for dY only: the same output bits without it); its backward
    raises ``message``."""
    words = key_words(None, False, 0)
    return _dot2(
        x2, w2, words, dataclasses.replace(recipe, stochastic_rounding=False), static
    )


def _forward_only_fwd(x2, w2, recipe, static, message):
    return _forward_only(x2, w2, recipe, static, message), None


def _forward_only_bwd(recipe, static, message, residuals, dy):
    raise ValueError(message)


_forward_only.defvjp(_forward_only_fwd, _forward_only_bwd)


def dot2d(
    x2,
    w2,
    nk,
    *,
    words,
    recipe,
    preferred_element_type,
    axis_name,
    missing_key_message=MISSING_KEY_MESSAGE,
):
    """x2 [T, K] . w2 ([K, N], or [N, K] if ``nk``) -> [T, N] by the recipe.
    ``words``: the product's stochastic-rounding words (``recipe_words``);
    None where the recipe needs a key and there is none: the forward pass
    runs and differentiating it raises ``missing_key_message``."""
    check_recipe(recipe)
    _check_operands(x2, w2, nk, recipe)
    refuse_forward_mode(x2, w2)
    static = (
        jnp.dtype(x2.dtype),
        jnp.dtype(preferred_element_type or x2.dtype),
        tuple(axis_names(axis_name)) or None,
        explicit_specs(x2, w2, nk),
        nk,
    )
    if words is None:
        out = _forward_only(x2, w2, recipe, static, missing_key_message)
    else:
        out = _dot2(x2, w2, words, recipe, static)
    return checkpoint_name(out, OUTPUT)
