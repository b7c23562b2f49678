"""The grouped GEMM primitives of ``ragged_dot`` (mixture of experts), on a
token buffer whose groups are consecutive runs of rows (tokens), in order;
``sizes`` [G] gives each group's count there (multiples of 16 where the
tokens are the contraction):

* ``grouped_matmul_rows`` (FPROP, DGRAD): a [1, R, L] (codes [1, R, L/2],
  scales [1, R, L/16]) by b [G, N, L] -> out [R, N]; row r of group g is
  alpha_g * sum_l a[r, l] b[g, n, l]. Rows outside every group: zeros on
  the CPU and in the twin, unspecified on GPUs.
* ``grouped_matmul_tokens`` (WGRAD): a [items, M, 16] and b [items, N, 16]
  (codes [items, rows, 8], scales [items, rows, 1]: 16 tokens per item
  along the last axis) -> out [G, M, N]; out[g] = alpha_g * the sum over
  group g's tokens of a^T b. An empty group gives zeros.

alpha_g = (A_a[g] / 2688) * (A_b[g] / 2688) from the per-group amaxes [G],
applied once to the float32 sums, one rounding to ``dtype``. An operand's
codes may hold its bfloat16 values e2m1 * scale instead
(``reference.gemm.is_decoded``), as the matmul primitive's may. ``origin``
[1] is the buffer row (rows form) or item (tokens form) of the operands'
first one: 0, or a shard's offset.

Lowerings: the CPU runs the matmul primitive's CPU handler once per group
(the other groups masked), so each sum is the handler's in-order sum and
results equal the twin (``reference.grouped_matmul_rows`` / ``_tokens``) bit
for bit; on CUDA the GEMM that ``dispatch.grouped_path`` picks for the
devices lowered for (``lowering_body``).

Sharding: the rows form partitions along a's rows (each shard finds its
rows' groups from ``origin``), b's N and the contraction (partial sums then
``psum``); the experts axis G stays whole. The tokens form partitions along
M, N and the items (the contraction); a shard's partial sums are unscaled,
alpha is applied once after the ``psum``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_nvfp4 import reference
from jax_nvfp4.backends import (
    bf16_grouped_gemm,
    fp4_grouped_gemm,
    group_alignment,
    library,
)
from jax_nvfp4.format import BLOCK_SIZE, SCALE_RANGE
from jax_nvfp4.ops import batching, dispatch, primitive
from jax_nvfp4.ops.matmul import matmul_p
from jax_nvfp4.ops.sharding import Dim, Layout
from jax_nvfp4.reference.gemm import is_decoded

__all__ = [
    "grouped_matmul_rows",
    "grouped_matmul_rows_p",
    "grouped_matmul_tokens",
    "grouped_matmul_tokens_p",
    "lowering_body",
]

# The CPU handler whose in-order sums the CPU lowering runs per group.
_MATMUL_TARGET = "jax_nvfp4_matmul"
_F32 = np.dtype(np.float32)


def _group_of(sizes, positions):
    """The group of each buffer position (G past the groups), int32."""
    ends = jnp.cumsum(sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, positions, side="right").astype(jnp.int32)


def _local_sizes(sizes, start, length):
    """The groups' counts within positions [start, start + length)."""
    ends = jnp.clip(jnp.cumsum(sizes.astype(jnp.int32)) - start, 0, length)
    return jnp.diff(ends, prepend=jnp.zeros(1, jnp.int32))


def _alpha(a_amax, b_amax):
    """alpha_g = (A_a / 2688) * (A_b / 2688) [G] (IEEE division)."""
    r = jnp.float32(SCALE_RANGE)
    return reference.divide(a_amax, r) * reference.divide(b_amax, r)


def _decoded(*operands) -> bool:
    return any(is_decoded(o) for o in operands)


# --- abstract evaluation ---------------------------------------------------------


def _rows_abstract(a_codes, a_scales, a_amax, b_codes, *_, dtype):
    return jax.core.ShapedArray((a_codes.shape[1], b_codes.shape[1]), dtype)


