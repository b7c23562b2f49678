"""ragged_dot and its grouped GEMM primitives under sharding on 4 virtual
CPU devices, against one device; run in a subprocess by
tests/ops/test_grouped_matmul_sharding.py (XLA_FLAGS is read when JAX starts).
Prints one JSON object: {check: true/false}."""

import functools
import json
import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# The tests' shared operands (the tests folder is on PYTHONPATH:
# conftest.run_on_virtual_cpus).
from grouped_cases import ROWS, TOKENS, rows_operands, tokens_operands  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_nvfp4 as nv  # noqa: E402
from jax_nvfp4 import ops  # noqa: E402

try:
    shard_map = jax.shard_map
except AttributeError:  # older JAX
    from jax.experimental.shard_map import shard_map

G, K, N, T, DEVICES = 8, 32, 48, 256, 4
KEY = jax.random.key(3)


def step(x, w, dy, sizes, key):
    y, vjp = jax.vjp(lambda a, b: nv.ragged_dot(a, b, sizes, key=key), x, w)
    return (y, *vjp(dy))


def equal(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(u), np.asarray(v), equal_nan=True)
        for u, v in zip(a, b, strict=True)
    )


def gathers(compiled_text):
    """The all-gathers of a compiled module."""
    return [
        line
        for line in compiled_text.splitlines()
        if re.search(r"= .*all-gather(-start)?\(", line)
    ]


# Which operands carry each factor, and the dimension (the rows form:
# a codes, a scales, a amax, b codes, b scales, b amax, sizes; the tokens
# form likewise).
FACTORS = {
    "rows": {"m": {0: 1, 1: 1}, "n": {3: 1, 4: 1}, "k": {0: 2, 1: 2, 3: 2, 4: 2}},
    "tokens": {"items": {0: 0, 1: 0, 3: 0, 4: 0}, "m": {0: 1, 1: 1}, "n": {3: 1, 4: 1}},
}


def primitive_checks(mesh):
    """Each form partitioned along each of its factors equals one device bit
    for bit (operands whose sums are exact where the contraction is split:
    the partial sums' psum then adds exactly), with no all-gather."""
    out = {}
    for form, factors in FACTORS.items():
        if form == "rows":
            fn = ops.grouped_matmul_rows
            # 96 rows (groups crossing the shards' boundaries), K 64: 4 blocks.
            operands = functools.partial(
                rows_operands, ROWS["unaligned"], extra=26, length=64
            )
        else:
            fn = ops.grouped_matmul_tokens
            operands = functools.partial(tokens_operands, TOKENS["unbalanced"])
        for factor, dims in factors.items():
            split = factor in ("k", "items")
            args = operands(seed=len(factor), exact=split)
            placed = []
            for i, a in enumerate(args):
                spec = [None] * a.ndim
                if i in dims:
                    spec[dims[i]] = "d"
                placed.append(jax.device_put(a, NamedSharding(mesh, P(*spec))))
            run = jax.jit(functools.partial(fn, dtype=jnp.float32))
            one = jax.jit(functools.partial(fn, dtype=jnp.float32))(*args)
            got = run(*placed)
            text = run.lower(*placed).compile().as_text()
            out[f"{form}_{factor}"] = equal([one], [got]) and not gathers(text)
    return out


# (tokens, group sizes): halos within the next shard, halos spanning several
# shards (16 rows per shard), one group, a skewed split, and 96 tokens, which
# split into 2 pieces only: the rows are then gathered, with the same bytes.
BUFFER_CASES = [
    (256, [40, 24, 0, 32, 50, 30, 48, 32]),
    (64, [1, 2, 3, 4, 5, 6, 7, 8]),
    (64, [64]),
    (1024, [1] * 7 + [900]),
    (96, [10, 20, 30, 1]),
]


def token_buffer_checks(mesh):
    """The token buffer, tokens sharded, equals one device both ways; where
    the tokens split into whole pieces of the buffer, the buffer is sharded
    as the tokens and only collective permutes move rows."""
    from jax_nvfp4.ops import token_buffer

    ok = True
    for tokens, sizes in BUFFER_CASES:
        sizes = jnp.asarray(sizes, jnp.int32)
        x = jax.random.normal(jax.random.key(tokens), (tokens, 24), jnp.bfloat16)
        into = jax.jit(token_buffer.to_buffer)
        out = jax.jit(lambda b, s, t=tokens: token_buffer.from_buffer(b, s, tokens=t))
        one = into(x, sizes)
        placed = jax.device_put(x, NamedSharding(mesh, P("d", None)))
        buffer = into(placed, sizes)
        ok = ok and equal([one, out(one, sizes)], [buffer, out(buffer, sizes)])
        if token_buffer.pieces(tokens) % DEVICES == 0:
            text = into.lower(placed, sizes).compile().as_text()
            text += out.lower(buffer, sizes).compile().as_text()
            ok = ok and buffer.sharding.spec == P("d") and not gathers(text)
    return ok


