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
# jemalloc: deskfleet's processes run on it where it is installed (deskfleet/agent/allocator.py says why).
if ! ldconfig -p 2>/dev/null | grep -q 'libjemalloc\.so\.2'; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get install -y -q libjemalloc2 >/dev/null \
            || echo "bootstrap: could not install libjemalloc2; deskfleet runs on glibc's malloc" >&2
    else
        echo "bootstrap: no libjemalloc.so.2 (Debian: apt install libjemalloc2); deskfleet runs on glibc's malloc" >&2
    fi
fi
# mypy cannot follow setuptools' package-dir mapping of an editable install: give it a deskfleet/ tree.
mkdir -p .typecheck/deskfleet
for package in common agent controller; do
    ln -sfn "../../$package" ".typecheck/deskfleet/$package"
done
