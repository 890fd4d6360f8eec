#!/usr/bin/env bash
# Build the SpecPipe image (docker/Dockerfile) without the build reaching any network:
#  1. the wheelhouse .wheelhouse/: every package the image installs, made with this
#     machine's own pip (`pip wheel`: wheels as they are, sdists built here), torch pinned
#     to 2.13.0 (the CPU build here; a CUDA build with --torch-index), plus
#     requirements.txt; skipped when .wheelhouse/ was made from the same inputs;
#  2. the base image: --base IMAGE (default python:3.11-slim-bookworm, which must be
#     pullable or present), or --local-base: Debian bookworm made here with debootstrap
#     (python3, venv) and `docker import`ed as specpipe-base:bookworm (kept; made once);
#  3. `docker build` on that base, installing with `pip install --no-index`;
#  4. checks: `specpipe --help` and `specpipe models list` run in the image, as UID 10001,
#     and no model weights are inside.
#
#   scripts/build_image.sh --local-base                     # here: air-gapped style
#   scripts/build_image.sh --tag registry.example.com/specpipe:0.1.0
#   scripts/build_image.sh --tag registry.example.com/specpipe:0.1.0-cu128 \
#       --torch-index https://download.pytorch.org/whl/cu128 \
#       --torch-spec 'torch==2.13.0+cu128'                  # GPU nodes (docs/deploy.md)
#
# Options:
#   --tag NAME            image name (default specpipe:0.1.0)
#   --base IMAGE          base image (default python:3.11-slim-bookworm)
#   --local-base          make the base with debootstrap instead (needs root, a Debian mirror)
#   --rebuild-base        make the local base again even if specpipe-base:bookworm exists
#   --mirror URL          Debian mirror for debootstrap (default http://deb.debian.org/debian)
#   --extras LIST         specpipe extras to install (default ucx; "" for none)
#   --torch-index URL     index to take torch (and its dependencies) from; default: the
#                         machine's own pip configuration (here the local CPU build)
#   --torch-spec SPEC     torch requirement (default torch==2.13.0)
#   --refresh-wheels      make the wheelhouse again
#   --wheels-only         stop after the wheelhouse
#   --no-cache            docker build --no-cache (a cold build of the layers)
#   --no-check            skip the checks of step 4
# Environment: PYTHON (default .venv/bin/python, else python3): the pip that makes the
# wheelhouse; it must be Python 3.11 on linux x86_64 like the image's.
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=specpipe:0.1.0
BASE=python:3.11-slim-bookworm
LOCAL_BASE=0
REBUILD_BASE=0
LOCAL_BASE_TAG=specpipe-base:bookworm
MIRROR=http://deb.debian.org/debian
EXTRAS=ucx
TORCH_INDEX=""
TORCH_SPEC="torch==2.13.0"
REFRESH=0
WHEELS_ONLY=0
NO_CACHE=()
CHECK=1
while [ $# -gt 0 ]; do
    case "$1" in
        --tag) TAG="$2"; shift 2 ;;
        --base) BASE="$2"; shift 2 ;;
        --local-base) LOCAL_BASE=1; shift ;;
        --rebuild-base) LOCAL_BASE=1; REBUILD_BASE=1; shift ;;
        --mirror) MIRROR="$2"; shift 2 ;;
        --extras) EXTRAS="$2"; shift 2 ;;
        --torch-index) TORCH_INDEX="$2"; shift 2 ;;
        --torch-spec) TORCH_SPEC="$2"; shift 2 ;;
        --refresh-wheels) REFRESH=1; shift ;;
        --wheels-only) WHEELS_ONLY=1; shift ;;
        --no-cache) NO_CACHE=(--no-cache); shift ;;
        --no-check) CHECK=0; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "build_image.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
WH=.wheelhouse
export PIP_DISABLE_PIP_VERSION_CHECK=1
log() { echo "[build_image $(date +%H:%M:%S)] $*" >&2; }
T0=$(date +%s)

