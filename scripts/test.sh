#!/usr/bin/env bash
# Set up the environment from nothing and run the lint and the test suite (CI runs this).
# Real-model tests are marked `slow` and run apart: scripts/test.sh -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
# A real Prometheus server scrapes the services in tests/integration/test_elastic.py
# (Debian's package; the test skips, saying so, where it cannot be installed).
if ! command -v prometheus > /dev/null && command -v apt-get > /dev/null && [ "$(id -u)" = 0 ]; then
    { apt-get install -y -q prometheus || { apt-get update -q && apt-get install -y -q prometheus; }; } \
        > /dev/null 2>&1 || echo "test.sh: could not install prometheus; its test will skip" >&2
fi
ruff check .
ruff format --check .
if [ "$#" -eq 0 ]; then
    set -- -m "not slow"
fi
exec python -m pytest -q "$@"
