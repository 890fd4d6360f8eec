#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv.
# torch: 2.13.0 unless the venv has one already. On the development machines that is a
# CPU build on local disk (an unpinned torch would pull a multi-GB CUDA build); on a GPU
# machine install the CUDA build of your choice into .venv first, and it is kept.
# UCX: SPECPIPE_UCX_EXTRA=ucx-cu13 on CUDA 13 hosts (default: ucx, built for CUDA 12).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install --quiet --upgrade pip
python -c "import torch" 2> /dev/null || pip install --quiet "torch==2.13.0"
pip install --quiet -e ".[dev,${SPECPIPE_UCX_EXTRA:-ucx},bench]"
