#!/usr/bin/env bash
# Builds .venv-genai: the OpenVINO GenAI baseline for `deskfleet bench parity` (optimum-cli to export
# the checkpoint, openvino-genai's LLMPipeline to run it). It has its own venv because optimum-intel
# pins transformers < 5.6 while deskfleet's export uses a newer one. Safe to run repeatedly.
#   bash scripts/genai_venv.sh            # -> .venv-genai (or $DESKFLEET_GENAI_VENV)
# Then export the baseline model with the weight policy deskfleet's int4 export uses (INT4_ASYM, group
# 128, ratio 1.0 on every decoder MatMul; INT8_ASYM per channel for embeddings and lm_head):
#   .venv-genai/bin/optimum-cli export openvino -m CKPT --task text-generation-with-past \
#       --weight-format int4 --group-size 128 --ratio 1.0 --backup-precision int8_asym OUT
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="${DESKFLEET_GENAI_VENV:-.venv-genai}"
stamp="$venv/.genai-installed"
# A venv whose creation was interrupted has bin/python but no pip: made again (only a venv is removed).
. scripts/venv.sh
ensure_venv genai_venv "$venv" .genai-installed DESKFLEET_GENAI_VENV 'import pip' "a working venv"
# What the install was made for: this script's recipe (the packages and pins below) and the venv's Python.
# A change of either installs again; an install interrupted before its end left no stamp.
wanted="$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1) $("$venv/bin/python" -c 'import sys; print(sys.version)' | head -1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
    rm -f "$stamp"
    # The CPU build of torch FIRST: a bare `torch` requirement (optimum's) would pull a multi-GB CUDA build.
    "$venv/bin/python" -m pip install -q torch==2.13.0
    torch_version="$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
    # Keep the installed torch (and so no CUDA wheel) while optimum-intel resolves its own pins.
    constraints="$(mktemp)"
    trap 'rm -f "$constraints"' EXIT
    echo "torch==${torch_version}" > "$constraints"
    "$venv/bin/python" -m pip install -q -c "$constraints" "optimum-intel[openvino]" openvino-genai openvino-tokenizers
    # optimum-intel requires torchvision, and PyPI's torchvision wheel is built against the CUDA torch: with
    # the CPU torch its import fails ("operator torchvision::nms does not exist") and takes transformers'
    # model classes with it. Nothing on the export path needs it; transformers treats it as optional.
    if ! "$venv/bin/python" -c "import torchvision" >/dev/null 2>&1; then
        "$venv/bin/python" -m pip uninstall -q -y torchvision
    fi
    printf '%s\n' "$wanted" > "$stamp"
fi
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("openvino", "openvino-genai", "openvino-tokenizers", "optimum-intel", "transformers", "torch"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} missing")
PY