def _tokens_abstract(
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, *_, dtype
):
    return jax.core.ShapedArray(
        (sizes.shape[0], a_codes.shape[1], b_codes.shape[1]), dtype
    )


# --- CPU: the matmul handler once per group ---------------------------------------


def _handler_sums(a_codes, a_scales, b_codes, b_scales):
    """Unscaled in-order float32 sums [m, n] of a [1, m, L] and b [1, n, L]
    (codes) by the CPU matmul handler: both amaxes 2688 make its alpha 1."""
    unit = jnp.full((1,), SCALE_RANGE, jnp.float32)
    sums = primitive.local(matmul_p).bind(
        a_codes, a_scales, unit, b_codes, b_scales, unit, dtype=_F32
    )
    return sums[0]


def _on_handler(a_codes, b_codes) -> bool:
    """Whether the CPU handler can compute the sums: codes (it multiplies
    codes; decoded operands take the twin, which adds in the same order) and
    a registered handler."""
    return not _decoded(a_codes, b_codes) and _MATMUL_TARGET in library.targets_on(
        "cpu"
    )


def _rows_per_group(*operands, dtype):
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin = operands
    if not _on_handler(a_codes, b_codes):
        return reference.grouped_matmul_rows(*operands, dtype=dtype)
    rows = a_codes.shape[1]
    row_group = _group_of(sizes, origin[0] + jnp.arange(rows, dtype=jnp.int32))

    def one_group(g, acc):
        sums = _handler_sums(
            a_codes,
            a_scales,
            lax.dynamic_index_in_dim(b_codes, g),
            lax.dynamic_index_in_dim(b_scales, g),
        )
        return jnp.where((row_group == g)[:, None], sums, acc)

    # Group 0 outside the loop: the carry then has the operands' variance
    # inside shard_map (a constant zero carry would not).
    acc = one_group(0, jnp.zeros((rows, b_codes.shape[1]), jnp.float32))
    acc = lax.fori_loop(1, sizes.shape[0], one_group, acc)
    row_alpha = _alpha(a_amax, b_amax).at[row_group].get(mode="fill", fill_value=0)
    return (acc * row_alpha[:, None]).astype(dtype)


def _tokens_per_group(*operands, dtype):
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin = operands
    if not _on_handler(a_codes, b_codes):
        return reference.grouped_matmul_tokens(*operands, dtype=dtype)
    items = a_codes.shape[0]
    item_group = _group_of(
        sizes // BLOCK_SIZE, origin[0] + jnp.arange(items, dtype=jnp.int32)
    )

    def stored(t):  # [items, F, l] -> [1, F, items * l]: tokens last
        return jnp.swapaxes(t, 0, 1).reshape(1, t.shape[1], -1)

    a_values, a_scales = stored(a_codes), stored(a_scales)
    b_values, b_scales = stored(b_codes), stored(b_scales)
    code_bytes = a_codes.shape[-1]

    def one_group(g):
        # Other groups' blocks become zero codes and scales, in both
        # operands so that their NaN blocks add nothing; zeros leave an
        # in-order sum from +0 unchanged.
        block = item_group == g
        byte = jnp.repeat(block, code_bytes)

        def mask(t, keep):
            return jnp.where(keep, t, jnp.zeros((), t.dtype))

        return _handler_sums(
            mask(a_values, byte),
            mask(a_scales, block),
            mask(b_values, byte),
            mask(b_scales, block),
        )

    acc = lax.map(one_group, jnp.arange(sizes.shape[0], dtype=jnp.int32))
    return (acc * _alpha(a_amax, b_amax)[:, None, None]).astype(dtype)


# --- CUDA: the GEMM of dispatch.grouped_path ---------------------------------------


def _gemm_dtype(dtype):
    """The native GEMM writes bfloat16 or float32; other dtypes go through
    float32 (one rounding from the float32 result, as on the CPU)."""
    ok = (np.dtype(jnp.bfloat16), _F32)
    return np.dtype(dtype) if np.dtype(dtype) in ok else _F32


