#!/usr/bin/env bash
# GPU tests in parallel pytest processes (test compilation is CPU-bound; the
# GPU machine has 16 cores). Each argument is one group of test paths; logs
# land in $OUT/pytest_<n>.txt, a summary line per group on stdout.
#   bash benchmarks/gpu_tests_parallel.sh "tests/test_quantize.py" "tests/test_recipe.py tests/test_gemm.py"
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.2
n=0
for group in "$@"; do
  n=$((n + 1))
  # -P: the installed package, not the source tree (no CUDA build there).
  timeout "${PYTEST_TIMEOUT:-300}" python3 -P -m pytest -q -rfE -p no:cacheprovider $group \
    > "$OUT/pytest_$n.txt" 2>&1 &
done
wait
for i in $(seq 1 $n); do
  echo "group $i: $(grep -E '^(FAILED|ERROR)' "$OUT/pytest_$i.txt" | head -5 | tr '\n' ' ') $(tail -1 "$OUT/pytest_$i.txt")"
done
