#!/usr/bin/env bash
# The SpecPipe services in Docker containers, end to end (slow: not part of .ci/run):
#  - starts a Docker engine if none answers (as these machines run one: vfs storage, host
#    networking only) and stops it again at the end;
#  - builds the image with scripts/build_image.sh --local-base (unless --no-build);
#  - runs scripts/container_e2e.py: the router, the draft and every stage each in its own
#    container, with the Helm chart's own command lines, on a tiny model the script makes
#    in a volume mounted at /models; checks the tokens from the host against the
#    in-process engine, a graceful drain on `docker stop`, and clean exits;
#  - removes every container it started (label specpipe-e2e=<run id>) and its scratch
#    directory, whatever happened. The image is kept (--remove-image removes it too).
# Prints the report (JSON) with the start-to-ready time per service, the image's size,
# the build time and the whole run time. Needs root (dockerd) and the project's .venv.
#
#   scripts/container_e2e.sh [--image specpipe:e2e] [--no-build] [--stages 2]
#                            [--remove-image] [--keep-dockerd] [-- build_image.sh options]
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=specpipe:e2e
BUILD=1
STAGES=2
REMOVE_IMAGE=0
KEEP_DOCKERD=0
BUILD_OPTS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --image) IMAGE="$2"; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        --stages) STAGES="$2"; shift 2 ;;
        --remove-image) REMOVE_IMAGE=1; shift ;;
        --keep-dockerd) KEEP_DOCKERD=1; shift ;;
        --) shift; BUILD_OPTS=("$@"); break ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "container_e2e.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || { echo "container_e2e.sh: no $PYTHON (run scripts/setup.sh)" >&2; exit 1; }
log() { echo "[container_e2e $(date +%H:%M:%S)] $*" >&2; }
T0=$(date +%s)
RUN_ID="$(date +%s)-$$"
WORK=$(mktemp -d /var/tmp/specpipe-e2e.XXXXXX)
DOCKERD_PID=""

cleanup() {
    local rc=$?
    set +e
    ids=$(docker ps -aq --filter "label=specpipe-e2e=$RUN_ID" 2>/dev/null)
    if [ -n "$ids" ]; then
        log "removing containers: $(echo $ids)"
        docker rm -f -v $ids >/dev/null  # -v: any anonymous volume of the image's VOLUME
    fi
    rm -rf "$WORK"
    if [ "$REMOVE_IMAGE" = 1 ]; then
        docker rmi "$IMAGE" >/dev/null 2>&1 && log "removed image $IMAGE"
    fi
    if [ -n "$DOCKERD_PID" ] && [ "$KEEP_DOCKERD" = 0 ]; then
        log "stopping the dockerd this script started (pid $DOCKERD_PID)"
        kill "$DOCKERD_PID"
        for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
    fi
    log "exit $rc after $(( $(date +%s) - T0 )) s"
    exit $rc
}
trap cleanup EXIT INT TERM

# -- a Docker engine ----------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || { echo "container_e2e.sh: no Docker engine and no dockerd (apt-get install docker.io)" >&2; exit 1; }
    log "starting dockerd (vfs storage, no iptables, no bridge: host networking only)"
    dockerd --storage-driver vfs --iptables=false --ip6tables=false --bridge=none \
        >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
    docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log" >&2; exit 1; }
fi

# -- the image ------------------------------------------------------------------------------------
BUILD_S=""
if [ "$BUILD" = 1 ]; then
    t=$(date +%s)
    scripts/build_image.sh --local-base --tag "$IMAGE" "${BUILD_OPTS[@]}" >/dev/null
    BUILD_S=$(( $(date +%s) - t ))
fi
docker image inspect "$IMAGE" >/dev/null 2>&1 || { echo "container_e2e.sh: no image $IMAGE (drop --no-build)" >&2; exit 1; }
SIZE=$(docker image inspect -f '{{.Size}}' "$IMAGE")

# -- the deployment -------------------------------------------------------------------------------
set +e
"$PYTHON" scripts/container_e2e.py --image "$IMAGE" --stages "$STAGES" \
    --work "$WORK" --run-id "$RUN_ID" >"$WORK/report.json"
RC=$?
set -e
"$PYTHON" - "$WORK/report.json" "$SIZE" "$BUILD_S" "$T0" <<'EOF'
import json, sys, time
path, size, build, t0 = sys.argv[1:]
try:
    report = json.load(open(path))
except ValueError:
    report = {"result": "FAILED (no report: see the log above)"}
report["image_bytes"] = int(size)
report["build_seconds"] = int(build) if build else None
report["total_seconds"] = round(time.time() - float(t0))
print(json.dumps(report, indent=1))
EOF
exit $RC
