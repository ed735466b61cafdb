#!/usr/bin/env bash
# Create or reuse ./.venv with this project installed; sourced by run_train.sh and
# scripts/test.sh. Re-installs only when pyproject.toml changed.
#   EXTRAS=test  also installs the test dependencies.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"
extras="${EXTRAS:-}"

if [ ! -x "$venv/bin/python" ]; then
  if "$python" -c "import torch" 2>/dev/null; then
    # A machine that ships torch (e.g. a CUDA image) keeps its build: never replace it.
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"
  fi
fi
# This machine's pip.conf names local mirrors that may not exist; pip warns about each one.
pip_install() {
  "$venv/bin/pip" install --quiet "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
stamp="$venv/.installed-$(cat "$root/pyproject.toml" | sha1sum | cut -c1-12)-${extras:-base}"
if [ ! -f "$stamp" ]; then
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    # Pinned on purpose: an unpinned torch pulls several GB of CUDA wheels on CPU machines.
    pip_install "torch==2.13.0"
  fi
  target="$root"
  [ -n "$extras" ] && target="$root[$extras]"
  pip_install -e "$target"
  touch "$stamp"
fi
