#!/usr/bin/env bash
# The test command of the README (and of CI): sets up ./.venv, then runs the whole suite.
# Extra arguments go to pytest (e.g. -k layout, -x). `--quick` first runs the inner-loop subset
# instead: the unit tests without the inductor compiles (single process, a few minutes).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS=test bash "$root/scripts/ensure_env.sh"
# The rollout viewer's page is tested in a headless browser: Debian's chromium and its WebDriver.
if { [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; } && command -v apt-get > /dev/null; then
  as_root=()
  [ "$(id -u)" -eq 0 ] || as_root=(sudo)
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver > /dev/null
fi
cd "$root"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
set +e
if [ "${1:-}" = "--quick" ]; then
  shift
  set -- tests/unit --ignore=tests/unit/test_compile.py "$@"
fi
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "ERROR: pytest collected no tests; refusing to report success" >&2
fi
exit "$status"
