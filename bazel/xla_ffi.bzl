"""Repository rule for @xla_ffi: the XLA FFI C++ headers shipped in jaxlib.

Runs Python ($PYTHON_BIN_PATH, default python3 on PATH) to ask the installed
jax for its include directory, and links that directory into the repository,
so the handlers compile against the FFI API of the jaxlib that will load them.
"""

_BUILD = """\
cc_library(
    name = "headers",
    hdrs = glob(["include/xla/ffi/api/*.h"]),
    includes = ["include"],
    visibility = ["//visibility:public"],
)
"""

def _xla_ffi_impl(ctx):
    python = ctx.os.environ.get("PYTHON_BIN_PATH") or ctx.which("python3")
    if not python:
        fail("@xla_ffi: no python3 on PATH; set PYTHON_BIN_PATH")
    result = ctx.execute([python, "-c", "import jax; print(jax.ffi.include_dir())"])
    if result.return_code != 0:
        fail("@xla_ffi: %s cannot import jax:\n%s" % (python, result.stderr))
    ctx.symlink(result.stdout.strip(), "include")
    ctx.file("BUILD.bazel", _BUILD)

xla_ffi_repository = repository_rule(
    implementation = _xla_ffi_impl,
    environ = ["PATH", "PYTHON_BIN_PATH"],
    local = True,
)