# -- 1. wheelhouse ---------------------------------------------------------------------------
# What the image installs: torch, the project's dependencies and extras (from
# pyproject.toml), dumb-init (PID 1); the build backend (setuptools, wheel) for building
# specpipe itself from source under `--no-index`.
reqs=$("$PYTHON" - "$TORCH_SPEC" "$EXTRAS" <<'EOF'
import re, sys, tomllib
torch_spec, extras = sys.argv[1], [e for e in sys.argv[2].split(",") if e]
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = [d for d in project["dependencies"] if re.split(r"[<>=!~ \[;]", d)[0] != "torch"]
for e in extras:
    deps += project["optional-dependencies"][e]
print("\n".join([torch_spec, *deps, "dumb-init==1.2.5.post1"]))
EOF
)
build_reqs=$("$PYTHON" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
stamp=$(printf '%s\n' "$reqs" "$build_reqs" "index=$TORCH_INDEX" \
    "$("$PYTHON" -c 'import platform, sys; print(sys.version_info[:2], platform.machine())')" \
    | sha256sum | cut -c1-16)
if [ "$REFRESH" = 1 ] || [ "$(cat "$WH/.stamp" 2>/dev/null)" != "$stamp" ]; then
    log "wheelhouse: making $WH with $("$PYTHON" -m pip --version | cut -d' ' -f1-2) ($TORCH_SPEC${TORCH_INDEX:+ from $TORCH_INDEX})"
    rm -rf "$WH.tmp" && mkdir -p "$WH.tmp"
    if [ -n "$TORCH_INDEX" ]; then
        # torch and its own dependencies (the CUDA libraries) from that index only, without
        # this machine's pip configuration (whose local CPU build would win otherwise).
        PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip wheel --quiet --wheel-dir "$WH.tmp" \
            --index-url "$TORCH_INDEX" "$TORCH_SPEC"
    fi
    printf '%s\n' "$reqs" >"$WH.tmp/requirements.txt"
    printf '%s\n' "$build_reqs" >"$WH.tmp/build-requirements.txt"
    "$PYTHON" -m pip wheel --quiet --wheel-dir "$WH.tmp" --find-links "$WH.tmp" \
        -r "$WH.tmp/requirements.txt" -r "$WH.tmp/build-requirements.txt"
    echo "$stamp" >"$WH.tmp/.stamp"
    rm -rf "$WH" && mv "$WH.tmp" "$WH"
    log "wheelhouse: $(ls "$WH"/*.whl | wc -l) wheels, $(du -sh "$WH" | cut -f1), $(( $(date +%s) - T0 )) s"
else
    log "wheelhouse: $WH is up to date ($(ls "$WH"/*.whl | wc -l) wheels, $(du -sh "$WH" | cut -f1))"
fi
if ! ls "$WH"/torch-* >/dev/null 2>&1; then
    echo "build_image.sh: no torch wheel in $WH" >&2
    exit 1
fi
log "wheelhouse torch: $(basename "$(ls "$WH"/torch-*)")"
[ "$WHEELS_ONLY" = 1 ] && exit 0

if ! docker info >/dev/null 2>&1; then
    echo "build_image.sh: no Docker engine answers (docker info failed); on these machines:" >&2
    echo "  dockerd --storage-driver vfs --iptables=false --ip6tables=false --bridge=none &" >&2
    exit 1
fi

# -- 2. base image ---------------------------------------------------------------------------
if [ "$LOCAL_BASE" = 1 ]; then
    BASE=$LOCAL_BASE_TAG
    if [ "$REBUILD_BASE" = 1 ] || ! docker image inspect "$BASE" >/dev/null 2>&1; then
        command -v debootstrap >/dev/null || { echo "build_image.sh: --local-base needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
        t=$(date +%s)
        root=$(mktemp -d /var/tmp/specpipe-base.XXXXXX)
        trap 'rm -rf "$root"' EXIT
        log "base: debootstrap bookworm into $root ($MIRROR)"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$root" "$MIRROR" >"$root.log" 2>&1 \
            || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
        rm -f "$root.log"
        chmod 0755 "$root"  # mktemp made it 0700: it becomes the image's /
        # Package lists, caches, docs and locales are not needed in a runtime image.
        rm -rf "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
            "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/usr/share/info/*
        tar -C "$root" --numeric-owner -c . | docker import \
            --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' \
            --message "debootstrap --variant=minbase bookworm + python3, python3-venv" \
            - "$BASE" >/dev/null
        rm -rf "$root"
        trap - EXIT
        log "base: $BASE made in $(( $(date +%s) - t )) s ($(docker image inspect -f '{{.Size}}' "$BASE" | numfmt --to=si)B)"
    else
        log "base: $BASE exists (--rebuild-base makes it again)"
    fi
elif ! docker image inspect "$BASE" >/dev/null 2>&1; then
    log "base: pulling $BASE"
    docker pull "$BASE" || { echo "build_image.sh: cannot pull $BASE; use --local-base or --base IMAGE" >&2; exit 1; }
fi

# -- 3. build ---------------------------------------------------------------------------------
t=$(date +%s)
log "build: $TAG on $BASE (extras: ${EXTRAS:-none})"
docker build "${NO_CACHE[@]}" -f docker/Dockerfile -t "$TAG" \
    --build-arg "BASE_IMAGE=$BASE" --build-arg "EXTRAS=$EXTRAS" \
    --build-arg "TORCH_VERSION=$(echo "$TORCH_SPEC" | sed 's/^torch==//; s/+.*//')" . >&2
BUILD_S=$(( $(date +%s) - t ))
SIZE=$(docker image inspect -f '{{.Size}}' "$TAG")
log "build: $TAG in $BUILD_S s, $(numfmt --to=si "$SIZE")B ($SIZE bytes)"

# -- 4. checks --------------------------------------------------------------------------------
if [ "$CHECK" = 1 ]; then
    # Two containers only: with the vfs storage driver each one copies the whole image.
    user=$(docker image inspect -f '{{.Config.User}}' "$TAG")
    [ "$user" = 10001:10001 ] || { echo "build_image.sh: the image runs as $user, not 10001:10001" >&2; exit 1; }
    # As the pods run it: its user, read-only, /tmp a volume, through the entrypoint.
    docker run --rm --network none --read-only --tmpfs /tmp -e HOME=/tmp "$TAG" models list >&2
    weights=$(docker run --rm --network none --user 0 --entrypoint /bin/sh "$TAG" -c \
        'specpipe --help >/dev/null && find / -xdev \( -name "*.safetensors" -o -name "*.gguf" -o -name "pytorch_model*.bin" \) -print')
    [ -z "$weights" ] || { echo "build_image.sh: model weights in the image: $weights" >&2; exit 1; }
    log "checks: specpipe --help and models list run; UID 10001; no weights inside"
fi
log "done: $TAG in $(( $(date +%s) - T0 )) s in all"
echo "$TAG"
