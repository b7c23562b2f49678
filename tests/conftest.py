"""Shared test helpers. Tests are device-agnostic: the handler under test runs
on JAX's default device (a GPU when there is one, else the CPU) and is compared
with the pure-JAX reference evaluated on the CPU."""

import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_report_header(config):
    import jax_nvfp4 as nv
    from jax_nvfp4.backends import library

    return (
        f"jax {jax.__version__}, devices {jax.devices()}; jax_nvfp4 handlers on "
        f"{sorted(nv.available_platforms())} from {library.handler_source()}"
    )


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def on_cpu(fn, *args, **kwargs):
    """Runs fn on the CPU device (for the reference)."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        args = jax.tree_util.tree_map(
            lambda a: jax.device_put(a, cpu) if isinstance(a, jax.Array) else a, args
        )
        return fn(*args, **kwargs)


def tensor_bytes(t):
    """(codes, scale bytes, amax bits) of an NVFP4Tensor as numpy arrays."""
    return (
        np.asarray(t.codes),
        np.asarray(jax.lax.bitcast_convert_type(t.scales, jnp.uint8)),
        np.asarray(t.amax, np.float32).view(np.uint32),
    )


def assert_same_bytes(a, b):
    for name, u, v in zip(
        ("codes", "scales", "amax"), tensor_bytes(a), tensor_bytes(b), strict=False
    ):
        assert u.shape == v.shape, (name, u.shape, v.shape)
        mismatch = np.flatnonzero(u.reshape(-1) != v.reshape(-1))
        assert mismatch.size == 0, (
            f"{name} differ at {mismatch.size} of {u.size} positions, first "
            f"{mismatch[:8]}: {u.reshape(-1)[mismatch[:8]]} vs "
            f"{v.reshape(-1)[mismatch[:8]]}"
        )
    assert a.shape == b.shape and a.axis == b.axis and a.block == b.block


def outlier_data(seed, shape, dtype=jnp.bfloat16):
    """Heavy-tailed random data: log-normal magnitudes, a few large outliers."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape) * 1.5)
    flat = x.reshape(-1)
    idx = rng.choice(flat.size, size=max(1, flat.size // 500), replace=False)
    flat[idx] *= 300.0
    return jnp.asarray(x, dtype)


def run_on_virtual_cpus(script, devices: int) -> dict:
    """Runs ``script`` in a subprocess on ``devices`` virtual CPU devices
    (XLA_FLAGS is read when JAX starts) and returns the JSON object its last
    line of output prints. Not from the repository root, which would shadow
    the installed package."""
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        # The tests' shared helpers (gemm_cases, grouped_cases), whatever
        # folder the script is in.
        PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.abspath(__file__))]
            + [p for p in [os.environ.get("PYTHONPATH")] if p]
        ),
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tempfile.gettempdir(),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def rows_cols(x, key=None, **options):
    """The fused quantize after the key became words
    (``quantize_shard_rows_cols``), whose decoded sides are what the
    recipe's token step asks for; the key turned into words as the public
    call turns it."""
    from jax_nvfp4.keys import key_words
    from jax_nvfp4.quantize import quantize_shard_rows_cols

    stochastic = "stochastic" in (
        options.get("row_rounding"),
        options.get("col_rounding"),
    )
    words = key_words(key, stochastic, x.size) if stochastic else None
    return quantize_shard_rows_cols(x, words=words, **options)
