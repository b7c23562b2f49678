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

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_nvfp4.matmul import matmul
from jax_nvfp4.ops import dispatch
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
    "OUTPUT",
    "Recipe",
    "ROUTING",
    "W_RESIDUAL",
    "X_RESIDUAL",
    "save_fp4_residuals",
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

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "implementation":
                if value not in ("ffi", "reference"):
                    raise ValueError(
                        "Recipe.implementation must be 'ffi' or 'reference', "
                        f"got {value!r}"
                    )
            elif not isinstance(value, bool):
                raise TypeError(
                    f"Recipe.{field.name} must be True or False, got {value!r}"
                )
        if not (self.fprop or self.dgrad or self.wgrad) and (
            self.rht or self.stochastic_rounding
        ):
            raise ValueError(
                "this Recipe runs every GEMM in bf16, so rht and "
                "stochastic_rounding do nothing: use jax_nvfp4.BF16, or set "
                "them to False"
            )
        if self.stochastic_rounding and not (self.dgrad or self.wgrad):
            raise ValueError(
                "stochastic_rounding rounds dY for the backward GEMMs, but this "
                "Recipe runs both in bf16: set stochastic_rounding=False (or "
                "dgrad/wgrad=True)"
            )

    @property
    def needs_key(self) -> bool:
        return self.stochastic_rounding and (self.dgrad or self.wgrad)


NVFP4 = Recipe()
NVFP4_NO_RHT = Recipe(rht=False)
NVFP4_NO_SR = Recipe(stochastic_rounding=False)
BF16 = Recipe(
    fprop=False, dgrad=False, wgrad=False, rht=False, stochastic_rounding=False
)


def _write_gemm_operands(recipe: Recipe, a: jax.Array) -> bool:
    """Whether the fused quantizations of x and dY write the GEMM operands of
    the outputs that only feed a GEMM -- x's rows, both of dY's -- as decoded
    NVFP4Tensors instead of codes (``dispatch.decoded_operands``)."""
    return recipe.implementation == "ffi" and dispatch.decoded_operands(a.dtype)


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
    # The amaxes are maxima over the finite |values|, reduced over the
    # shards: never invalid, so quantize need not check them.
    common = dict(key=key, implementation=impl, _place=place, _amax_trusted=True)
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


def _quantize_w(w, recipe: Recipe, nk: bool):
    """w [K, N] (or, ``nk``, [N, K]): (along K for FPROP, along N for DGRAD),
    the same values if 2D. Either orientation is read as stored: along its
    last axis row-wise, along its first column-wise; the stored results are
    the same bytes for w and w.T."""
    block = "16x16" if recipe.weight_2d else "1x16"
    impl = recipe.implementation
    k_axis, n_axis = (1, 0) if nk else (0, 1)
    if recipe.fprop and recipe.dgrad:
        # (Along K feeds FPROP only, but stays codes: under FSDP-sharded jit
        # the partitioner gathers it, and codes move 4x fewer bytes than a
        # bf16 operand.)
        rows, cols = quantize_rowwise_and_columnwise(
            w, row_block=block, col_block=block, implementation=impl
        )
        return (rows, cols) if nk else (cols, rows)
    along_k = (
        quantize(w, k_axis, block=block, implementation=impl) if recipe.fprop else None
    )
    along_n = (
        quantize(w, n_axis, block=block, implementation=impl) if recipe.dgrad else None
    )
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


def _explicit_specs(x2, w, nk):
    """Shardings of (x2, w, out) under Explicit mesh axes, else None: the
    bf16 fallback GEMMs must name their output sharding there when they
    contract a sharded dimension (JAX's ShardingTypeError otherwise)."""
    xs, ws = _explicit_sharding(x2), _explicit_sharding(w)
    if xs is None and ws is None:
        return None
    mesh = (xs or ws)[0]
    xspec = xs[1] if xs else (None, None)
    wspec = ws[1] if ws else (None, None)
    out = (xspec[0], wspec[0] if nk else wspec[1])
    return tuple(NamedSharding(mesh, P(*spec)) for spec in (xspec, wspec, out))


