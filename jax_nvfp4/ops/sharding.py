"""How the primitives partition under ``jit`` with shardings (Shardy).

Each primitive lowers through ``custom_partitioning``: XLA keeps its operands
sharded instead of gathering them for the custom call, and every shard runs
the handler on its own block. A ``Layout`` names each operand and result
dimension by a factor (``b``, ``m``, ``k``, ...), as in an einsum:

* a factor sharded on any operand is sharded the same way on every operand
  and result that has it (the partitioner reshards operands that differ);
* NVFP4 dimensions hold blocks of 16 (codes 8 bytes, one scale), so a factor
  is sharded in whole blocks; a sharding that would split a 16-element block
  or a 16x16 tile raises a ValueError naming the dimension and shard size;
* a factor missing from a result is reduced across its shards (the GEMM's
  contraction: partial sums in float32, then ``psum``; amax: ``pmax``);
* each shard learns where it sits in the whole tensor (``origin``), so
  stochastic-rounding bits follow the global element index and the quantized
  bytes equal the single-device ones under any sharding.

Inside a ``shard_map`` over all mesh axes, or on one device, the primitives
run unpartitioned (``custom_partitioning`` inlines them).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "BATCH",
    "Dim",
    "Layout",
    "NO_MESH",
    "explicit_mesh",
    "mesh_axes",
    "needs_devices_during_lowering",
    "on_auto_axes",
    "partitioned",
    "per_item",
    "shard_count",
    "shard_index",
]

# The factor of the handlers' leading batch axis.
BATCH = "batch"


def explicit_mesh(arrays):
    """The mesh of the first operand typed with Explicit mesh axes (the axes
    of ``jax.make_mesh``'s default), or None."""
    for a in jax.tree.leaves(arrays):
        sharding = getattr(jax.typeof(a), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and getattr(mesh, "explicit_axes", ()):
            return mesh
    return None


def on_auto_axes(fn: Callable, arrays, out_spec: Callable[[], P]):
    """``fn(*arrays)``, run as on a mesh of Auto axes when an operand is typed
    with Explicit axes: inside, XLA's partitioner places every intermediate
    (as it does for all code on Auto meshes), and the result is typed
    ``out_spec()``. Explicit typing would otherwise require an out_sharding
    for every scatter and gather of a body written for Auto meshes.
    Elsewhere (no mesh, Auto axes, inside shard_map) it is ``fn(*arrays)``."""
    mesh = explicit_mesh(arrays)
    if mesh is None:
        return fn(*arrays)
    spec = out_spec()
    run = functools.partial(jax.sharding.auto_axes, out_sharding=spec)
    if jax.sharding.get_abstract_mesh().empty:
        # Explicitly sharded operands without jax.set_mesh: their own mesh.
        with jax.sharding.use_abstract_mesh(mesh):
            return run(fn)(*arrays)
    return run(fn)(*arrays)


def needs_devices_during_lowering(prim) -> None:
    """custom_partitioning needs the device assignment when it is lowered;
    JAX provides it only for jaxprs whose primitives ask for it, and ours
    reach custom_partitioning inside their lowering rule."""
    try:
        from jax._src import dispatch
    except ImportError:  # pragma: no cover -- a future JAX layout
        return
    registry = getattr(dispatch, "prim_requires_devices_during_lowering", None)
    if registry is not None:
        registry.add(prim)


@dataclasses.dataclass(frozen=True)
class Dim:
    """One array dimension: ``factor`` (None: never sharded), and ``per_unit``
    array entries per unit of the factor (e.g. 8 code bytes per 16-element
    block when the factor counts blocks)."""

    factor: str | None
    per_unit: int = 1


@dataclasses.dataclass(frozen=True)
class Layout:
    """Factor names of every operand and result dimension, what one unit of
    each factor means in elements (``granule``: a shard must hold a multiple
    of it), which factors are reduced and how, and which factors place a
    shard in the whole tensor (``origin``: factor per origin entry)."""

    operands: tuple[tuple[Dim, ...], ...]
    results: tuple[tuple[Dim, ...], ...]
    sizes: dict[str, int]  # units per factor
    granule: dict[str, int]  # elements per unit (16: blocks; 1: elements)
    reduce: dict[str, str] = dataclasses.field(default_factory=dict)  # "sum"|"max"
    origin: tuple[str | None, ...] = ()
    names: dict[str, str] = dataclasses.field(default_factory=dict)  # for errors

    def sharding_rule(self) -> tuple[str, dict]:
        """The Shardy rule: einsum-like, compound factors for per_unit > 1."""
        sizes: dict[str, int] = {}
        used: set[str] = set()
        alone: set[str] = set()

        def dim_text(dim: Dim, fresh: list[int]) -> str:
            if dim.factor is None:
                fresh[0] += 1
                return f"z{fresh[0]}"
            if dim.per_unit > 1 and self.sizes.get(dim.factor) == 1:
                # One unit (a single block) cannot be split, and Shardy
                # refuses a compound factor of size 1: never sharded.
                fresh[0] += 1
                return f"z{fresh[0]}"
            used.add(dim.factor)
            if dim.per_unit == 1:
                alone.add(dim.factor)
                return dim.factor
            inner = f"{dim.factor}_{dim.per_unit}"
            sizes[inner] = dim.per_unit
            return f"({dim.factor} {inner})"

        fresh = [0]
        ops = ", ".join(
            " ".join(dim_text(d, fresh) for d in op) or "" for op in self.operands
        )
        res = ", ".join(" ".join(dim_text(d, fresh) for d in r) for r in self.results)
        extra = {f: self.sizes[f] for f in used - alone}
        reduced = tuple(f for f in self.reduce if f in used)
        if reduced:
            extra["reduction_factors"] = reduced
        return f"{ops} -> {res}", {**sizes, **extra}


def per_item(n: int, batch: int) -> Dim:
    """A per-batch-item operand ([n] or [n, 2]) follows the batch if n > 1."""
    return Dim(BATCH if n == batch and n > 1 else None)


def mesh_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def _factor_axes(layout: Layout, mesh, arg_shardings) -> dict[str, tuple[str, ...]]:
    """Mesh axes of each factor: from the first operand that shards it; an
    axis already taken by an earlier factor is not used twice."""
    taken: set[str] = set()
    axes: dict[str, tuple[str, ...]] = {}
    for dims, sharding in zip(layout.operands, arg_shardings, strict=True):
        spec = tuple(getattr(sharding, "spec", ()) or ())
        for i, dim in enumerate(dims):
            if dim.factor is None or dim.factor in axes:
                continue
            entry = mesh_axes(spec[i]) if i < len(spec) else ()
            if entry and not taken.isdisjoint(entry):
                entry = ()
            if entry:
                axes[dim.factor] = entry
                taken.update(entry)
    for factor in layout.sizes:
        axes.setdefault(factor, ())
    return axes


def shard_count(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _check_blocks(layout: Layout, mesh, axes):
    for factor, units in layout.sizes.items():
        count = shard_count(mesh, axes[factor])
        if count == 1:
            continue
        granule = layout.granule.get(factor, 1)
        name = layout.names.get(factor, factor)
        if units % count:
            elements = units * granule
            raise ValueError(
                f"jax_nvfp4: the {name} axis ({elements} elements) is sharded "
                f"{count} ways over mesh axes {axes[factor]}, giving shards of "
                f"{elements / count:g} elements that split a "
                f"{granule}-element NVFP4 block; shard it so that each shard "
                f"holds a multiple of {granule} (or leave it unsharded)"
            )


def _spec(dims, axes) -> P:
    return P(*[(axes[d.factor] or None) if d.factor else None for d in dims])


def shard_index(mesh, axes):
    """This shard's index along a factor sharded over ``axes`` (major first)."""
    index = jnp.int32(0)
    for a in axes:
        index = index * mesh.shape[a] + jax.lax.axis_index(a).astype(jnp.int32)
    return index


# The context a shard's work is traced in (see ``partitioned``).
NO_MESH = jax.sharding.AbstractMesh((), ())


def partitioned(
    local_fn: Callable,
    layout_fn: Callable[..., Layout],
    *,
    origin_arg: int | None = None,
    split_sum: Callable | None = None,
):
    """Wraps ``local_fn(*arrays, **static)`` (one shard's work) so that it
    partitions by the ``Layout`` that ``layout_fn(shapes, **static)`` gives.

    ``origin_arg``: index of the origin operand (int32, one entry per factor
    of ``layout.origin``), which each shard advances by its offsets.
    ``split_sum(arrays, **static) -> (arrays, finish)``: where a "sum" factor
    is split across shards, each shard computes float32 partial sums of the
    returned operands, and ``finish(total)`` gives the result from their
    ``psum`` (a GEMM's alpha applied once, after the sum). Without it, the
    shard's own result in float32 is summed and cast.
    """

    def call(static, *arrays):
        return local_fn(*arrays, **dict(static))

    fn = custom_partitioning(call, static_argnums=(0,))

    def shapes_of(arg_shapes):
        return [tuple(a.shape) for a in arg_shapes]

    def partition(static, mesh, arg_shapes, result_shape):
        params = dict(static)
        layout = layout_fn(shapes_of(arg_shapes), **params)
        axes = _factor_axes(layout, mesh, [a.sharding for a in arg_shapes])
        _check_blocks(layout, mesh, axes)
        arg_shardings = tuple(
            NamedSharding(mesh, _spec(d, axes)) for d in layout.operands
        )
        reduced = {f: op for f, op in layout.reduce.items() if axes.get(f)}
        result_axes = {f: (a if f not in reduced else ()) for f, a in axes.items()}
        results = tuple(
            NamedSharding(mesh, _spec(d, result_axes)) for d in layout.results
        )
        multiple = isinstance(result_shape, list | tuple)

        def lower(*arrays):
            # XLA calls back into this while it compiles, which can be inside
            # the caller's jax.set_mesh: the shard's work has local shapes and
            # no mesh (traced with one, its ops would carry sharding
            # annotations that nothing is left to partition).
            with jax.sharding.use_abstract_mesh(NO_MESH):
                return lower_shard(*arrays)

        def lower_shard(*arrays):
            arrays = list(arrays)
            if origin_arg is not None:
                offsets = []
                for factor in layout.origin:
                    if factor is None or not axes[factor]:
                        offsets.append(jnp.int32(0))
                        continue
                    count = shard_count(mesh, axes[factor])
                    local_units = layout.sizes[factor] // count
                    offsets.append(
                        shard_index(mesh, axes[factor])
                        * (local_units * layout.granule.get(factor, 1))
                    )
                arrays[origin_arg] = arrays[origin_arg] + jnp.stack(offsets)
            local_params = dict(params)
            sum_axes = tuple(
                a for f, op in reduced.items() if op == "sum" for a in axes[f]
            )
            max_axes = tuple(
                a for f, op in reduced.items() if op == "max" for a in axes[f]
            )
            finish = None
            if sum_axes and split_sum is not None:
                arrays, finish = split_sum(arrays, **params)
            if sum_axes and "dtype" in local_params:
                local_params["dtype"] = jnp.dtype(jnp.float32)
            out = local_fn(*arrays, **local_params)
            if sum_axes:
                out = jax.lax.psum(out, sum_axes)
                out = finish(out) if finish else out.astype(params["dtype"])
            if max_axes:
                out = jax.lax.pmax(out, max_axes)
            return out

        return mesh, lower, (results if multiple else results[0]), arg_shardings

    def rule(static, mesh, operand_types, result_types):
        del mesh, result_types
        shapes = [tuple(t.shape) for t in operand_types]
        return layout_fn(shapes, **dict(static)).sharding_rule()

    fn.def_partition(partition=partition, sharding_rule=rule)

    @functools.wraps(local_fn)
    def wrapper(*arrays, **params):
        static = tuple(sorted(params.items()))
        return fn(static, *arrays)

    return wrapper
