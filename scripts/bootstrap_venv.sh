#!/usr/bin/env bash
# Creates (or updates) the project's virtual environment from a Python >= 3.12 interpreter.
# JAX 0.12 needs Python >= 3.12; on these machines pyenv provides it.
set -euo pipefail
VENV=${1:-.venv}
source "$(dirname "${BASH_SOURCE[0]}")/find_python.sh"
PYBIN=$(find_python)
if [[ -z "$PYBIN" ]]; then
  echo "error: no Python >= 3.12 found (JAX 0.12 needs it); install one with 'pyenv install 3.12' or set PYTHON312=/path/to/python3.12" >&2
  exit 1
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "creating $VENV from $PYBIN"
  "$PYBIN" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import jax, flax, minicpm4_jax.train, minicpm4_jax.ops; print('venv ready: jax', jax.__version__, 'flax', flax.__version__)"
