"""ragged_dot under sharding on 4 virtual CPU devices, against one device;
run in a subprocess by tests/test_ragged_dot_sharding.py (XLA_FLAGS is read
when JAX starts). Prints one JSON object: {check: true/false}."""

import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_nvfp4 as nv  # noqa: E402

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


def main():
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((DEVICES,), ("d",), axis_types=auto)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (T, K), jnp.float32)
    w = jax.random.normal(keys[1], (G, K, N), jnp.float32)
    dy = jax.random.normal(keys[2], (T, N), jnp.float32)
    sizes = jnp.array([40, 24, 0, 32, 50, 30, 48, 32], jnp.int32)
    out = {}

    # Data parallel: tokens sharded under jit, the weights replicated.
    one = jax.jit(step)(x, w, dy, sizes, KEY)
    rows = NamedSharding(mesh, P("d", None))
    sharded = jax.jit(step)(
        jax.device_put(x, rows), w, jax.device_put(dy, rows), sizes, KEY
    )
    out["data_parallel"] = equal(one, sharded)

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
    out["explicit_axes"] = (
        equal(one, typed)
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
