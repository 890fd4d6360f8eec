#!/usr/bin/env bash
# Set up the environment and run one real generation on the default models.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
exec python scripts/quickstart.py "$@"
