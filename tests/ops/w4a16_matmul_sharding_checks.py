"""The serving matmul (W4A16) and the bf16 decode under sharded jit on 4
virtual CPU devices, against one device; run in a subprocess by
tests/ops/test_w4a16_matmul_sharding.py (XLA_FLAGS is read when JAX starts). Prints one
JSON object: {case: {check: value}}."""

import json
import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_nvfp4 as nv  # noqa: E402
from jax_nvfp4 import ops  # noqa: E402

T, K, N = 64, 256, 96


def collectives(text):
    """{kind: [result types]} of the collectives in compiled HLO text."""
    found = {}
    for line in text.splitlines():
        m = re.search(
            r"= (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|"
            r"collective-permute)(-start)?\(",
            line,
        )
        if m:
            found.setdefault(m.group(2), []).append(m.group(1))
    return found


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def sharded_weight(w, mesh, spec):
    """The weight with its stored [N, K/2] codes and [N, K/16] scales placed
    by ``spec`` (its amax replicated)."""
    codes = jax.device_put(w.codes, NamedSharding(mesh, spec))
    scales = jax.device_put(w.scales, NamedSharding(mesh, spec))
    return jax.tree.unflatten(jax.tree.structure(w), [codes, scales, w.amax])


def check(f, args, want):
    got = f(*args)
    same = [
        bool(np.array_equal(bits(g), bits(v)))
        for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    ]
    out = jax.tree.leaves(got)[0]
    return {
        "bytes_equal": all(same),
        "out_spec": str(out.sharding.spec),
        "collectives": collectives(f.lower(*args).compile().as_text()),
    }


