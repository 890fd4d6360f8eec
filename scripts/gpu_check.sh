#!/usr/bin/env bash
# The one-call device check: from a fresh copy of the working tree (and a carried folder of
# wheels), install what the machine lacks without touching its torch, then check and time
# SpecPipe on its GPU within 8 minutes, each part in a process of its own with a time limit
# (`specpipe selfcheck`: the parts, what they measure). A compact summary on stdout; the
# full results in $OUT/gpu_check.json and the log in $OUT/gpu_check.log ($OUT: the device
# tool's output folder, else GPU_CHECK_OUT, else the current folder). Exit 1 on any FAIL.
#   scripts/gpu_check.sh --wheels .whl        # a GPU machine without an index (docs/deploy.md)
#   scripts/gpu_check.sh                      # installed already (.venv or the Python on PATH)
#   scripts/gpu_check.sh --device cpu         # every part on the CPU, tiny shapes (CI runs it)
# Other arguments go to `specpipe selfcheck` (--parts, --timing-shape, --context).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-${GPU_CHECK_OUT:-.}}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
WHEELS=""
DEVICE=cuda
PASS=()
while [ "$#" -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS=${2:?--wheels needs a folder}; shift 2 ;;
        --device) DEVICE=${2:?--device needs a value}; shift 2 ;;
        *) PASS+=("$1"); shift ;;
    esac
done
: > "$LOG"
START=$(date +%s)
if [ -n "$WHEELS" ]; then
    # The image's Python (the one with torch), a venv that sees it, only the missing wheels.
    if ! scripts/setup.sh --wheels "$WHEELS" --extras "" >> "$LOG" 2>&1; then
        tail -20 "$LOG"
        echo "gpu_check: setup from $WHEELS failed (the log: $LOG)" >&2
        exit 1
    fi
    echo "gpu_check: set up from $WHEELS in $(($(date +%s) - START)) s: $(grep 'kept;' "$LOG" | tail -1)"
fi
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
export PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n
set +e
# On a GPU 8 minutes in all, the setup's time included (a device call may run 10); the
# CPU's dry run has no deadline (a shared machine's time says little), parts 4 minutes.
LIMITS=(--part-timeout 240)
[ "$DEVICE" = cpu ] || LIMITS+=(--deadline "$((480 - ($(date +%s) - START)))")
"$PY" -m specpipe.cli selfcheck --device "$DEVICE" "${LIMITS[@]}" \
    --json "$OUT_DIR/gpu_check.json" "${PASS[@]}" 2>> "$LOG" | tee -a "$LOG"
CODE=${PIPESTATUS[0]}
set -e
echo "gpu_check: $(($(date +%s) - START)) s in all; results in $OUT_DIR/gpu_check.json"
exit "$CODE"
