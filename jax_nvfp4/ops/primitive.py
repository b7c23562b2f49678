"""How every primitive of the library is built (``define``).

A primitive family is two primitives: the public one (abstract evaluation,
batching, eager implementation, and a lowering that partitions by its
``Layout`` under sharded ``jit``) and ``<name>_local``, one shard's work,
lowered to the FFI handler where one is registered, to a platform-specific
pure-JAX path (possibly chosen from the lowering context: the dispatcher's
GEMMs), or to the pure-JAX twin in ``jax_nvfp4.reference`` elsewhere.
Parameters that are dataclasses (the quantize options, the placement) reach
the handler as dictionary attributes with the same field names. A family
whose lowerings compose other primitives (the grouped GEMM runs the matmul
primitive once per group) binds their ``local`` primitive, one shard's work,
inside its own shard's lowering.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_nvfp4.backends import library
from jax_nvfp4.ops import sharding

__all__ = [
    "ChosenAtLowering",
    "define",
    "eager",
    "ffi_attributes",
    "local",
    "with_varying",
]


def _varying(aval) -> frozenset:
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", frozenset())
    return frozenset(vma)


def with_varying(out, avals):
    """Gives abstract outputs the manual-axis variance of all inputs together
    (inside shard_map with check_vma; a no-op elsewhere)."""
    varying = frozenset().union(*(_varying(a) for a in avals))
    if not varying:
        return out
    from jax._src import core as jax_core  # the current (manual) mesh

    def one(o):
        mesh_sharding = jax_core.get_cur_mesh_sharding()
        if hasattr(avals[0], "mat"):  # jax 0.10: ManualAxisType
            mat = jax_core.ManualAxisType(varying=varying)
            return o.update(sharding=mesh_sharding, manual_axis_type=mat)
        return o.update(sharding=mesh_sharding, vma=varying)

    return [one(o) for o in out] if isinstance(out, list | tuple) else one(out)


def _no_derivative(name, primals, tangents, **params):
    raise NotImplementedError(
        f"jax_nvfp4's primitive {name} has no derivative: NVFP4 quantization "
        "is piecewise constant. "
        "To train through NVFP4, use jax_nvfp4.dot / dot_general, whose custom "
        "VJP defines the recipe's gradients, instead of differentiating "
        "quantize or dequantize. Higher-order derivatives of jax_nvfp4.dot "
        "(grad of grad) are not supported either — differentiate a bf16 model "
        "(recipe=jax_nvfp4.BF16) for those."
    )


@functools.cache
def _jitted_bind(prim, params):
    return jax.jit(lambda *args: prim.bind(*args, **dict(params)))


def eager(prim, *args, **params):
    """The eager implementation: the primitive compiled on its own. Under
    jax.disable_jit the jit would run this implementation again (forever), so
    jit stays enabled here, as JAX does for its own primitives."""
    with jax.disable_jit(False):
        return _jitted_bind(prim, tuple(sorted(params.items())))(*args)


def ffi_attributes(params: dict, drop=()) -> dict:
    """A primitive's params as FFI attributes: dataclasses become dictionaries
    of their fields; the params in ``drop`` are left out."""
    return {
        name: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
        for name, v in params.items()
        if name not in drop
    }


def _ffi_rule(target, drop, applies, otherwise):
    """The lowering to the FFI handler ``target``; where ``applies(operand
    avals)`` is False, the lowering ``otherwise`` instead."""
    rule = jax.ffi.ffi_lowering(target)

    def lowering(ctx, *args, **params):
        if applies is not None and not applies(ctx.avals_in):
            return otherwise(ctx, *args, **params)
        return rule(ctx, *args, **ffi_attributes(params, drop))

    return lowering


# The lowering platforms the extension can serve.
_HANDLER_PLATFORMS = ("cpu", "cuda")


def _announcing_missing_handlers(platform, rule):
    """``rule``, lowered after ``library.missing_handlers(platform)`` (a
    warning, once, or an error under JAX_NVFP4_IMPLEMENTATION=native)."""

    def lowering(ctx, *args, **params):
        library.missing_handlers(platform)
        return rule(ctx, *args, **params)

    return lowering


@dataclasses.dataclass(frozen=True)
class ChosenAtLowering:
    """A platform lowering whose pure-JAX body depends on what the
    computation is lowered for: ``choose(ctx, **params)`` (the lowering
    rule's context, whose ``avals_in`` give the operand shapes, and the
    primitive's params) returns the body, a function of the operands alone
    with the params it needs bound, e.g. the GEMM the dispatcher picks for
    those devices and shapes."""

    choose: Callable


def _platform_rule(fn, multiple):
    if isinstance(fn, ChosenAtLowering):

        def rule(ctx, *args, **params):
            body = mlir.lower_fun(fn.choose(ctx, **params), multiple_results=multiple)
            return body(ctx, *args)

        return rule
    return mlir.lower_fun(fn, multiple_results=multiple)


_LOCAL: dict[Primitive, Primitive] = {}


def local(prim: Primitive) -> Primitive:
    """The unpartitioned primitive of a family (``<name>_local``): what a
    lowering binds to run another family's work on its own shard."""
    return _LOCAL[prim]


def define(
    name: str,
    target: str | None,
    abstract: Callable,
    reference_fn: Callable,
    batch_rule: Callable,
    layout: Callable[..., sharding.Layout],
    *,
    multiple: bool,
    drop: tuple[str, ...] = (),
    lowerings: dict[str, Callable] | None = None,
    origin_arg: int | None = None,
    handler_applies: Callable | None = None,
    split_sum: Callable | None = None,
) -> Primitive:
    """The public primitive ``name`` (see the module docstring).

    Args:
      target: the FFI target of the handlers; registered platforms lower to
        it. None: no handler of its own (its ``lowerings`` compose others).
      abstract: shapes and dtypes of the results from the operands' avals.
      reference_fn: the pure-JAX twin, the lowering where no handler is.
      batch_rule: the vmap rule of the public primitive.
      layout: ``layout(operand shapes, **params)`` -> how it partitions.
      multiple: whether it has several results.
      drop: params that are not handler attributes (e.g. a result dtype).
      lowerings: {platform: pure-JAX function, or a ``ChosenAtLowering``} for
        platforms without a handler but with a better path than the
        reference.
      origin_arg: index of the int32[3] origin operand (see ``sharding``).
      handler_applies: ``applies(operand avals)``; where False, the reference
        lowers it on handler platforms too.
      split_sum: how a shard computes a partial sum when a "sum" factor is
        split across shards (``sharding.partitioned``).
    """

    def abstract_eval(*avals, **params):
        return with_varying(abstract(*avals, **params), avals)

    local = Primitive(name + "_local")
    local.multiple_results = multiple
    local.def_abstract_eval(abstract_eval)
    reference_lowering = mlir.lower_fun(reference_fn, multiple_results=multiple)
    mlir.register_lowering(local, reference_lowering)
    platform_lowerings = {
        platform: _platform_rule(fn, multiple)
        for platform, fn in (lowerings or {}).items()
    }
    for platform in _HANDLER_PLATFORMS:
        if not library.targets_on(platform):
            platform_lowerings[platform] = _announcing_missing_handlers(
                platform, platform_lowerings.get(platform, reference_lowering)
            )
    for platform, rule in platform_lowerings.items():
        mlir.register_lowering(local, rule, platform=platform)
    for platform, targets in library.registered_targets().items():
        if target is not None and target in targets:
            mlir.register_lowering(
                local,
                _ffi_rule(target, drop, handler_applies, reference_lowering),
                platform=platform,
            )

    def local_fn(*args, **params):
        out = local.bind(*args, **params)
        return tuple(out) if multiple else out

    prim = Primitive(name)
    prim.multiple_results = multiple
    prim.def_abstract_eval(abstract_eval)
    prim.def_impl(functools.partial(eager, prim))
    batching.primitive_batchers[prim] = batch_rule
    ad.primitive_jvps[prim] = functools.partial(_no_derivative, name)
    sharded = sharding.partitioned(
        local_fn, layout, origin_arg=origin_arg, split_sum=split_sum
    )
    mlir.register_lowering(prim, mlir.lower_fun(sharded, multiple_results=multiple))
    sharding.needs_devices_during_lowering(prim)
    _LOCAL[prim] = local
    return prim
