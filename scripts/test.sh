#!/usr/bin/env bash
# The test command: set-up, lint, type check, then every test (slow and integration ones included).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
venv="${DESKFLEET_VENV:-.venv}"
echo "== ruff"
"$venv/bin/python" -m ruff check common agent controller tests
echo "== mypy"
MYPYPATH=.typecheck "$venv/bin/python" -m mypy -p deskfleet
echo "== pytest"
# --durations: the slowest tests in the log, to tell a slow CI machine from a hung test
"$venv/bin/python" -m pytest -p no:cacheprovider --durations=25 "$@"
