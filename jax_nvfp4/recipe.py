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
import operator

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
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
    "OUTPUT",
    "Recipe",
    "W_RESIDUAL",
    "X_RESIDUAL",
    "dot",
    "dot_general",
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

# A jax.checkpoint policy that keeps exactly the recipe's FP4 residuals (x's
# column-wise copy and w's copy, with their scales and amaxes) and recomputes
# everything else: the backward pass then quantizes neither x nor w again.
save_fp4_residuals = jax.checkpoint_policies.save_only_these_names(
    X_RESIDUAL, W_RESIDUAL
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
      w: [K, N] weight, the same dtype as x (cast master weights first). For
        other weight shapes and orientations (e.g. [N, K]) use ``dot_general``.
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
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    out = _dot2d(
        x2,
        w,
        False,
        key=key,
        recipe=recipe,
        preferred_element_type=preferred_element_type,
        axis_name=axis_name,
    )
    return out.reshape(*x.shape[:-1], w.shape[1])


def _dims(dims, ndim: int, what: str) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise TypeError(
            f"{what} must be a sequence of ints (dimension_numbers = "
            "((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)))"
        ) from None
    for d in dims:
        if not -ndim <= d < ndim:
            raise ValueError(f"{what} has dimension {d}, out of range for rank {ndim}")
    dims = tuple(d % ndim for d in dims)
    if len(set(dims)) != len(dims):
        raise ValueError(f"{what} repeats a dimension: {dims}")
    return dims


def _parse_dimension_numbers(dimension_numbers, lhs, rhs):
    """((lhs contracting, rhs contracting), (lhs batch, rhs batch)), each a
    tuple of non-negative ints, checked against the shapes."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
    except (TypeError, ValueError):
        raise ValueError(
            "dimension_numbers must be ((lhs_contracting, rhs_contracting), "
            f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}"
        ) from None
    lc = _dims(lc, lhs.ndim, "lhs_contracting")
    rc = _dims(rc, rhs.ndim, "rhs_contracting")
    lb = _dims(lb, lhs.ndim, "lhs_batch")
    rb = _dims(rb, rhs.ndim, "rhs_batch")
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(
            "lhs and rhs must list as many contracting dims, and as many batch "
            f"dims, as each other; got dimension_numbers={dimension_numbers}"
        )
    if set(lc) & set(lb) or set(rc) & set(rb):
        raise ValueError(
            f"a dimension is both contracting and batch: {dimension_numbers}"
        )
    for what, lhs_dims, rhs_dims in (("contracting", lc, rc), ("batch", lb, rb)):
        for i, j in zip(lhs_dims, rhs_dims, strict=True):
            if lhs.shape[i] != rhs.shape[j]:
                raise ValueError(
                    f"{what} dims differ in size: lhs dim {i} has "
                    f"{lhs.shape[i]}, rhs dim {j} has {rhs.shape[j]}"
                )
    return lc, rc, lb, rb


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
    _missing_key_message: str = MISSING_KEY_MESSAGE,
    **kwargs,
) -> jax.Array:
    """A drop-in for ``lax.dot_general`` (Flax's ``dot_general=``,
    ``jnp.einsum(..., _dot_general=...)``) running the NVFP4 recipe.

    A weight-like rhs (no batch dims) maps onto the recipe's 2-D problem:
    K = the contracting dims flattened in rhs's order, N = rhs's free dims
    flattened, tokens = lhs's free dims; K and N must be multiples of 16. The
    weight may be stored either way round: contracting dims first ([K, N],
    Flax) or last ([N, K], Equinox and PyTorch) is read as stored; other
    orders are transposed first. With batch dims (attention's activation x
    activation products) the product runs as ``lax.dot_general`` in the
    input precision: the reference recipe defines no NVFP4 form for them.

    ``precision`` is accepted and ignored (the GEMMs are NVFP4);
    ``preferred_element_type`` sets the output dtype; ``out_sharding`` is
    applied as a sharding constraint. Bind ``recipe``, ``key`` (and
    ``axis_name`` inside shard_map; see ``dot``) with functools.partial.
    Returns lax.dot_general's shape: lhs's free dims, then rhs's.
    """
    if kwargs:
        raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
    lc, rc, lb, rb = _parse_dimension_numbers(dimension_numbers, lhs, rhs)
    if lb:
        out = jax.lax.dot_general(
            lhs,
            rhs,
            ((lc, rc), (lb, rb)),
            precision=precision,
            preferred_element_type=preferred_element_type,
        )
    else:
        out = _weight_like(
            lhs,
            rhs,
            lc,
            rc,
            key=key,
            recipe=recipe,
            preferred_element_type=preferred_element_type,
            axis_name=axis_name,
            missing_key_message=_missing_key_message,
        )
    if out_sharding is not None:
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out


def _weight_like(lhs, rhs, lc, rc, **options):
    """lax.dot_general(lhs, rhs, ((lc, rc), ((), ()))) by the 2-D recipe."""
    lhs_free = [d for d in range(lhs.ndim) if d not in lc]
    rhs_free = [d for d in range(rhs.ndim) if d not in rc]
    if not rc or not rhs_free:
        raise ValueError(
            "an NVFP4 dot_general needs at least one contracting dim and one "
            f"free dim on rhs; got rhs shape {rhs.shape} with contracting dims "
            f"{rc}. Keep this product in bf16 (recipe=jax_nvfp4.BF16)."
        )
    # K runs over the contracting dims in rhs's order; lhs's follow the pairing.
    order = sorted(range(len(rc)), key=lambda i: rc[i])
    rc_sorted = [rc[i] for i in order]
    lc_paired = [lc[i] for i in order]
    x_perm = lhs_free + lc_paired
    if x_perm != list(range(lhs.ndim)):
        lhs = jnp.transpose(lhs, x_perm)
    k = math.prod(rhs.shape[d] for d in rc_sorted)
    features = tuple(rhs.shape[d] for d in rhs_free)
    n = math.prod(features)
    free_shape = tuple(lhs.shape[: len(lhs_free)])
    x2 = lhs.reshape(math.prod(free_shape), k)
    contracting_first = rc_sorted + rhs_free == list(range(rhs.ndim))
    contracting_last = rhs_free + rc_sorted == list(range(rhs.ndim))
    if contracting_last and not contracting_first:
        w2, nk = rhs.reshape(n, k), True
    else:
        if not contracting_first:
            rhs = jnp.transpose(rhs, rc_sorted + rhs_free)
        w2, nk = rhs.reshape(k, n), False
    out = _dot2d(x2, w2, nk, **options)
    return out.reshape(*free_shape, *features)