def _rows_bf16(kernel: str) -> Callable:
    def body(*operands, dtype):
        a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin = operands
        local = _local_sizes(sizes, origin[0], a_codes.shape[1])
        return bf16_grouped_gemm.rows(
            reference.operand_bf16(a_codes, a_scales)[0],
            reference.operand_bf16(b_codes, b_scales),
            local,
            _alpha(a_amax, b_amax),
            dtype,
            kernel=kernel,
        )

    return body


def _tokens_bf16(kernel: str) -> Callable:
    def body(*operands, dtype):
        a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin = operands
        local = _local_sizes(sizes // BLOCK_SIZE, origin[0], a_codes.shape[0])
        return bf16_grouped_gemm.tokens(
            reference.operand_bf16(a_codes, a_scales),
            reference.operand_bf16(b_codes, b_scales),
            local * BLOCK_SIZE,
            _alpha(a_amax, b_amax),
            dtype,
            kernel=kernel,
        )

    return body


def _rows_native(*operands, dtype):
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin = operands
    # The groups move to multiples of 128 rows for the native GEMM, and back.
    rows, n = a_codes.shape[1], b_codes.shape[1]
    local = _local_sizes(sizes, origin[0], rows)
    src, _ = group_alignment.realigned_rows(
        local, rows, granule=1, alignment=fp4_grouped_gemm.GROUP_ALIGNMENT
    )
    take = group_alignment.take
    out = fp4_grouped_gemm.rows(
        take(a_codes[0], src),
        take(a_scales[0], src),
        a_amax,
        b_codes,
        b_scales,
        b_amax,
        fp4_grouped_gemm.aligned_sizes(local),
        _gemm_dtype(dtype),
    )
    out = jnp.zeros((rows, n), out.dtype).at[src].set(out, mode="drop")
    return out.astype(dtype)


def _tokens_native(*operands, dtype):
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin = operands
    local = _local_sizes(sizes // BLOCK_SIZE, origin[0], a_codes.shape[0])
    local = local * BLOCK_SIZE
    src, _ = fp4_grouped_gemm.realigned_items(local, a_codes.shape[0])
    take = group_alignment.take
    out = fp4_grouped_gemm.tokens(
        take(a_codes, src),
        take(a_scales, src),
        a_amax,
        take(b_codes, src),
        take(b_scales, src),
        b_amax,
        fp4_grouped_gemm.aligned_sizes(local),
        _gemm_dtype(dtype),
    )
    return out.astype(dtype)


_BODIES = {
    "rows": {
        "per_group": _rows_per_group,
        "engine": _rows_bf16("engine"),
        "bf16_handler": _rows_bf16("mma"),
        "xla_ragged": _rows_bf16("xla"),
        "native_fp4": _rows_native,
    },
    "tokens": {
        "per_group": _tokens_per_group,
        "engine": _tokens_bf16("engine"),
        "bf16_handler": _tokens_bf16("mma"),
        "xla_ragged": _tokens_bf16("xla"),
        "native_fp4": _tokens_native,
    },
}


def lowering_body(form: str, path: str) -> Callable:
    """The pure-JAX body a form ("rows" or "tokens") lowers to on a GEMM path
    (one of ``dispatch.GROUPED``), with the primitive's signature (origin
    required): what the lowering runs, callable directly."""
    try:
        return _BODIES[form][path]
    except KeyError:
        raise ValueError(
            f"no grouped GEMM body for form {form!r} and path {path!r}; forms: "
            f"{sorted(_BODIES)}, paths: {list(dispatch.GROUPED)}"
        ) from None


def _cuda(form: str) -> primitive.ChosenAtLowering:
    def choose(ctx, **params):
        a, b, sizes = ctx.avals_in[0], ctx.avals_in[3], ctx.avals_in[6]
        path = dispatch.grouped_path(
            ctx, decoded=_decoded(a, b), groups=sizes.shape[0], n=b.shape[1]
        )
        return functools.partial(_BODIES[form][path], **params)

    return primitive.ChosenAtLowering(choose)


# --- sharding ---------------------------------------------------------------------


def _codes_dim(factor, length, blocks):
    """Codes hold 8 bytes per 16-element block, decoded operands 16."""
    return Dim(factor, 16 if length == 16 * blocks != 0 else 8)


def _rows_layout(shapes, **_):
    (_, rows, a_len), (_, _, blocks), _, (_, n, b_len), *_ = shapes
    whole = (Dim(None),)
    return Layout(
        operands=(
            (Dim(None), Dim("m"), _codes_dim("k", a_len, blocks)),
            (Dim(None), Dim("m"), Dim("k")),
            whole,
            (Dim(None), Dim("n"), _codes_dim("k", b_len, blocks)),
            (Dim(None), Dim("n"), Dim("k")),
            *[whole] * 3,
        ),
        results=((Dim("m"), Dim("n")),),
        sizes={"m": rows, "n": n, "k": blocks},
        granule={"k": 16},
        reduce={"k": "sum"},
        origin=("m",),
        names={"m": "buffer row", "n": "column (n)", "k": "contraction (k)"},
    )


def _tokens_layout(shapes, **_):
    (items, m, _), _, _, (_, n, _), *_ = shapes
    whole = (Dim(None),)
    return Layout(
        operands=(
            (Dim("items"), Dim("m"), Dim(None)),
            (Dim("items"), Dim("m"), Dim(None)),
            whole,
            (Dim("items"), Dim("n"), Dim(None)),
            (Dim("items"), Dim("n"), Dim(None)),
            *[whole] * 3,
        ),
        results=((Dim(None), Dim("m"), Dim("n")),),
        sizes={"items": items, "m": m, "n": n},
        granule={},
        reduce={"items": "sum"},
        origin=("items",),
        names={"items": "16-token item", "m": "row (m)", "n": "column (n)"},
    )


def _unit_amaxes(arrays):
    """The operands with both amaxes 2688 (alpha exactly 1: unscaled sums)."""
    arrays = list(arrays)
    for i in (2, 5):
        arrays[i] = jnp.full(arrays[i].shape, SCALE_RANGE, jnp.float32)
    return arrays


def _rows_split_sum(arrays, *, dtype):
    """Contraction split: unscaled partial sums; alpha per row after."""
    a_codes, _, a_amax, _, _, b_amax, sizes, origin = arrays

    def finish(total):
        positions = origin[0] + jnp.arange(a_codes.shape[1], dtype=jnp.int32)
        alpha = _alpha(a_amax, b_amax)
        row_alpha = alpha.at[_group_of(sizes, positions)].get(mode="fill", fill_value=0)
        return (total * row_alpha[:, None]).astype(dtype)

    return _unit_amaxes(arrays), finish


def _tokens_split_sum(arrays, *, dtype):
    """Items split: unscaled partial sums; alpha per group after."""
    a_amax, b_amax = arrays[2], arrays[5]

    def finish(total):
        return (total * _alpha(a_amax, b_amax)[:, None, None]).astype(dtype)

    return _unit_amaxes(arrays), finish


# --- batching: a loop over the mapped axis ------------------------------------------


def _loop_rule(prim):
    """vmap as a loop (lax.map) of the primitive over the examples: each
    example has its own buffer, groups and amaxes."""

    def rule(args, dims, **params):
        size = batching.batch_size(args, dims)
        mapped = [i for i, d in enumerate(dims) if d is not None]
        moved = [batching.to_front(args[i], dims[i], size) for i in mapped]

        def one(xs):
            full = list(args)
            for i, x in zip(mapped, xs, strict=True):
                full[i] = x
            return prim.bind(*full, **params)

        return lax.map(one, moved), 0

    return rule


def _define(form, abstract, twin, layout, split_sum):
    def batch_rule(args, dims, **params):
        return _loop_rule(prim)(args, dims, **params)

    prim = primitive.define(
        f"nvfp4_grouped_matmul_{form}",
        None,
        abstract,
        twin,
        batch_rule,
        layout,
        multiple=False,
        drop=("dtype",),
        lowerings={"cpu": _BODIES[form]["per_group"], "cuda": _cuda(form)},
        origin_arg=7,
        split_sum=split_sum,
    )
    return prim


grouped_matmul_rows_p = _define(
    "rows",
    _rows_abstract,
    reference.grouped_matmul_rows,
    _rows_layout,
    _rows_split_sum,
)
grouped_matmul_tokens_p = _define(
    "tokens",
    _tokens_abstract,
    reference.grouped_matmul_tokens,
    _tokens_layout,
    _tokens_split_sum,
)


# --- the public functions ----------------------------------------------------------


def _checked(form, a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin):
    """The operands, shapes and dtypes checked; sizes int32, origin [1]."""
    count = b_codes.shape[0] if form == "rows" else (np.shape(sizes) or (None,))[0]
    for name, codes, scales in (("a", a_codes, a_scales), ("b", b_codes, b_scales)):
        if codes.ndim != 3 or codes.dtype not in (jnp.uint8, jnp.bfloat16):
            raise TypeError(
                f"{name}_codes must be uint8 codes or bfloat16 values of rank 3, "
                f"got {codes.dtype} {codes.shape}"
            )
        blocks = scales.shape[-1] if scales.ndim == 3 else -1
        per_block = 16 if is_decoded(codes) else 8
        if (
            scales.dtype != jnp.float8_e4m3fn
            or scales.shape[:2] != codes.shape[:2]
            or codes.shape[2] != per_block * blocks
        ):
            raise TypeError(
                f"{name}_scales must be float8_e4m3fn {(*codes.shape[:2], '*')}, "
                f"one per {per_block} entries of {name}_codes; got {scales.dtype} "
                f"{scales.shape}"
            )
    if form == "rows":
        if a_codes.shape[0] != 1 or a_scales.shape[2] != b_scales.shape[2]:
            raise ValueError(
                "the rows form takes a [1, R, L] and b [G, N, L] with one L; got "
                f"a_scales {a_scales.shape} and b_scales {b_scales.shape}"
            )
    else:
        if a_codes.shape[0] != b_codes.shape[0] or a_scales.shape[2] != 1:
            raise ValueError(
                "the tokens form takes a [items, M, 16] and b [items, N, 16] (16 "
                f"tokens per item); got a_scales {a_scales.shape} and b_scales "
                f"{b_scales.shape}"
            )
    for name, v in (("a_amax", a_amax), ("b_amax", b_amax), ("sizes", sizes)):
        if np.shape(v) != (count,):
            raise ValueError(
                f"{name} must have one value per group, shape ({count},); got "
                f"{np.shape(v)}"
            )
    if not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise TypeError(f"sizes must be integers (int32), got {sizes.dtype}")
    origin = jnp.zeros(1, jnp.int32) if origin is None else origin
    if np.shape(origin) != (1,):
        raise ValueError(f"origin must be int32 [1], got shape {np.shape(origin)}")
    sizes, origin = jnp.asarray(sizes, jnp.int32), jnp.asarray(origin, jnp.int32)
    return a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin


def grouped_matmul_rows(
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin=None, *, dtype
):
    """The rows form (module docstring): a [1, R, L] by b [G, N, L] -> [R,
    N] of ``dtype``; amaxes and ``sizes`` [G] (the groups' rows, in order)."""
    operands = _checked(
        "rows", a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin
    )
    return grouped_matmul_rows_p.bind(*operands, dtype=np.dtype(dtype))


def grouped_matmul_tokens(
    a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin=None, *, dtype
):
    """The tokens form (module docstring): a [items, M, 16] and b [items, N,
    16] -> [G, M, N] of ``dtype``; amaxes and ``sizes`` [G] (the groups'
    tokens, multiples of 16, in order)."""
    operands = _checked(
        "tokens", a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, sizes, origin
    )
    return grouped_matmul_tokens_p.bind(*operands, dtype=np.dtype(dtype))
