#!/usr/bin/env bash
# Set up the environment from nothing and run the lint and the test suite (CI runs this).
# Real-model tests are marked `slow` and run apart: scripts/test.sh -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
if [ "$#" -eq 0 ]; then
    set -- -m "not slow"
fi
exec python -m pytest -q "$@"
