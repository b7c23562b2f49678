"""Where does the GPU's RHT recipe differ from the CPU's? (the "Open" bug in
benchmarks/NOTES.md). Run on a GPU machine:

    python benchmarks/diagnose_recipe_tie.py

Quantizes the recipe test's x (64 tokens x 64 features, float32, outliers) on
the GPU (handlers and pure-JAX twin through XLA:GPU) and on the CPU (handler
and twin) and prints which bytes differ; then lists the custom calls in the
compiled GPU step of the failing test.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "tests")
from conftest import outlier_data, tensor_bytes  # noqa: E402

import jax_nvfp4 as nv  # noqa: E402


def quantize_on(device, implementation, x):
    x = jax.device_put(x, device)
    with jax.default_device(device):
        fn = jax.jit(
            lambda x: nv.quantize_rowwise_and_columnwise(
                x, col_rht=True, implementation=implementation
            )
        )
        rows, cols = fn(x)
        both = jax.jit(lambda x: nv.global_amax(x, axis=0, rht=True))(x)
        amax_rht = np.asarray(both, np.float32)
    return tensor_bytes(rows), tensor_bytes(cols), amax_rht


def main():
    gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
    print("devices:", gpu, cpu, "handlers:", sorted(nv.available_platforms()))
    x = np.asarray(outlier_data(0, (64, 64), jnp.float32))
    results = {
        (d.platform, impl): quantize_on(d, impl, x)
        for d in (gpu, cpu)
        for impl in ("ffi", "reference")
    }
    base = results[("cpu", "reference")]
    for name, (rows, cols, amax_rht) in results.items():
        print(name, "RHT amax", amax_rht, amax_rht.view(np.uint32))
        for label, t, b in (("rows", rows, base[0]), ("cols", cols, base[1])):
            for field, u, v in zip(("codes", "scales", "amax"), t, b, strict=True):
                diff = np.argwhere(u != v)
                print(f"  {label}.{field}: {len(diff)} differ", diff[:6].tolist())
        print("  cols.codes[22, 9] & 0xF =", cols[0][22, 9] & 0xF)

    w = outlier_data(1, (64, 32), jnp.float32) * 0.1
    g = outlier_data(2, (64, 32), jnp.float32)
    key = jax.random.key(3)

    def loss(x, w, g):
        return jnp.sum(nv.dot(x, w, key=key, recipe=nv.NVFP4).astype(jnp.float32) * g)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    hlo = step.lower(jnp.asarray(x), w, g).compile().as_text()
    targets = sorted(
        {
            line.split('custom_call_target="')[1].split('"')[0]
            for line in hlo.splitlines()
            if "custom_call_target=" in line
        }
    )
    print("custom calls in the compiled GPU step:", targets)
    got = step(jnp.asarray(x), w, g)
    with jax.default_device(cpu):
        want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
            *(jax.device_put(a, cpu) for a in (jnp.asarray(x), w, g))
        )
    for name, a, b in zip(
        ("loss", "dx", "dw"), jax.tree.leaves(got), jax.tree.leaves(want), strict=True
    ):
        a, b = np.asarray(a), np.asarray(b)
        bad = np.argwhere(~np.isclose(a, b, rtol=2e-5, atol=2e-5 * np.abs(b).max()))
        print(f"GPU ffi vs CPU ffi {name}: {len(bad)} differ", bad[:4].tolist())


if __name__ == "__main__":
    main()
