#!/usr/bin/env bash
# One command for a GPU machine without network: the `cuda` tests, then SFT, GRPO and generator
# figures written to docs/benchmarks/gpu.md (scripts/gpu_check.py says what each step measures).
#   bash scripts/gpu_check.sh                         # on the GPU machine, from the repository root
#   bash scripts/gpu_check.sh --cpu --out PAGE.md     # the same steps at tiny sizes on CPU (CI)
#   bash scripts/gpu_check.sh --fetch-wheels          # before the loan, on a networked machine
# --fetch-wheels downloads into .whl/ the wheels the GPU image lacks (scripts/gpu_wheels.py);
# carry .whl/ along with the repository. When .whl/ holds wheels (and not with --cpu, which uses
# the interpreter's own packages) they are installed into a temporary folder put first on
# PYTHONPATH: the image's own torch is kept, no venv is made.
# Other arguments go to scripts/gpu_check.py (--log-dir, --budget-s, ...). The interpreter is
# $PYTHON, else ./.venv/bin/python when there is one, else python3.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi

if [ "${1:-}" = "--fetch-wheels" ]; then
  shift
  exec "$python" scripts/gpu_wheels.py fetch "$@"
fi

cpu_mode=false
for arg in "$@"; do
  if [ "$arg" = "--cpu" ]; then cpu_mode=true; fi
done
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if [ "$cpu_mode" = false ] && compgen -G ".whl/*.whl" >/dev/null; then
  site="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX")"
  trap 'rm -rf "$site"' EXIT
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
  export PYTHONPATH="$site:$PYTHONPATH" GPU_CHECK_SITE="$site"
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$python" scripts/gpu_wheels.py missing || echo "warning: required modules are missing (above); the steps needing them will fail" >&2
"$python" scripts/gpu_check.py "$@"