def main():
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((DEVICES,), ("d",), axis_types=auto)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (T, K), jnp.float32)
    w = jax.random.normal(keys[1], (G, K, N), jnp.float32)
    dy = jax.random.normal(keys[2], (T, N), jnp.float32)
    sizes = jnp.array([40, 24, 0, 32, 50, 30, 48, 32], jnp.int32)
    out = primitive_checks(mesh)
    out["token_buffer"] = token_buffer_checks(mesh)

    # Data parallel: tokens sharded under jit, the weights replicated.
    one = jax.jit(step)(x, w, dy, sizes, KEY)
    # The token buffer moves halos between neighbouring shards: no
    # all-gather of x, dY or the results.
    rows = NamedSharding(mesh, P("d", None))
    placed = (jax.device_put(x, rows), w, jax.device_put(dy, rows), sizes, KEY)
    sharded = jax.jit(step)(*placed)
    text = jax.jit(step).lower(*placed).compile().as_text()
    out["data_parallel"] = equal(one, sharded) and not gathers(text)

    # A 2 x 2 mesh: the tokens over one axis or both, with the experts' K
    # (and x's features) over the other; still no all-gather.
    grid = jax.make_mesh((2, 2), ("d", "m"), axis_types=auto * 2)
    ok = True
    for xs, ws, dys in [
        (P(("d", "m"), None), P(), P(("d", "m"), None)),
        (P("d", None), P(None, "m", None), P("d", None)),
        (P("d", "m"), P(None, "m", None), P("d", None)),
    ]:
        placed = tuple(
            jax.device_put(a, NamedSharding(grid, spec))
            for a, spec in ((x, xs), (w, ws), (dy, dys))
        ) + (sizes, KEY)
        text = jax.jit(step).lower(*placed).compile().as_text()
        ok = ok and equal(one, jax.jit(step)(*placed)) and not gathers(text)
    out["two_axis_mesh"] = ok

    # The same on Explicit axes (jax.make_mesh's default), inside
    # jax.set_mesh and with only the operands' types naming the mesh; the
    # results keep the rows' sharding as lax.ragged_dot's do.
    explicit = jax.make_mesh(
        (DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    rows = NamedSharding(explicit, P("d", None))
    xe, dye = jax.device_put(x, rows), jax.device_put(dy, rows)
    typed = jax.jit(step)(xe, w, dye, sizes, KEY)
    with jax.set_mesh(explicit):
        in_context = jax.jit(step)(xe, w, dye, sizes, KEY)
    text = jax.jit(step).lower(xe, w, dye, sizes, KEY).compile().as_text()
    out["explicit_axes"] = (
        not gathers(text)
        and equal(one, typed)
        and equal(one, in_context)
        and typed[0].sharding.spec == P("d", None)
        and typed[1].sharding.spec == P("d", None)
    )

    # Expert parallel: 2 experts per device in shard_map, each device the
    # rows of its experts in a buffer padded to a common capacity (what an
    # all_to_all by expert delivers), its own key.
    starts = np.concatenate([[0], np.cumsum(np.asarray(sizes))])
    per = G // DEVICES
    spans = [(starts[i * per], starts[(i + 1) * per]) for i in range(DEVICES)]
    cap = max(b - a for a, b in spans)
    xs = np.zeros((DEVICES, cap, K), np.float32)
    dys = np.zeros((DEVICES, cap, N), np.float32)
    for i, (a, b) in enumerate(spans):
        xs[i, : b - a], dys[i, : b - a] = np.asarray(x[a:b]), np.asarray(dy[a:b])
    local_sizes = np.asarray(sizes).reshape(DEVICES, per)

    def expert_parallel(xl, wl, dyl, sl):
        key = jax.random.fold_in(KEY, jax.lax.axis_index("d"))
        y, dx, dw = step(xl[0], wl, dyl[0], sl[0], key)
        return y[None], dx[None], dw

    spec = P("d")
    run = jax.jit(
        shard_map(
            expert_parallel,
            mesh=mesh,
            in_specs=(spec, spec, spec, spec),
            out_specs=(spec, spec, spec),
        )
    )
    y, dx, dw = run(jnp.asarray(xs), w, jnp.asarray(dys), jnp.asarray(local_sizes))
    ok = True
    for i in range(DEVICES):
        key = jax.random.fold_in(KEY, i)
        want = jax.jit(step)(
            jnp.asarray(xs[i]),
            w[i * per : (i + 1) * per],
            jnp.asarray(dys[i]),
            jnp.asarray(local_sizes[i]),
            key,
        )
        got = (y[i], dx[i], dw[i * per : (i + 1) * per])
        ok = ok and equal(got, want)
    out["expert_parallel"] = ok
    print(json.dumps(out))


if __name__ == "__main__":
    main()
