#!/usr/bin/env bash
# The main job on the shipped demo model: set-up, export the target and draft models to per-layer IR,
# then complete a code prompt across a 2-stage pipeline with speculative decoding.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
venv="${DESKFLEET_VENV:-.venv}"
deskfleet="$venv/bin/deskfleet"
weights="${DESKFLEET_DEMO_WEIGHTS:-int4}"
for role in target draft; do
    source_dir="assets/models/$role"
    export_dir="out/demo/$role-$weights"
    if [ ! -f "$export_dir/manifest.json" ] || [ "$source_dir/model.safetensors" -nt "$export_dir/manifest.json" ]; then
        "$deskfleet" export "$source_dir" -o "$export_dir" --weights "$weights" --overwrite
    fi
done
prompt=${1:-$'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'}
echo "--- prompt"
printf '%s' "$prompt"
echo "--- completion (2 stages, speculative decoding with the draft model)"
"$deskfleet" generate --model "out/demo/target-$weights" --stages 2 --draft "out/demo/draft-$weights" \
    --prompt "$prompt" --max-new-tokens "${DESKFLEET_DEMO_TOKENS:-120}"
