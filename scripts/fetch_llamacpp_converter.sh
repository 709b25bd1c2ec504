#!/usr/bin/env bash
# Fetches (idempotently) llama.cpp's own HF -> GGUF converter as vendored in the llama-cpp-python
# source distribution on PyPI (there is no wheel; spec export.md §2.4): convert_hf_to_gguf.py, its
# conversion/ package and gguf-py/. Used as an independent oracle by tests/test_gguf_export.py and by
# scripts/verify_gguf_llamacpp.sh. Only the sdist is downloaded (pip prepares its metadata with the
# scikit-build-core backend, nothing is compiled).
#
# usage: bash scripts/fetch_llamacpp_converter.sh [DEST]     (default .cache/llama-cpp-python-0.3.36)
# env:   PIP="python -m pip" to pick the pip; LLAMA_CPP_PYTHON_VERSION to pick another sdist.
# prints the folder that holds convert_hf_to_gguf.py; also keeps the sdist as DEST/sdist/*.tar.gz.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DEST=${1:-.cache/llama-cpp-python-${VERSION}}
PIP=${PIP:-python3 -m pip}
mkdir -p "$(dirname "$DEST")"
exec 9>"$DEST.lock"   # parallel test workers: one downloads, the others wait and reuse
flock 9
if [[ -f "$DEST/llama.cpp/convert_hf_to_gguf.py" && -d "$DEST/llama.cpp/conversion" && -d "$DEST/llama.cpp/gguf-py" ]]; then
  echo "$DEST/llama.cpp"
  exit 0
fi
TMP=$(mktemp -d "$(dirname "$DEST")/.llamacpp-fetch.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
set +e
$PIP download -q --disable-pip-version-check --no-deps --no-binary :all: -d "$TMP/sdist" \
  "llama-cpp-python==${VERSION}" 2>&1 | grep -v -E "^WARNING: Location '.*' is ignored" >&2
rc=${PIPESTATUS[0]}
set -e
SDIST=$(ls "$TMP"/sdist/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)
if [[ $rc -ne 0 || -z "$SDIST" ]]; then
  echo "error: could not download the llama-cpp-python==${VERSION} sdist from PyPI (pip exit $rc); the GGUF oracle needs it" >&2
  exit 3
fi
ROOT="llama_cpp_python-${VERSION}/vendor/llama.cpp"
mkdir -p "$TMP/x"
tar -xzf "$SDIST" -C "$TMP/x" "$ROOT/convert_hf_to_gguf.py" "$ROOT/conversion" "$ROOT/gguf-py"
mkdir -p "$TMP/out"
mv "$TMP/x/$ROOT" "$TMP/out/llama.cpp"
mv "$TMP/sdist" "$TMP/out/sdist"
rm -rf "$DEST"
mv "$TMP/out" "$DEST"
echo "$DEST/llama.cpp"
