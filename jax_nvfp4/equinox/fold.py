"""Folding enclosing ``vmap``s into the token axis of an NVFP4 product.

Per-example layers (Equinox's) run under ``jax.vmap``; run literally, each
example would be quantized and multiplied on its own (its tokens padded to a
block of 16, its own amax, a per-example weight gradient summed afterwards).
``folded_dot`` instead binds a primitive whose batching rule reshapes x
[batch, ..., K] to [batch * ..., K] and calls the product again, so nested
maps fold into one ``dot`` over all tokens, exactly the computation of
``dot`` on the folded tokens, forward and backward.

The primitive is bound only where a ``vmap`` will batch it before anything
differentiates it: the innermost trace is a ``BatchTrace``, or a chain of
bodies being traced into jaxprs (scan, checkpoint, jit, cond) whose first
enclosing trace is one (read from ``DynamicJaxprTrace.parent_trace``; where
JAX's internals are missing nothing folds). Differentiated before a vmap
batched it, or run unbatched, it is the plain ``dot``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_nvfp4.dot import product_general
from jax_nvfp4.ops import sharding
from jax_nvfp4.ops.primitive import with_varying
from jax_nvfp4.ragged_dot import ragged_product
from jax_nvfp4.recipe import Recipe
from jax_nvfp4.recipe.steps import explicit_sharding

__all__ = ["folded_dot", "folded_ragged_dot", "trace_classes"]


def trace_classes():
    """(the current trace, DynamicJaxprTrace, BatchTrace), or None where these
    JAX internals are missing (then nothing folds)."""
    try:
        from jax._src import core
        from jax._src.interpreters import batching as _batching
        from jax._src.interpreters import partial_eval as pe

        return core.trace_ctx.trace, pe.DynamicJaxprTrace, _batching.BatchTrace
    except (ImportError, AttributeError):  # pragma: no cover - other JAX versions
        return None


def _vmap_encloses() -> bool:
    """True when the innermost transformation is a ``jax.vmap``, or bodies
    being traced into jaxprs (scan, checkpoint, jit, cond) whose first
    enclosing transformation is a ``jax.vmap``.

    Only then is the fold primitive bound: that ``vmap`` batches it -- at
    once, or by batching the jaxpr that holds it (the batching rules of scan,
    remat, pjit and cond batch their bodies) -- before anything
    differentiates it.
    """
    found = trace_classes()
    if found is None:  # pragma: no cover - other JAX versions
        return False
    trace, staging, batch = found
    for _ in range(1000):  # a parent chain, not a cycle; bounded all the same
        if not isinstance(trace, staging):
            break
        trace = getattr(trace, "parent_trace", None)
    return isinstance(trace, batch)


def _plain_dot(recipe: Recipe, x: jax.Array, w: jax.Array, kd: jax.Array):
    """x [..., K] . w [N, K]^T: the weight read as stored (no transpose)."""
    return product_general(
        x,
        w,
        (((x.ndim - 1,), (1,)), ((), ())),
        recipe=recipe,
        words=kd.reshape(1, 2),
    )


def folded_dot(recipe: Recipe, x: jax.Array, w: jax.Array, kd: jax.Array):
    """``dot(x, w)`` with every enclosing ``vmap`` folded into x's token axis.

    x [..., K], w [N, K] (same dtype), kd uint32[2] key words.
    """
    if _folds(_fold_p, x, w):
        return _fold_p.bind(x, w, kd, recipe=recipe)
    return _plain_dot(recipe, x, w, kd)


def _fold_abstract(x, w, kd, *, recipe):
    out = jax.core.ShapedArray((*x.shape[:-1], w.shape[0]), x.dtype)
    return with_varying(out, (x, w, kd))


def _fold_rule(args, dims, *, recipe):
    """The vmap of the fold primitive: x's mapped axis joins its tokens."""
    x, w, kd = args
    x_dim, w_dim, kd_dim = dims
    if w_dim is not None:
        # A weight per example (an ensemble): nothing to fold; batch the
        # GEMMs per example as JAX does for dot.
        plain = functools.partial(_plain_dot, recipe)
        return jax.vmap(plain, in_axes=(x_dim, w_dim, kd_dim))(x, w, kd), 0
    if kd_dim is not None:
        kd = jnp.take(kd, 0, axis=kd_dim)  # one dot over the batch: one key
    if x_dim is None:
        return folded_dot(recipe, x, w, kd), None
    # x [size, ..., K] -> [size * ..., K]; _folded_dot folds the next
    # enclosing vmap the same way, if there is one.
    x = jnp.moveaxis(x, x_dim, 0)
    y = folded_dot(recipe, x.reshape(-1, x.shape[-1]), w, kd)
    return y.reshape(*x.shape[:-1], y.shape[-1]), 0


