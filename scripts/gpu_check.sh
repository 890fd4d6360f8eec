#!/usr/bin/env bash
# The device check: does SpecPipe work on this machine's GPU, and how fast is a stage step?
# Offline once installed (scripts/setup.sh, or the project installed into any env with
# torch built for the machine's CUDA). Prints PASS/FAIL/SKIP per part; exit 1 on any FAIL.
#   scripts/gpu_check.sh                 # --device cuda
#   scripts/gpu_check.sh --device cpu    # the same parts on the CPU, small shapes (CI runs it)
# Extra arguments go to `specpipe selfcheck` (--parts, --timing-shape, --context, --json).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
case " $* " in
    *" --device "*) ;;
    *) set -- --device cuda "$@" ;;
esac
exec timeout 480 "$PY" -m specpipe.cli selfcheck "$@"
