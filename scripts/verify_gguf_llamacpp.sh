#!/usr/bin/env bash
# Runs a GGUF written by `minicpm4 export gguf` in llama.cpp itself (through llama-cpp-python) and
# saves its logits, for the opt-in test tests/test_gguf_export.py::test_gguf_logits_in_llamacpp
# (MINICPM4_LLAMACPP=1 pytest -m llamacpp tests/test_gguf_export.py), which compares them with the
# JAX model (<= 1e-3 for F32).
#
# llama-cpp-python has no wheel on PyPI (spec export.md §2.4): the first run builds one from the
# sdist (15-30 min on 2 cores; CPU only, -DGGML_NATIVE=OFF so the cached wheel runs on any x86-64,
# mtmd off) and caches it in $LLAMACPP_WHEEL_DIR; later runs reuse it. The wheel is installed into
# its own venv ($LLAMACPP_VENV, default .cache/venv-llamacpp) so the project's .venv stays as it is.
#
# usage: bash scripts/verify_gguf_llamacpp.sh MODEL.gguf IDS.npy SCORES_OUT.npy
#   IDS.npy: int token ids [T] (no BOS is added); SCORES_OUT.npy: float32 logits [T, vocab].
# env: LLAMA_CPP_PYTHON_VERSION (0.3.36), LLAMACPP_WHEEL_DIR (~/.cache/minicpm4-jax/wheels),
#      LLAMACPP_VENV (.cache/venv-llamacpp), PYTHON (the interpreter for that venv; default .venv's base).
set -euo pipefail
if [[ $# -ne 3 ]]; then
  echo "usage: $0 MODEL.gguf IDS.npy SCORES_OUT.npy" >&2
  exit 2
fi
MODEL=$1; IDS=$2; OUT=$3
[[ -f "$MODEL" ]] || { echo "error: $MODEL does not exist" >&2; exit 2; }
[[ -f "$IDS" ]] || { echo "error: $IDS does not exist" >&2; exit 2; }
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
WHEELS=${LLAMACPP_WHEEL_DIR:-$HOME/.cache/minicpm4-jax/wheels}
VENV=${LLAMACPP_VENV:-.cache/venv-llamacpp}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then
    PYTHON=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
  else
    PYTHON=python3
  fi
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "creating $VENV from $PYTHON" >&2
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
TAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
WHEEL=$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-{"$TAG",py3}-*.whl 2>/dev/null | head -1 || true)  # the wheel is tagged py3-none
if [[ -z "$WHEEL" ]]; then
  command -v cmake >/dev/null || { echo "error: cmake is needed to build llama-cpp-python (apt-get install cmake)" >&2; exit 2; }
  command -v g++ >/dev/null || { echo "error: g++ is needed to build llama-cpp-python (apt-get install g++)" >&2; exit 2; }
  mkdir -p "$WHEELS"
  echo "building llama-cpp-python==$VERSION from source (15-30 min on 2 cores; cached in $WHEELS)" >&2
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    "$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
    -w "$WHEELS" "llama-cpp-python==$VERSION"
  WHEEL=$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-{"$TAG",py3}-*.whl 2>/dev/null | head -1)
fi
"$PY" -c "import llama_cpp, numpy" 2>/dev/null || \
  "$PY" -m pip install -q --disable-pip-version-check "$WHEEL" numpy 2>&1 | grep -v "^WARNING: Location" >&2 || true

"$PY" - "$MODEL" "$IDS" "$OUT" <<'PYEOF'
import sys
import numpy as np
from llama_cpp import Llama

model, ids_path, out = sys.argv[1:4]
ids = [int(i) for i in np.load(ids_path).reshape(-1)]
llm = Llama(model_path=model, n_ctx=0, n_gpu_layers=0, logits_all=True, verbose=False, seed=0)
llm.eval(ids)
scores = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
np.save(out, scores)
print(f"llama.cpp: {len(ids)} tokens, logits {scores.shape} -> {out}", file=sys.stderr)
PYEOF
