#!/usr/bin/env bash
# Creates (idempotently) the Python 3.11 CPU PyTorch environment used by the parity tests and the
# training benchmark: torch==2.13.0 (CPU wheel; the only torch wheel on these machines is cp311),
# transformers 5.24.0 (the version the exports are checked against), safetensors, numpy, sentencepiece. A stamp
# file makes a second run a no-op.
#
# usage: bash scripts/bootstrap_torch_env.sh [VENV_DIR]   (default .venv-torch)
# env:   PYTHON311=/path/to/python3.11 picks the interpreter explicitly.
set -euo pipefail
VENV=${1:-.venv-torch}
TORCH_VERSION=2.13.0
# pyyaml: imported by llama.cpp's gguf-py (the GGUF oracle, scripts/fetch_llamacpp_converter.sh)
PKGS=("torch==${TORCH_VERSION}" "transformers==5.24.0" safetensors numpy sentencepiece pyyaml)
STAMP_CONTENT="torch-env v1: ${PKGS[*]}"
STAMP="$VENV/.torch-env-installed"

# Fast path: nothing to do when the stamp matches and the interpreter is still there.
if [[ -f "$STAMP" && -x "$VENV/bin/python" && "$(cat "$STAMP")" == "$STAMP_CONTENT" ]]; then
  exit 0
fi

is311() { [[ -n "$1" && -x "$1" ]] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; }

find_python() {
  if [[ -n "${PYTHON311:-}" ]]; then
    if is311 "$PYTHON311"; then echo "$PYTHON311"; fi
    return
  fi
  local root cand
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for cand in "$root"/versions/3.11.*/bin/python "$(command -v python3.11 || true)" "$(command -v python3 || true)"; do
    if is311 "$cand"; then echo "$cand"; return; fi
  done
}

PYBIN=$(find_python || true)
if [[ -z "$PYBIN" ]]; then
  echo "error: no Python 3.11 interpreter found (the CPU torch ${TORCH_VERSION} wheel is cp311); install one with 'pyenv install 3.11' or set PYTHON311=/path/to/python3.11" >&2
  exit 2
fi

if [[ ! -x "$VENV/bin/python" ]] || ! is311 "$VENV/bin/python"; then
  rm -rf "$VENV"
  echo "creating $VENV from $PYBIN" >&2
  "$PYBIN" -m venv "$VENV"
fi

# --only-binary: never build anything. The CPU torch wheel comes from the machine's pip config
# (find-links /opt/wheels here); the check below refuses a CUDA build if one ever slips in.
# (pip's "Location ... is ignored" notes about absent local index folders are filtered out.)
set +e
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --only-binary=:all: "${PKGS[@]}" 2>&1 \
  | grep -v -E "^WARNING: Location '.*' is ignored" >&2
rc=${PIPESTATUS[0]}
set -e
if [[ $rc -ne 0 ]]; then
  echo "error: pip could not install ${PKGS[*]} into $VENV (exit $rc)" >&2
  exit "$rc"
fi

"$VENV/bin/python" - <<'EOF'
import sys
import torch, transformers, safetensors, numpy, sentencepiece  # noqa: F401
if torch.version.cuda is not None:
    sys.exit(f"error: {torch.__version__} is a CUDA build; this environment must hold the CPU wheel")
print(f"torch env ready: torch {torch.__version__}, transformers {transformers.__version__}", file=sys.stderr)
EOF
echo "$STAMP_CONTENT" > "$STAMP"
