#!/usr/bin/env bash
# Builds //:jax_nvfp4_cpu with Bazel, offline, and copies the library to
# .build/bazel/libjax_nvfp4_cpu.so; the last line printed is that file's
# absolute path. Needs bazel (Debian's bazel-bootstrap is enough), a C++
# compiler and a Python with jax ($PYTHON_BIN_PATH, default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

# The server stops at the end of the script, and by itself after 5 idle
# minutes should the script be killed before it can stop it.
bz() { bazel --max_idle_secs=300 "$@"; }
trap 'bz shutdown >&2' EXIT

bz build --noshow_progress //:jax_nvfp4_cpu >&2
bin="$(bz info bazel-bin)"
mkdir -p .build/bazel
cp -f "$bin/libjax_nvfp4_cpu.so" .build/bazel/
echo "$PWD/.build/bazel/libjax_nvfp4_cpu.so"
