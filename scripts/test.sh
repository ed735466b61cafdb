#!/usr/bin/env bash
# The test command of the README (and of CI): sets up ./.venv, then runs the whole suite.
# Extra arguments go to pytest (e.g. -k layout, -x).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS=test bash "$root/scripts/ensure_env.sh"
cd "$root"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "ERROR: pytest collected no tests; refusing to report success" >&2
fi
exit "$status"