def _bf16_dot(a, b, out_spec, preferred_element_type=None, *, a_t=False, b_t=False):
    """a . b (a_t: a transposed; b_t: b transposed) for the GEMMs kept in
    high precision; the transposes are the dot's contracting dims, not
    passes over memory."""
    kwargs = {} if out_spec is None else {"out_sharding": out_spec}
    if preferred_element_type is not None:
        kwargs["preferred_element_type"] = preferred_element_type
    dims = (((0 if a_t else 1,), (1 if b_t else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, **kwargs)


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


def _named(t, name):
    return jax.tree.map(lambda a: checkpoint_name(a, name), t)


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
    """static: (input dtype, output dtype, axis_name, explicit specs, nk: w
    is [N, K])."""
    _, out_dtype, axis_name, specs, nk = static
    tokens = x2.shape[0]
    x_rows, x_cols = _quantize_tokens(
        x2, recipe, rows=recipe.fprop, cols=recipe.wgrad, axis_name=axis_name
    )
    w_along_k, w_along_n = _quantize_w(w, recipe, nk)
    if recipe.fprop:
        out = matmul(x_rows, w_along_k, out_dtype=_gemm_dtype(out_dtype))
        out = out[:tokens].astype(out_dtype)
    else:
        out = _bf16_dot(
            x2,
            w,
            specs and specs[2],
            None if out_dtype == x2.dtype else out_dtype,
            b_t=nk,
        )
    residuals = (
        _named(x_cols, X_RESIDUAL) if recipe.wgrad else x2,
        _named(w_along_n, W_RESIDUAL) if recipe.dgrad else w,
        words,
    )
    return out, residuals


def _dot2_bwd(recipe, static, residuals, dy):
    in_dtype, _, axis_name, specs, nk = static
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
        dx = _bf16_dot(
            dy.astype(w_saved.dtype), w_saved, specs and specs[0], b_t=not nk
        )
    dw_dtype = _gemm_dtype(in_dtype)
    if recipe.wgrad and nk:  # dW [N, K] directly: the operands swapped
        dw = matmul(dy_cols, x_saved, out_dtype=dw_dtype)
    elif recipe.wgrad:
        dw = matmul(x_saved, dy_cols, out_dtype=dw_dtype)
    elif nk:
        dw = _bf16_dot(dy.astype(x_saved.dtype), x_saved, specs and specs[1], a_t=True)
    else:
        dw = _bf16_dot(x_saved, dy.astype(x_saved.dtype), specs and specs[1], a_t=True)
    return dx.astype(in_dtype), dw.astype(in_dtype), None


_dot2.defvjp(_dot2_fwd, _dot2_bwd)


def _check_operands(x2, w2, nk, recipe):
    if x2.dtype != w2.dtype:
        raise TypeError(
            f"x is {x2.dtype} and w is {w2.dtype}; cast both to one dtype "
            "(e.g. w.astype(x.dtype))"
        )
    n, k = w2.shape if nk else w2.shape[::-1]
    if (recipe.fprop or recipe.dgrad or recipe.wgrad) and (k % 16 or n % 16):
        raise ValueError(
            f"the weight is K={k} by N={n} (contracted by free sizes); NVFP4 "
            "GEMMs need K and N multiples of 16 — pad the layer or keep it in "
            "bf16 (recipe=jax_nvfp4.BF16)"
        )


MISSING_KEY_MESSAGE = (
    "this NVFP4 product was differentiated without a key: the recipe rounds "
    "dY stochastically in the backward pass. Pass key=jax.random.key(...) "
    "(a new key each step), or use a recipe without stochastic rounding "
    "(jax_nvfp4.NVFP4_NO_SR)."
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


def _refuse_forward_mode(*operands) -> None:
    """Raises a clear TypeError where the recipe is differentiated in forward
    mode (``jax.jvp``, ``jacfwd``): its derivative is defined only as a VJP
    (stochastic rounding and the FP4 backward GEMMs have no JVP). With direct
    linearization (JAX's default) reverse mode runs under a LinearizeTrace,
    so a JVPTrace carrying a tangent for an operand is forward mode; JAX's
    own, less specific error remains where that cannot be told."""
    try:
        from jax._src import core
        from jax._src.interpreters import ad

        if not jax.config.jax_use_direct_linearize:
            return
        trace = core.trace_ctx.trace
        if not isinstance(trace, ad.JVPTrace):
            return
        tangents = [
            a.tangent
            for a in operands
            if isinstance(a, ad.JVPTracer) and a._trace is trace
        ]
    except (ImportError, AttributeError):  # other JAX versions: JAX's error
        return
    if any(not isinstance(t, ad.Zero) for t in tangents):
        raise TypeError(
            "jax_nvfp4's NVFP4 products define their derivative as a VJP (the "
            "recipe's DGRAD and WGRAD GEMMs), not a JVP: forward-mode "
            "differentiation (jax.jvp, jax.jacfwd, jax.hessian) is not "
            "supported. Use jax.grad / jax.vjp / jax.jacrev, or a bf16 model "
            "(recipe=jax_nvfp4.BF16) for forward-mode derivatives."
        )


def _dot2d(
    x2,
    w2,
    nk,
    *,
    key,
    recipe,
    preferred_element_type,
    axis_name,
    missing_key_message=MISSING_KEY_MESSAGE,
):
    """x2 [T, K] . w2 ([K, N], or [N, K] if ``nk``) -> [T, N] by the recipe.
    Without a key where the recipe needs one, the forward pass runs and
    differentiating it raises ``missing_key_message``."""
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"recipe must be a jax_nvfp4.Recipe (e.g. jax_nvfp4.NVFP4), got {recipe!r}"
        )
    _check_operands(x2, w2, nk, recipe)
    _refuse_forward_mode(x2, w2)
    static = (
        jnp.dtype(x2.dtype),
        jnp.dtype(preferred_element_type or x2.dtype),
        tuple(_axis_names(axis_name)) or None,
        _explicit_specs(x2, w2, nk),
        nk,
    )
    if recipe.needs_key and key is None:
        out = _forward_only(x2, w2, recipe, static, missing_key_message)
    else:
        out = _dot2(x2, w2, key_words(key, recipe.needs_key, 0), recipe, static)
    return checkpoint_name(out, OUTPUT)
