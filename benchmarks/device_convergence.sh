#!/usr/bin/env bash
# One device call of the convergence run (the GPU machine has no network):
# install the carried wheels (.wheels/: equinox, optax and their pure-Python
# dependencies), build the committed tree, run benchmarks/convergence.sh for
# $PRECS with results under $OUT/convergence.
ROOT=$PWD
python3 --version
for w in equinox jaxtyping wadler_lindig optax chex toolz typing_extensions absl_py; do
  python3 -m pip install -q --no-deps --no-index "$ROOT"/.wheels/${w}-*.whl 2>&1 | grep -v WARN | tail -1
done
python3 -c "import equinox, optax; print('equinox', equinox.__version__, 'optax', optax.__version__)"
# A clean export of the commit to build (carried; see the README's
# "Reproduce" notes): git archive HEAD | tar -x -C .gl/src
SRC=$ROOT
[ -f "$ROOT/.gl/src/pyproject.toml" ] && SRC=$ROOT/.gl/src
echo "building $SRC ($(cat "$SRC/COMMIT" 2>/dev/null))"
cd "$SRC" || exit 1
JAX_NVFP4_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation \
  --no-deps -q . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
(cd /tmp && python3 -c "import jax_nvfp4 as nv; print(nv.available_platforms())")
OUT=$OUT/convergence DATA=$ROOT/.data/corpus.bin STEPS=${STEPS:-2000} PYTHON=python3 \
  timeout "${BUDGET:-540}" bash "$SRC/benchmarks/convergence.sh" $PRECS