def _define_fold(name: str, plain, abstract, rule) -> Primitive | None:
    """A fold primitive over ``plain(recipe, x, w, *rest)``: bound where a
    vmap will batch it (``rule`` folds the mapped axis), evaluated, lowered or
    differentiated unbatched it is ``plain`` itself."""

    def impl(x, w, *rest, recipe):
        return plain(recipe, x, w, *rest)

    def jvp(primals, tangents, *, recipe):
        # Differentiated before a vmap batched it: the plain product's
        # derivative. Through jax.linearize, not jax.jvp: the recipe's
        # derivative is a VJP, which reverse mode reaches by transposing
        # the linearization.
        x, w, *rest = primals
        dx, dw = (ad.instantiate_zeros(t) for t in tangents[:2])
        y, linear = jax.linearize(lambda x, w: plain(recipe, x, w, *rest), x, w)
        return y, linear(dx, dw)

    try:
        prim = Primitive(name)
        prim.def_impl(impl)
        prim.def_abstract_eval(abstract)
        batching.primitive_batchers[prim] = rule
        ad.primitive_jvps[prim] = jvp
        mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=False))
        # Lowered unbatched it is the plain product, whose primitives lower
        # through custom_partitioning: that needs the devices.
        sharding.needs_devices_during_lowering(prim)
    except (AttributeError, TypeError):  # pragma: no cover - other JAX versions
        return None
    return prim


def _folds(prim, x, w) -> bool:
    """Whether to bind a fold primitive here (see the module docstring)."""
    return (
        prim is not None
        and _vmap_encloses()
        and explicit_sharding(x) is None
        and explicit_sharding(w) is None
    )


_fold_p = _define_fold("nvfp4_equinox_fold", _plain_dot, _fold_abstract, _fold_rule)


# ------------------------------------------------------ expert projections


def _plain_ragged_dot(recipe: Recipe | None, x, w, group_sizes, kd):
    """x [T, K] rows sorted by group . w [G, K, N]: ``lax.ragged_dot`` (bf16,
    ``recipe`` None) or ``jax_nvfp4.ragged_dot``."""
    if recipe is None:
        return jax.lax.ragged_dot(x, w, group_sizes)
    return ragged_product(x, w, group_sizes, words=kd.reshape(1, 2), recipe=recipe)


def folded_ragged_dot(recipe: Recipe | None, x, w, group_sizes, kd):
    """``ragged_dot(x, w, group_sizes)`` with every enclosing ``vmap`` folded:
    the mapped examples' rows are merged, sorted by group across the batch,
    into one ragged product (one GEMM per group over the whole batch, one
    amax per group), and sorted back. (``lax.ragged_dot`` has no batching
    rule for per-example group sizes: unfolded, a vmap of it fails.)

    x [T, K], w [G, K, N] (same dtype), group_sizes int [G], kd uint32[2].
    """
    if _folds(_ragged_fold_p, x, w):
        return _ragged_fold_p.bind(x, w, group_sizes, kd, recipe=recipe)
    return _plain_ragged_dot(recipe, x, w, group_sizes, kd)


def _ragged_fold_abstract(x, w, group_sizes, kd, *, recipe):
    out = jax.core.ShapedArray((x.shape[0], w.shape[-1]), x.dtype)
    return with_varying(out, (x, w, group_sizes, kd))


def _ragged_fold_rule(args, dims, *, recipe):
    """The vmap of the ragged fold: each example's rows get their group's
    place among all examples' rows (group-major, then example), one ragged
    product runs over them, and the result goes back to each example."""
    x, w, sizes, kd = args
    x_dim, w_dim, s_dim, kd_dim = dims
    if kd_dim is not None:
        kd = jnp.take(kd, 0, axis=kd_dim)  # one product over the batch: one key
    if w_dim is not None:
        # A weight per example (an ensemble): one product per example, in turn.
        size = x.shape[x_dim] if x_dim is not None else w.shape[w_dim]
        x, w, sizes = (
            jnp.broadcast_to(a, (size, *a.shape))
            if d is None
            else jnp.moveaxis(a, d, 0)
            for a, d in ((x, x_dim), (w, w_dim), (sizes, s_dim))
        )
        plain = functools.partial(_plain_ragged_dot, recipe, kd=kd)
        return jax.lax.map(lambda a: plain(*a), (x, w, sizes)), 0
    size = x.shape[x_dim] if x_dim is not None else sizes.shape[s_dim]
    x = (
        jnp.broadcast_to(x, (size, *x.shape))
        if x_dim is None
        else jnp.moveaxis(x, x_dim, 0)
    )
    sizes = (
        jnp.broadcast_to(sizes, (size, *sizes.shape))
        if s_dim is None
        else jnp.moveaxis(sizes, s_dim, 0)
    )
    batch, rows, k = x.shape
    # Each row's group (groups: past its example's sizes), then its place.
    ends = jnp.cumsum(sizes, axis=-1)
    group = jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(rows), side="right"))(
        ends
    )
    rank = group * batch + jnp.arange(batch, dtype=group.dtype)[:, None]
    order = jnp.argsort(rank.reshape(-1), stable=True)
    merged = x.reshape(batch * rows, k)[order]
    total = jnp.sum(sizes, axis=0).astype(sizes.dtype)
    y = folded_ragged_dot(recipe, merged, w, total, kd)
    back = jnp.zeros_like(y).at[order].set(y)
    return back.reshape(batch, rows, y.shape[-1]), 0


_ragged_fold_p = _define_fold(
    "nvfp4_equinox_ragged_fold",
    _plain_ragged_dot,
    _ragged_fold_abstract,
    _ragged_fold_rule,
)
