"""The group-aligned token buffer of the grouped products (``ragged_dot``).

x [T, F] holds rows sorted by group, ``sizes`` [G] rows each. In the buffer
every group starts at a multiple of 16 rows, with zeros between the groups
and after the last one. So each group's 16-token blocks (the blocks of its
column-wise quantization and its RHT chunks) start at the group's first row.

* ``to_buffer(a, sizes)`` -> [``buffer_rows(T, G)``, F];
* ``from_buffer(buffer, sizes, tokens=T)`` -> [T, F], the inverse; rows past
  the groups get zeros.

Row i of group g moves down by the padding of the groups before g: between 0
and 15 (G - 1) rows.

Sharding. Under ``jit`` with the token axis sharded, the buffer is sharded
the same way. Each shard exchanges only a halo of rows with the shards next
to it (collective permutes of static size) and never gathers x. This works
because ``buffer_rows`` pads the buffer so that T and the buffer split into
the same number of pieces (``pieces``), so shard s of x maps onto shard s of
the buffer plus a bounded halo:

* going into the buffer, shard s reads up to 15 (G - 1) - P/n rows from the
  shards before it and (n - 1) P/n from the shards after it;
* coming back out, the reverse.

Here n is the number of shards and P the buffer's extra rows (at most
15 G + 16 (pieces - 1)). On one device, and inside ``shard_map``, these are
plain gathers both ways: each buffer row finds the x row it holds (on
GPUs XLA's gathers of rows are far faster than its scatters).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_nvfp4.format import BLOCK_SIZE
from jax_nvfp4.ops import primitive, sharding

__all__ = ["buffer_rows", "from_buffer", "pieces", "to_buffer"]


def pieces(tokens: int) -> int:
    """How many equal pieces of whole 16-row blocks both T and the buffer are
    cut into: the largest power of two that divides T / 16, capped at the
    device count rounded up to a power of two. It is 1 when T is not a
    multiple of 16. A token axis sharded over a divisor of it keeps its
    shards in the buffer."""
    if tokens <= 0 or tokens % BLOCK_SIZE:
        return 1
    limit = 1 << max(0, (jax.device_count() - 1).bit_length())
    blocks, count = tokens // BLOCK_SIZE, 1
    while count < limit and blocks % (2 * count) == 0:
        count *= 2
    return count


def buffer_rows(tokens: int, groups: int) -> int:
    """The buffer's rows: room for T tokens and up to 15 rows of padding per
    group (the padded sizes, multiples of 16, sum to at most
    (T + 15 G) // 16 blocks), rounded up to whole ``pieces``."""
    blocks = max(1, (tokens + 15 * groups) // BLOCK_SIZE)
    count = pieces(tokens)
    return -(-blocks // count) * count * BLOCK_SIZE


def _destinations(sizes, rows, tokens: int):
    """The buffer row of each x row in ``rows`` (global indices, int32). It
    is -1 for rows outside [0, T) and for rows past the groups."""
    count = sizes.shape[0]
    sizes = sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    padded = (sizes + 15) // 16 * 16
    shift = jnp.cumsum(padded) - padded - (ends - sizes)  # padding before g
    group = jnp.searchsorted(ends, rows, side="right")
    valid = (group < count) & (rows >= 0) & (rows < tokens)
    return jnp.where(valid, rows + shift[jnp.minimum(group, count - 1)], -1)


def _sources(sizes, rows, tokens: int):
    """The x row each buffer row in ``rows`` holds (global indices, int32):
    the inverse of ``_destinations``. It is -1 for the padding between and
    after the groups."""
    count = sizes.shape[0]
    sizes = sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    padded = (sizes + 15) // 16 * 16
    padded_ends = jnp.cumsum(padded)
    group = jnp.searchsorted(padded_ends, rows, side="right")
    g = jnp.minimum(group, count - 1)
    offset = rows - (padded_ends[g] - padded[g])
    source = starts[g] + offset
    valid = (group < count) & (rows >= 0) & (offset < sizes[g]) & (source < tokens)
    return jnp.where(valid, source, -1)


def _window(local, axes, count: int, left: int, right: int):
    """This shard's rows, with up to ``left`` rows from the shards before it
    and ``right`` from the shards after it, fetched by collective permutes
    (zeros where no shard is). Returns the rows and how many came from
    before."""
    n = local.shape[0]
    before, after = [], []
    for hop in range(1, count):
        take = min(n, left - (hop - 1) * n)
        if take <= 0:
            break
        perm = [(i, i + hop) for i in range(count - hop)]
        before.insert(0, lax.ppermute(local[n - take :], axes, perm))
    for hop in range(1, count):
        take = min(n, right - (hop - 1) * n)
        if take <= 0:
            break
        perm = [(i + hop, i) for i in range(count - hop)]
        after.append(lax.ppermute(local[:take], axes, perm))
    fetched = sum(b.shape[0] for b in before)
    return jnp.concatenate([*before, local, *after]), fetched


def _shard_place(mesh, axes, count):
    return sharding.shard_index(mesh, axes) if count > 1 else jnp.int32(0)


def _to_buffer_shard(a, sizes, *, tokens, rows, mesh=None, axes=(), count=1):
    """One shard of ``to_buffer``: x's rows [s n, (s + 1) n) in, the buffer's
    rows [s b, (s + 1) b) out."""
    b = rows // count
    extra = (rows - tokens) // count
    shift_bound = 15 * (sizes.shape[0] - 1)
    window, left = _window(
        a, axes, count, max(0, shift_bound - extra), (count - 1) * extra
    )
    index = _shard_place(mesh, axes, count)
    first = index * a.shape[0] - left
    source = _sources(sizes, index * b + jnp.arange(b, dtype=jnp.int32), tokens)
    local = source - first
    inside = (source >= 0) & (local >= 0) & (local < window.shape[0])
    local = jnp.where(inside, local, window.shape[0])
    return window.at[local].get(mode="fill", fill_value=0)


def _from_buffer_shard(buffer, sizes, *, tokens, rows, mesh=None, axes=(), count=1):
    """One shard of ``from_buffer``: the buffer's rows [s b, (s + 1) b) in,
    x's rows [s n, (s + 1) n) out."""
    b, n = rows // count, tokens // count
    shift_bound = 15 * (sizes.shape[0] - 1)
    extra = b - n
    window, left = _window(
        buffer, axes, count, (count - 1) * extra, max(0, shift_bound - extra)
    )
    index = _shard_place(mesh, axes, count)
    dest = _destinations(sizes, index * n + jnp.arange(n), tokens)
    local = dest - (index * b - left)
    local = jnp.where(
        (dest >= 0) & (local >= 0) & (local < window.shape[0]),
        local,
        window.shape[0],
    )
    return window.at[local].get(mode="fill", fill_value=0)


def _partitioned(shard_fn, rows_in: str, rows_out: str):
    """``shard_fn`` under ``custom_partitioning``: the token axis of the
    operand and of the result share their ``pieces`` (the major factor), so
    a shard of one is a shard of the other; the features pass through; the
    sizes are replicated."""

    def call(static, a, sizes):
        params = dict(static)
        del params["pieces"]
        return shard_fn(a, sizes, **params)

    fn = custom_partitioning(call, static_argnums=(0,))

    def partition(static, mesh, arg_shapes, result_shape):
        params = dict(static)
        spec = (*tuple(arg_shapes[0].sharding.spec or ()), None, None)
        axes = sharding.mesh_axes(spec[0])
        count = sharding.shard_count(mesh, axes)
        if params["pieces"] % count:  # not a shard of the buffer: whole rows
            axes, count = (), 1
        rows_spec = NamedSharding(mesh, P(axes or None, spec[1]))
        shard_params = {k: v for k, v in params.items() if k != "pieces"}

        def lower(a, sizes):
            # A shard's work is traced without the caller's mesh (see
            # sharding.partitioned).
            with jax.sharding.use_abstract_mesh(sharding.NO_MESH):
                return shard_fn(
                    a, sizes, mesh=mesh, axes=axes, count=count, **shard_params
                )

        return mesh, lower, rows_spec, (rows_spec, NamedSharding(mesh, P()))

    def rule(static, mesh, operand_types, result_types):
        params = dict(static)
        count = params["pieces"]
        if count % mesh.size:
            # Some sharding of the mesh would not be whole pieces (and
            # Shardy refuses a compound factor of size 1): the token axes
            # are not linked, and ``partition`` takes whole rows.
            return "r f, g -> q f", {}
        sizes = {
            "c": count,
            "r": params[rows_in] // count,
            "q": params[rows_out] // count,
        }
        return "(c r) f, g -> (c q) f", sizes

    fn.def_partition(partition=partition, sharding_rule=rule)

    def run(a, sizes, **params):
        static = tuple(sorted(params.items()))
        return fn(static, a, sizes)

    return run


def _define(name, shard_fn, rows_in, rows_out, out_rows):
    """A primitive around ``shard_fn``: eager and batched as its one-device
    form (a vmapped plain gather), lowered partitioned."""
    prim = Primitive(name)

    def abstract(a, sizes, **params):
        shape = (params[out_rows], a.shape[1])
        return primitive.with_varying(jax.core.ShapedArray(shape, a.dtype), (a, sizes))

    def whole(a, sizes, **params):
        params.pop("pieces")
        return shard_fn(a, sizes, **params)

    def batch_rule(args, dims, **params):
        out = jax.vmap(functools.partial(whole, **params), in_axes=dims)(*args)
        return out, 0

    prim.def_abstract_eval(abstract)
    prim.def_impl(functools.partial(primitive.eager, prim))
    batching.primitive_batchers[prim] = batch_rule
    partitioned = _partitioned(shard_fn, rows_in, rows_out)
    mlir.register_lowering(prim, mlir.lower_fun(partitioned, multiple_results=False))
    sharding.needs_devices_during_lowering(prim)
    return prim


to_buffer_p = _define("token_buffer_in", _to_buffer_shard, "tokens", "rows", "rows")
from_buffer_p = _define(
    "token_buffer_out", _from_buffer_shard, "rows", "tokens", "tokens"
)


def to_buffer(a, sizes):
    """a [T, F] -> the buffer [``buffer_rows(T, G)``, F]."""
    tokens = a.shape[0]
    return to_buffer_p.bind(
        a,
        jnp.asarray(sizes, jnp.int32),
        tokens=tokens,
        rows=buffer_rows(tokens, sizes.shape[0]),
        pieces=pieces(tokens),
    )


def from_buffer(buffer, sizes, *, tokens: int):
    """The buffer [``buffer_rows(T, G)``, F] -> [T, F]; rows past the groups
    get zeros."""
    return from_buffer_p.bind(
        buffer,
        jnp.asarray(sizes, jnp.int32),
        tokens=tokens,
        rows=buffer.shape[0],
        pieces=pieces(tokens),
    )
