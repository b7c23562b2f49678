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
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_nvfp4 import ops
from jax_nvfp4.matmul import matmul
from jax_nvfp4.quantize import (
    global_amax,
    implementation_ops,
    key_words,
    quantize,
    quantize_rowwise_and_columnwise,
)

__all__ = [
    "BF16",
    "NVFP4",
    "NVFP4_NO_RHT",
    "NVFP4_NO_SR",
    "Recipe",
    "dot",
    "dot_general",
]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Which GEMMs run in NVFP4 and how (the switches of the reference recipe).

    Attributes:
      fprop, dgrad, wgrad: run that GEMM in NVFP4 (False: in the input dtype).
      rht: Random Hadamard Transform on WGRAD's inputs (te_nvfp4); False is
        te_nvfp4_no_rht.
      stochastic_rounding: stochastic rounding of dY (needs a key per call).
      weight_2d: 16x16 block scaling of w (False: 1x16 blocks along each GEMM's
        contraction axis, so FPROP's and DGRAD's w differ).
      implementation: "ffi" (custom calls) or "reference" (pure JAX).
    """

    fprop: bool = True
    dgrad: bool = True
    wgrad: bool = True
    rht: bool = True
    stochastic_rounding: bool = True
    weight_2d: bool = True
    implementation: str = "ffi"

    @property
    def needs_key(self) -> bool:
        return self.stochastic_rounding and (self.dgrad or self.wgrad)


NVFP4 = Recipe()
NVFP4_NO_RHT = Recipe(rht=False)
NVFP4_NO_SR = Recipe(stochastic_rounding=False)
BF16 = Recipe(fprop=False, dgrad=False, wgrad=False)


def _write_gemm_operands(recipe: Recipe, a: jax.Array) -> bool:
    """Whether the fused quantizations of x and dY write the GEMM operands of
    the outputs that only feed a GEMM -- x's rows, both of dY's -- as decoded
    NVFP4Tensors instead of codes (``ops.gemm_takes_values``)."""
    return recipe.implementation == "ffi" and ops.gemm_takes_values(a.dtype)


def _pad_tokens(a: jax.Array, tokens: int) -> jax.Array:
    padded = -(-tokens // 16) * 16
    return a if padded == tokens else jnp.pad(a, ((0, padded - tokens), (0, 0)))


def _axis_names(axis_name) -> tuple[str, ...]:
    if axis_name is None:
        return ()
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def _token_sharding(a2, axis_name):
    """Inside shard_map with tokens sharded over ``axis_name``: where this
    shard's tokens sit, (first token, all tokens); None otherwise."""
    names = _axis_names(axis_name)
    if not names:
        return None
    tokens = a2.shape[0]
    if tokens % 16:
        raise ValueError(
            f"with axis_name={axis_name!r} each shard's token count must be a "
            f"multiple of 16 (blocks along the token axis may not span shards); "
            f"this shard has {tokens} tokens"
        )
    index, count = jnp.int32(0), 1
    for name in names:
        size = jax.lax.axis_size(name)
        index = index * size + jax.lax.axis_index(name).astype(jnp.int32)
        count *= size
    return index * tokens, tokens * count


def _shard_amaxes(a2, rht, axis_name, implementation):
    """(plain amax, token-axis RHT amax) of the whole token-sharded tensor;
    one read of a2 and one collective."""
    names = _axis_names(axis_name)
    if not names:
        return None, None
    if not rht:
        plain = jax.lax.pmax(global_amax(a2), names)
        return plain, plain
    impl = implementation_ops(implementation)
    both = impl.amax(a2.reshape(1, *a2.shape), cols=True)[0]  # (plain, RHT)
    both = jax.lax.pmax(both, names)
    return both[0], both[1]


def _quantize_tokens(
    a2,
    recipe: Recipe,
    *,
    rows,
    cols,
    rounding="nearest",
    key=None,
    axis_name=None,
    decoded_cols=False,
):
    """a [T, F] (x or dY): row-wise along F (1x16) if ``rows``; column-wise
    along T if ``cols`` (the recipe's RHT, stream 1), T zero-padded to a
    multiple of 16; one fused pass when both. With both, the rows (and the
    columns if ``decoded_cols``) come as GEMM operands where
    ``_write_gemm_operands``."""
    impl = recipe.implementation
    place = _token_sharding(a2, axis_name)
    row_amax, col_amax = _shard_amaxes(a2, recipe.rht and cols, axis_name, impl)
    padded = _pad_tokens(a2, a2.shape[0])
    common = dict(key=key, implementation=impl, _place=place)
    if rows and cols:
        operands = _write_gemm_operands(recipe, a2)
        return quantize_rowwise_and_columnwise(
            padded,
            row_rounding=rounding,
            col_rounding=rounding,
            col_rht=recipe.rht,
            row_amax=row_amax,
            col_amax=col_amax,
            _row_decoded=operands,
            _col_decoded=operands and decoded_cols,
            **common,
        )
    along_f = (
        quantize(a2, -1, rounding=rounding, amax=row_amax, **common) if rows else None
    )
    along_t = (
        quantize(
            padded,
            0,
            rht=recipe.rht,
            rounding=rounding,
            amax=col_amax,
            stream=1,
            **common,
        )
        if cols
        else None
    )
    return along_f, along_t