def exact_operands(seed):
    """x of small integers and a weight with random codes and scales 1 or 2:
    every float32 sum is exact, so any summation order (a shard's GEMM
    shape changes XLA's) gives the same bits."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
    scale_bytes = rng.choice([0x38, 0x40], (N, K // 16)).astype(np.uint8)
    w = nv.NVFP4Tensor(
        jnp.asarray(codes),
        jnp.asarray(scale_bytes).view(jnp.float8_e4m3fn),
        jnp.float32(2688.0 * 3),
        shape=(K, N),
        axis=0,
    )
    x = jnp.asarray(rng.integers(-4, 5, (T, K)), jnp.bfloat16)
    return x, w


def within_bound(got, x, w, dtype):
    """|got - x . dequantize(w)| within float32 summation (K terms) and the
    output rounding."""
    x64 = np.asarray(x, np.float64).reshape(-1, K)
    w64 = np.asarray(nv.dequantize(w, jnp.float32), np.float64)
    exact = x64 @ w64
    bound = K * 2**-23 * (np.abs(x64) @ np.abs(w64))
    bound += np.abs(exact) * (2**-8 if dtype == "bfloat16" else 2**-24)
    got = np.asarray(got, np.float64).reshape(exact.shape)
    return bool((np.abs(got - exact) <= bound).all())


def main():
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    mesh2 = jax.make_mesh(
        (2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    keys = jax.random.split(jax.random.key(0), 2)
    w_real = nv.quantize(jax.random.normal(keys[0], (K, N)), axis=0, block="16x16")
    x_real = jax.random.normal(keys[1], (T, K), jnp.bfloat16)
    x_exact, w_exact = exact_operands(0)

    def placements(x, w):
        """{case: (x, w)} placed on the devices."""
        x3 = x.reshape(4, T // 4, K)
        return {
            "rows": (jax.device_put(x, NamedSharding(mesh, P("d", None))), w),
            "n": (x, sharded_weight(w, mesh, P("d", None))),
            "rows and n": (
                jax.device_put(x, NamedSharding(mesh2, P("a", None))),
                sharded_weight(w, mesh2, P("b", None)),
            ),
            "batch": (
                jax.device_put(x3, NamedSharding(mesh, P("d", None, None))),
                w,
            ),
            # The contraction sharded: float32 partial sums, summed across
            # the shards, rounded once.
            "k": (
                jax.device_put(x, NamedSharding(mesh, P(None, "d"))),
                sharded_weight(w, mesh, P(None, "d")),
            ),
        }

    out = {}
    for dtype in ("bfloat16", "float32"):

        def matmul(x, w, dtype=dtype):
            return nv.matmul(x, w, out_dtype=dtype)

        f = jax.jit(matmul)
        exact = placements(x_exact, w_exact)
        for case, args in placements(x_real, w_real).items():
            r = check(f, exact[case], f(x_exact.reshape(args[0].shape), w_exact))
            r["within_bound"] = within_bound(f(*args), x_real, w_real, dtype)
            r["real collectives"] = collectives(f.lower(*args).compile().as_text())
            out[f"{case} {dtype}"] = r

    # Explicit mesh axes (jax.make_mesh's default): the result is typed with
    # x's row sharding, inside jax.set_mesh and with only x's type naming it.
    explicit = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    f = jax.jit(nv.matmul)
    want = f(x_exact, w_exact)
    xs = jax.device_put(x_exact, NamedSharding(explicit, P("d", None)))
    with jax.set_mesh(explicit):
        in_scope = f(xs, w_exact)
    for name, got in (("set_mesh", in_scope), ("typed", f(xs, w_exact))):
        out[f"explicit {name}"] = {
            "bytes_equal": bool(np.array_equal(bits(got), bits(want))),
            "type": str(jax.typeof(got)),
        }

    # The decode primitive: rows and the batch partition.
    codes = w_real.codes.reshape(1, N, K // 2)
    scales = w_real.scales.reshape(1, N, K // 16)
    decode = jax.jit(ops.decode_bf16)
    spec = NamedSharding(mesh, P(None, "d", None))
    out["decode rows"] = check(
        decode,
        (jax.device_put(codes, spec), jax.device_put(scales, spec)),
        decode(codes, scales),
    )
    spec = NamedSharding(mesh, P(None, None, "d"))
    out["decode blocks"] = check(
        decode,
        (jax.device_put(codes, spec), jax.device_put(scales, spec)),
        decode(codes, scales),
    )
    out.update(grouped_cases(mesh))
    print(json.dumps(out))


def grouped_cases(mesh):
    """The grouped form (ragged_dot by NVFP4 experts [G, K, N]): the experts'
    rows (N) sharded need no collective; the contraction sharded adds the
    float32 all-reduce of the partial sums; x's rows sharded are gathered
    (a shard of rows would need its own group sizes)."""
    groups = 4
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 256, (groups, N, K // 2), dtype=np.uint8)
    scale_bytes = rng.choice([0x38, 0x40], (groups, N, K // 16)).astype(np.uint8)
    experts = nv.NVFP4Tensor(
        jnp.asarray(codes),
        jnp.asarray(scale_bytes).view(jnp.float8_e4m3fn),
        jnp.asarray(2688.0 * np.arange(1, groups + 1), jnp.float32),
        shape=(K, N),
        axis=0,
    )
    x = jnp.asarray(rng.integers(-4, 5, (T, K)), jnp.bfloat16)
    sizes = jnp.asarray([20, 0, 30, 9], jnp.int32)
    f = jax.jit(nv.ragged_dot)
    want = f(x, experts, sizes)

    def placed(spec_x, spec_w):
        return (
            jax.device_put(x, NamedSharding(mesh, spec_x)),
            jax.tree.map(
                lambda a: jax.device_put(
                    a, NamedSharding(mesh, spec_w if a.ndim == 3 else P())
                ),
                experts,
            ),
            sizes,
        )

    return {
        f"grouped {case}": check(f, args, want)
        for case, args in {
            "n": placed(P(), P(None, "d", None)),
            "k": placed(P(None, "d"), P(None, None, "d")),
            "rows": placed(P("d", None), P()),
        }.items()
    }


if __name__ == "__main__":
    main()
