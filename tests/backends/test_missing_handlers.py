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


# The running jaxlib's XLA FFI API made older than the extension's: XLA would
# refuse the handlers (and fail to start the CPU backend), so they are not
# registered; the twin runs, with a warning that says how to rebuild.
OLDER_RUNTIME = (
    r"""
import os, tempfile
import jax
headers = tempfile.mkdtemp()
os.makedirs(os.path.join(headers, "xla", "ffi", "api"))
with open(os.path.join(headers, "xla", "ffi", "api", "c_api.h"), "w") as f:
    f.write("#define XLA_FFI_API_MAJOR 0\n#define XLA_FFI_API_MINOR 0\n")
jax.ffi.include_dir = lambda: headers
"""
    + PROGRAM
    + """
print("other jax work runs", float(jax.numpy.ones(3).sum()))
"""
)


def test_handlers_newer_than_the_running_jaxlib_are_not_registered(tmp_path):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("JAX_NVFP4")}
    environ.update(JAX_PLATFORMS="cpu", PYTHONWARNINGS="")
    result = subprocess.run(
        [sys.executable, "-c", OLDER_RUNTIME],
        cwd=tmp_path,  # the installed package
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "platforms []" in result.stdout
    assert "other jax work runs 3.0" in result.stdout
    found = warnings_in(result.stderr)
    assert len(found) == 1, result.stderr[-3000:]
    assert "another jaxlib" in found[0] and "--no-build-isolation" in found[0]


def test_api_versions_compare(tmp_path):
    from jax_nvfp4.backends import library

    header = tmp_path / "xla" / "ffi" / "api" / "c_api.h"
    header.parent.mkdir(parents=True)
    header.write_text("#define XLA_FFI_API_MAJOR 0\n//\n#define XLA_FFI_API_MINOR 4\n")
    assert library.runtime_ffi_api_version(str(tmp_path)) == (0, 4)
    assert library.runtime_ffi_api_version(str(tmp_path / "none")) is None
    assert library.api_mismatch((0, 3), (0, 4)) is None  # older handlers run
    assert library.api_mismatch((0, 4), (0, 4)) is None
    assert library.api_mismatch((0, 5), None) is None  # unknown: let XLA decide
    assert "API 0.5" in library.api_mismatch((0, 5), (0, 4))
    assert library.api_mismatch((0, 3), (1, 0)) is not None  # another major
    # The installed extension's headers are this jaxlib's or older.
    built = library.extension().ffi_api_version()
    assert library.api_mismatch(built, library.runtime_ffi_api_version()) is None


@pytest.mark.parametrize(
    "build, says",
    [
        ("JAX_NVFP4_CUDA=OFF", "as JAX_NVFP4_CUDA=OFF asked"),
        ("no nvcc", "nvcc was not found"),
    ],
)
def test_missing_cuda_handlers_say_why(monkeypatch, build, says):
    from jax_nvfp4.backends import library

    class Extension:
        __file__ = "/site/jax_nvfp4/_ffi.so"

        @staticmethod
        def cuda_build():
            return build

    monkeypatch.setattr(library, "extension", lambda: Extension)
    monkeypatch.setattr(library, "_import_error", None)
    monkeypatch.setattr(library, "_refused", None)
    assert says in library._why_missing("cuda")
