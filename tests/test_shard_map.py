"""Inside a user's shard_map the primitives run per shard; with the amax
reduced across shards (lax.pmax) round-to-nearest bytes equal one device's.
Runs in a subprocess with 4 virtual CPU devices (XLA_FLAGS is read at start)."""

import os
import subprocess
import sys
import tempfile
import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import jax_nvfp4 as nv
    try:
        from jax import shard_map
    except ImportError:
        from jax.experimental.shard_map import shard_map

    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("data",))
    x = jax.random.normal(jax.random.key(0), (64, 128), jnp.float32)
    x = x.at[3, 5].set(1000.0)  # an outlier in one shard only

    def per_shard(xs):
        amax = jax.lax.pmax(nv.global_amax(xs), "data")
        t = nv.quantize(xs, amax=amax)
        return t.codes, jax.lax.bitcast_convert_type(t.scales, jnp.uint8)

    f = jax.jit(shard_map(per_shard, mesh=mesh, in_specs=P("data"),
                          out_specs=P("data")))
    codes, scales = f(x)
    one = nv.quantize(x)
    assert len(jax.devices("cpu")) == 4
    np.testing.assert_array_equal(codes, one.codes)
    np.testing.assert_array_equal(
        scales, jax.lax.bitcast_convert_type(one.scales, jnp.uint8))
    print("ok")
    """
)


def test_quantize_inside_shard_map_matches_one_device():
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        JAX_PLATFORMS="cpu",
    )
    # Not from the repository root, which would shadow the installed package.
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tempfile.gettempdir(),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
