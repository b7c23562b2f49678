"""Missing compiled handlers are never silent: importing the source tree
(which holds no extension) warns once per platform, saying why and how to fix
it; JAX_NVFP4_IMPLEMENTATION chooses the twin on purpose (no warning) or
requires the handlers (an error). Each case in a fresh interpreter, since the
handlers are registered at import."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

# Two computations lowered for the CPU, then the results against the twin.
PROGRAM = """
import warnings
warnings.simplefilter("always")
import jax, jax.numpy as jnp, numpy as np
import jax_nvfp4 as nv
x = jax.random.normal(jax.random.key(0), (64, 48), jnp.float32)
t = nv.quantize(x)
y = jax.jit(lambda x: nv.dequantize(nv.quantize(x, axis=0), jnp.float32))(x)
want = nv.quantize(x, implementation="reference")
assert np.array_equal(np.asarray(t.codes), np.asarray(want.codes)), "codes differ"
print("platforms", sorted(nv.available_platforms()))
"""


def run(cwd, env=None, flags=()):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("JAX_NVFP4")}
    environ.update(env or {}, JAX_PLATFORMS="cpu", PYTHONWARNINGS="")
    return subprocess.run(
        [sys.executable, *flags, "-c", PROGRAM],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


def warnings_in(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "MissingHandlersWarning" in line]


def test_source_tree_warns_once_saying_why():
    # `python -c` puts the working directory first on sys.path: the source tree.
    result = run(REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "platforms []" in result.stdout
    found = warnings_in(result.stderr)
    assert len(found) == 1, result.stderr[-3000:]
    assert (
        "source tree" in found[0] and "JAX_NVFP4_IMPLEMENTATION=reference" in found[0]
    )
    # The warning points at the user's line, not into jax.
    assert found[0].startswith("<string>:")


def test_reference_on_purpose_is_silent():
    result = run(REPO, {"JAX_NVFP4_IMPLEMENTATION": "reference"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "platforms []" in result.stdout
    assert warnings_in(result.stderr) == []


def test_native_requires_the_handlers():
    result = run(REPO, {"JAX_NVFP4_IMPLEMENTATION": "native"})
    assert result.returncode != 0
    assert "JAX_NVFP4_IMPLEMENTATION=native requires them" in result.stderr
    assert "source tree" in result.stderr


def test_unknown_implementation_is_refused():
    result = run(REPO, {"JAX_NVFP4_IMPLEMENTATION": "fast"})
    assert result.returncode != 0
    assert "JAX_NVFP4_IMPLEMENTATION='fast' is not one of" in result.stderr


def test_installed_package_has_handlers_and_no_warning(tmp_path):
    import jax_nvfp4 as nv

    if "cpu" not in nv.available_platforms():
        pytest.skip("this interpreter's jax_nvfp4 has no compiled CPU handlers")
    # -P and another directory: the installed package, not the source tree.
    result = run(tmp_path, flags=("-P",))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'cpu'" in result.stdout
    assert warnings_in(result.stderr) == []
