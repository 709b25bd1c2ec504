#!/usr/bin/env bash
# Runs the whole test suite; pytest's exit code 5 (no tests collected) is a failure.
set -uo pipefail
PY=${1:-.venv/bin/python}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.cache/jax_compilation}
# tests/test_gpu_check_script.py runs in scripts/test_jax_min.sh instead, on the GPU machines' jax (make test runs both)
"$PY" -m pytest -n 2 --dist loadgroup --durations=25 -rs tests --ignore=tests/test_gpu_check_script.py "${@:2}"
rc=$?
if [[ $rc -eq 5 ]]; then echo "error: pytest collected no tests" >&2; exit 1; fi
exit $rc
