# find_python: prints a Python >= 3.12 interpreter ($PYTHON312, pyenv's 3.12/3.13, python3.12/3.13 on PATH), or nothing.
# Sourced by scripts/bootstrap_venv.sh and scripts/test_jax_min.sh.
find_python() {
  if [[ -n "${PYTHON312:-}" ]]; then echo "$PYTHON312"; return; fi
  local root
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for cand in "$root"/versions/3.12.*/bin/python "$root"/versions/3.13.*/bin/python \
              "$(command -v python3.12 || true)" "$(command -v python3.13 || true)"; do
    if [[ -n "$cand" && -x "$cand" ]] && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
      echo "$cand"; return
    fi
  done
}
