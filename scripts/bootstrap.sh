#!/usr/bin/env bash
# Creates .venv and installs deskfleet with its export and dev extras. Safe to run repeatedly:
# it reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="${DESKFLEET_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
stamp="$venv/.deskfleet-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    # The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
    "$venv/bin/pip" install -q torch==2.13.0
    "$venv/bin/pip" install -q -e ".[export,dev]"
    touch "$stamp"
fi
# mypy cannot follow setuptools' package-dir mapping of an editable install: give it a deskfleet/ tree.
mkdir -p .typecheck/deskfleet
for package in common agent controller; do
    ln -sfn "../../$package" ".typecheck/deskfleet/$package"
done
