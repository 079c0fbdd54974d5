#!/usr/bin/env bash
# Set up .venv (scripts/setup_env.sh) and run the test suite: tests/unit, tests/integration
# and tests/gpu (the last is skipped without CUDA). Extra arguments go to pytest.
# "No tests collected" (pytest exit code 5) is a failure here.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
VENV="${TLT_VENV:-$ROOT/.venv}"

# git keeps no empty folders, so a fresh clone may lack some of these.
dirs=()
for d in tests/unit tests/integration tests/gpu; do
    [ -d "$d" ] && dirs+=("$d")
done
if [ "${#dirs[@]}" -eq 0 ]; then
    echo "run_tests: no test folders found" >&2
    exit 1
fi

rc=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${dirs[@]}" "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "run_tests: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit "$rc"
