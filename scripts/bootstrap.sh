#!/usr/bin/env bash
# Creates .venv and installs deskfleet with its export and dev extras. Safe to run repeatedly, and after an
# interrupted run: it reinstalls when pyproject.toml, the checkout's path or the venv's Python changed since
# the last complete install, and makes the venv again when it is not a working Python 3.11+ venv with pip.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="${DESKFLEET_VENV:-.venv}"
stamp="$venv/.deskfleet-installed"
# A venv whose creation was interrupted has bin/python but no pip; one made by an older Python (or whose
# Python is gone) would take packages built for it, or none at all.
. scripts/venv.sh
ensure_venv bootstrap "$venv" .deskfleet-installed DESKFLEET_VENV \
    'import sys, pip; sys.exit(sys.version_info < (3, 11))' "a working Python 3.11+ venv"
# What the install was made for: the dependencies, where the checkout is (the editable install and the
# entry points name its absolute path), and the venv's Python.
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1) $(pwd -P) $("$venv/bin/python" -c 'import sys; print(sys.version)' | head -1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
    rm -f "$stamp"
    # The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build (here
    # torch==2.13.0 resolves to the CPU wheel in the machine's local wheel folder, for Python 3.11).
    "$venv/bin/python" -m pip install -q torch==2.13.0
    "$venv/bin/python" -m pip install -q -e ".[export,dev]"
    printf '%s\n' "$wanted" > "$stamp"
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