def _quantize_w(w, recipe: Recipe):
    """w [K, N]: (along K for FPROP, along N for DGRAD), same values if 2D."""
    block = "16x16" if recipe.weight_2d else "1x16"
    impl = recipe.implementation
    if recipe.fprop and recipe.dgrad:
        # (Along K feeds FPROP only, but stays codes: under FSDP-sharded jit
        # the partitioner gathers it, and codes move 4x fewer bytes than a
        # bf16 operand.)
        along_n, along_k = quantize_rowwise_and_columnwise(
            w, row_block=block, col_block=block, implementation=impl
        )
        return along_k, along_n
    along_k = quantize(w, 0, block=block, implementation=impl) if recipe.fprop else None
    along_n = quantize(w, 1, block=block, implementation=impl) if recipe.dgrad else None
    return along_k, along_n


def _explicit_sharding(a):
    """a's (mesh, PartitionSpec) if a is sharded over Explicit mesh axes."""
    try:
        sharding = jax.typeof(a).sharding
    except (AttributeError, TypeError):  # older JAX: no sharding in types
        return None
    mesh = getattr(sharding, "mesh", None)
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    if mesh is None or explicit is None:
        return None
    if not any(t == explicit for t in getattr(mesh, "axis_types", ())):
        return None
    return mesh, tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec))


def _explicit_specs(x2, w):
    """Shardings of (x2, w, out) under Explicit mesh axes, else None: the
    bf16 fallback GEMMs must name their output sharding there when they
    contract a sharded dimension (JAX's ShardingTypeError otherwise)."""
    xs, ws = _explicit_sharding(x2), _explicit_sharding(w)
    if xs is None and ws is None:
        return None
    mesh = (xs or ws)[0]
    xspec = xs[1] if xs else (None, None)
    wspec = ws[1] if ws else (None, None)
    return tuple(
        NamedSharding(mesh, P(*spec)) for spec in (xspec, wspec, (xspec[0], wspec[1]))
    )


def _bf16_dot(a, b, out_spec, preferred_element_type=None):
    """jnp.dot for the GEMMs kept in high precision."""
    kwargs = {} if out_spec is None else {"out_sharding": out_spec}
    if preferred_element_type is not None:
        kwargs["preferred_element_type"] = preferred_element_type
    return jnp.dot(a, b, **kwargs)


def _gemm_dtype(dtype):
    """The GEMM's own output type for a result of `dtype`: bfloat16 and
    float32 directly (rounded once from the float32 accumulator, as a cast
    of the float32 result would be), anything else through float32."""
    return dtype if dtype in (jnp.bfloat16, jnp.float32) else jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _dot2(x2, w, words, recipe, static):
    out, _ = _dot2_fwd(x2, w, words, recipe, static)
    return out


def _dot2_fwd(x2, w, words, recipe, static):
    """static: (input dtype, output dtype, axis_name, explicit specs)."""
    _, out_dtype, axis_name, specs = static
    tokens = x2.shape[0]
    x_rows, x_cols = _quantize_tokens(
        x2, recipe, rows=recipe.fprop, cols=recipe.wgrad, axis_name=axis_name
    )
    w_along_k, w_along_n = _quantize_w(w, recipe)
    if recipe.fprop:
        out = matmul(x_rows, w_along_k, out_dtype=_gemm_dtype(out_dtype))
        out = out[:tokens].astype(out_dtype)
    else:
        out = _bf16_dot(
            x2,
            w,
            specs and specs[2],
            None if out_dtype == x2.dtype else out_dtype,
        )
    residuals = (
        x_cols if recipe.wgrad else x2,
        w_along_n if recipe.dgrad else w,
        words,
    )
    return out, residuals


def _dot2_bwd(recipe, static, residuals, dy):
    in_dtype, _, axis_name, specs = static
    x_saved, w_saved, words = residuals
    tokens = dy.shape[0]
    dy_rows, dy_cols = _quantize_tokens(
        dy,
        recipe,
        rows=recipe.dgrad,
        cols=recipe.wgrad,
        rounding="stochastic" if recipe.stochastic_rounding else "nearest",
        key=words[0] if recipe.stochastic_rounding else None,
        axis_name=axis_name,
        decoded_cols=True,  # dY's column-wise copy feeds WGRAD only
    )
    if recipe.dgrad:
        dx = matmul(dy_rows, w_saved, out_dtype=_gemm_dtype(in_dtype))[:tokens]
    else:
        dx = _bf16_dot(dy.astype(w_saved.dtype), w_saved.T, specs and specs[0])
    if recipe.wgrad:
        dw = matmul(x_saved, dy_cols, out_dtype=_gemm_dtype(in_dtype))
    else:
        dw = _bf16_dot(x_saved.T, dy.astype(x_saved.dtype), specs and specs[1])
    return dx.astype(in_dtype), dw.astype(in_dtype), None


