#!/usr/bin/env bash
# On a GPU host: install toolkit into ./.venv with a CUDA build of torch 2.13, then run every CUDA check
# (bench/gpu_check.py: one table, also written to gpu-check.json; about 5 minutes on one H100/H200).
#
#   scripts/gpu-check.sh [bench/gpu_check.py flags]     e.g. --size-mb 1000, --only checkpoint,transfer
#   scripts/gpu-check.sh --dry                          the CPU twin in the .venv scripts/install.sh made
#
# The install step needs the network (download.pytorch.org: several GB), once; it is skipped when .venv already
# holds torch 2.13 with CUDA, so install while the host has the network and check later without it. Or install
# from wheels brought along: TORCH_WHEELS=/dir (made elsewhere with `pip download torch==2.13.0 --index-url
# https://download.pytorch.org/whl/cu128 -d /dir` plus toolkit's dependencies). The check downloads nothing.
# TORCH_CUDA picks the build (default cu128; take one the driver supports: nvidia-smi shows its CUDA version).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--dry" ]; then
    [ -x .venv/bin/python ] || { echo "gpu-check.sh: no .venv here: run scripts/install.sh first" >&2; exit 2; }
    exec .venv/bin/python bench/gpu_check.py "$@"
fi

has_cuda_torch() {
    [ -x .venv/bin/python ] && .venv/bin/python -c \
        'import sys, torch; sys.exit(0 if torch.__version__.startswith("2.13.0") and torch.version.cuda else 1)' \
        2>/dev/null
}

if ! has_cuda_torch; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    if [ -n "${TORCH_WHEELS:-}" ]; then
        source=(--no-index --find-links "$TORCH_WHEELS")
    else
        source=(--index-url "https://download.pytorch.org/whl/${TORCH_CUDA:-cu128}" --extra-index-url https://pypi.org/simple)
    fi
    echo "gpu-check.sh: installing torch 2.13.0 with CUDA (${TORCH_WHEELS:-${TORCH_CUDA:-cu128}}): needs the network unless TORCH_WHEELS is set"
    .venv/bin/pip install -q --disable-pip-version-check "${source[@]}" torch==2.13.0
    extra=()
    [ -z "${TORCH_WHEELS:-}" ] || extra=("${source[@]}")
    .venv/bin/pip install -q --disable-pip-version-check "${extra[@]}" -c constraints.txt -e '.[test]'
    if ! has_cuda_torch; then
        echo "gpu-check.sh: .venv's torch is not torch 2.13.0 with CUDA after the install: $(.venv/bin/python -c 'import torch; print(torch.__version__)')" >&2
        exit 1
    fi
    touch .venv/.installed  # scripts/install.sh: nothing left to do
fi
exec .venv/bin/python bench/gpu_check.py "$@"
