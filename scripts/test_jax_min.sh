#!/usr/bin/env bash
# The oldest supported JAX (0.11.2, what the GPU machines run) without grain and tensorboardX (which they lack):
# builds .venv-jax-min idempotently and runs what those machines use (the model, ops/, the Pallas kernels'
# Triton/TPU lowering and scripts/gpu_check.sh's dry run), so an API that 0.11.2 lacks fails on CPU here, not on a
# rare 15-minute GPU run.
#
#   bash scripts/test_jax_min.sh [VENV]      # default .venv-jax-min; `make test` runs it after the main suite
#
# Found this way (2026-12-01): a jitted shard_map with a zero-sized operand segfaults in jax 0.11.2's compiler
# (ops/dispatch.py: on_mesh keeps zero-sized arguments out of it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${1:-.venv-jax-min}
JAX_MIN=0.11.2
if [[ ! -x "$VENV/bin/python" ]]; then
  # the same interpreter search as the main venv (Python >= 3.12)
  source scripts/find_python.sh
  PYBIN=$(find_python)
  if [[ -z "$PYBIN" ]]; then
    echo "error: no Python >= 3.12 found for $VENV; set PYTHON312=/path/to/python3.12" >&2
    exit 1
  fi
  "$PYBIN" -m venv "$VENV"
fi
# the project's dependencies (pyproject.toml) without grain and tensorboardX, with jax/jaxlib at the oldest version
mapfile -t DEPS < <("$VENV/bin/python" - "$JAX_MIN" <<'EOF'
import sys, tomllib
jax_min = sys.argv[1]
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for d in deps:
    name = d.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip().lower()
    if name in ("grain", "tensorboardx"):
        continue
    print(f"{name}=={jax_min}" if name in ("jax", "jaxlib") else d)
print("pytest>=8,<10")
print("pytest-xdist>=3.5,<4")
print("hypothesis>=6,<7")
EOF
)
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "${DEPS[@]}" 2>&1 | { grep -v "^WARNING: Location" || true; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # absolute: tests run subprocesses from other folders
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR_JAX_MIN:-$PWD/.cache/jax_compilation_jax_min}
"$VENV/bin/python" - "$JAX_MIN" <<'EOF'
import sys
import jax
assert jax.__version__ == sys.argv[1], f"{sys.argv[0]}: expected jax {sys.argv[1]}, got {jax.__version__}"
import minicpm4_jax, minicpm4_jax.cli, minicpm4_jax.infer, minicpm4_jax.ops, ops, train.step  # noqa: E401,F401
for mod in ("grain", "tensorboardX"):
    assert mod not in sys.modules, f"importing the model, ops/ or the train step imported {mod}"
print(f"jax {jax.__version__}: the model, ops/, the CLI and the train step import without grain and tensorboardX")
EOF
"$VENV/bin/python" -m pytest -q -n 2 -p no:cacheprovider \
  tests/test_pallas_model.py tests/test_lowering_contracts.py tests/test_pallas_decode.py tests/test_pallas_sparse.py \
  tests/test_pallas_stage1.py -k "lower or lowering or on_mesh or per_device"
# the command's compilation cache: JAX's config names and the cache-key hook it wraps exist in this jax (the train
# run of test_second_run_reads_the_cache needs grain, which this environment lacks)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_compilation_cache.py -k "not second_run"
# scripts/gpu_check.sh's CPU dry run with this interpreter, as the GPU machine runs it (run_tests.sh leaves it out)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_gpu_check_script.py
