#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv.
# torch is pinned to 2.13.0: on these machines that is a CPU build on local disk; an
# unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install --quiet --upgrade pip
pip install --quiet "torch==2.13.0"
pip install --quiet -e ".[dev,ucx,bench]"