_dot2.defvjp(_dot2_fwd, _dot2_bwd)


def dot(
    x: jax.Array,
    w: jax.Array,
    *,
    key: jax.Array | None = None,
    recipe: Recipe = NVFP4,
    preferred_element_type=None,
    axis_name: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """y = x . w with the NVFP4 training recipe in its forward and backward pass.

    Args:
      x: [..., K] activations (bfloat16, float16 or float32).
      w: [K, N] weight, the same dtype as x (cast master weights first).
      key: PRNG key for stochastic rounding of dY in the backward pass; pass a
        new key each step (required when ``recipe.stochastic_rounding``).
      recipe: a ``Recipe``; presets NVFP4, NVFP4_NO_RHT, NVFP4_NO_SR, BF16.

      preferred_element_type: output dtype (default: x's dtype).
      axis_name: inside ``shard_map``, the mesh axis (or axes, major first)
        over which x's tokens (its leading axes, flattened) are sharded, in
        equal shards of a multiple of 16 tokens. The amaxes of x and dY are
        then reduced over those axes and stochastic rounding follows the
        global token index, so every shard quantizes exactly as one device
        would; dw is this shard's partial sum (reduce it, e.g. by gathering
        w with ``all_gather``, whose transpose reduce-scatters). Under plain
        ``jit`` with shardings leave it None: the primitives partition
        themselves.

    Returns:
      [..., N]; gradients flow to x and w (float32 accumulation).
    """
    if x.ndim < 1 or w.ndim != 2:
        raise ValueError(
            f"dot takes x [..., K] and w [K, N]; got shapes {x.shape} and {w.shape}"
        )
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"x has K={x.shape[-1]} features but w has {w.shape[0]} rows")
    if x.dtype != w.dtype:
        raise TypeError(
            f"x is {x.dtype} and w is {w.dtype}; cast both to one dtype "
            "(e.g. w.astype(x.dtype))"
        )
    k, n = w.shape
    if (recipe.fprop or recipe.dgrad or recipe.wgrad) and (k % 16 or n % 16):
        raise ValueError(
            f"w is [{k}, {n}]; NVFP4 GEMMs need K and N multiples of 16 — pad the "
            "layer or keep it in bf16 (Recipe(fprop=False, dgrad=False, "
            "wgrad=False))"
        )
    if recipe.needs_key and key is None:
        raise ValueError(
            "the recipe uses stochastic rounding in the backward pass: pass "
            "key=jax.random.key(...) (a new key each step), or use NVFP4_NO_SR"
        )
    words = key_words(key, recipe.needs_key, 0)
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    static = (
        jnp.dtype(x.dtype),
        jnp.dtype(preferred_element_type or x.dtype),
        tuple(_axis_names(axis_name)) or None,
        _explicit_specs(x2, w),
    )
    return _dot2(x2, w, words, recipe, static).reshape(*x.shape[:-1], n)


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    recipe: Recipe = NVFP4,
    key: jax.Array | None = None,
    axis_name: str | tuple[str, ...] | None = None,
    out_sharding=None,
    **kwargs,
) -> jax.Array:
    """A drop-in for ``lax.dot_general`` in dense layers (Flax's ``dot_general=``).

    Supports the dense-layer form: lhs [..., K] contracted on its last axis with
    rhs [K, N] on axis 0, no batch dimensions; others raise. ``precision`` is
    accepted and ignored (the GEMMs are NVFP4); ``preferred_element_type`` sets
    the output dtype; ``out_sharding`` is applied as a sharding constraint.
    Bind ``recipe``, ``key`` (and ``axis_name`` inside shard_map; see
    ``dot``) with functools.partial.
    """
    del precision
    if kwargs:
        raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if (
        tuple(lhs_batch)
        or tuple(rhs_batch)
        or tuple(lhs_contract) != (lhs.ndim - 1,)
        or tuple(rhs_contract) != (0,)
        or rhs.ndim != 2
    ):
        raise NotImplementedError(
            "jax_nvfp4.dot_general supports the dense-layer form: lhs [..., K] "
            "contracted on its last axis with rhs [K, N] on axis 0, no batch "
            f"dimensions; got dimension_numbers={dimension_numbers} for shapes "
            f"{lhs.shape} and {rhs.shape}"
        )
    out = dot(
        lhs,
        rhs,
        key=key,
        recipe=recipe,
        preferred_element_type=preferred_element_type,
        axis_name=axis_name,
    )
    if out_sharding is not None:
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out
