#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv and install the project.
#   scripts/setup.sh                      # development machines and CI (a package index)
#   scripts/setup.sh --wheels DIR         # no index: only DIR's wheels (scripts/download_wheels.py)
#   scripts/setup.sh --extras dev,bench   # the extras (default dev,bench; UCX's is added)
# torch: a torch the Python already has is kept, never replaced: the venv sees that
# Python's packages (--system-site-packages, and its own site-packages where it is itself
# a venv, as on the GPU image), and torch is pinned to it while the rest installs, so
# only what is missing or too old is installed. Without one: torch==2.13.0 (on the
# development machines a CPU build on local disk; an unpinned torch pulls a CUDA build).
# UCX: the build for the CUDA torch reports (12.x: the `ucx` extra, 13.x: `ucx-cu13`; a
# CPU build: `ucx`, which runs over TCP); SPECPIPE_UCX_EXTRA overrides (empty: none).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS=""
EXTRAS="dev,bench"
while [ "$#" -gt 0 ]; do
    case "$1" in
        --wheels)
            [ -d "${2:-}" ] || { echo "setup.sh: --wheels needs a folder of wheels" >&2; exit 2; }
            WHEELS=$(cd "$2" && pwd)
            shift 2
            ;;
        --extras) EXTRAS="${2-}"; shift 2 ;;
        -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
make_venv() { # with pip where the Python can give it one, else the base's pip serves
    "$PYTHON" -m venv "$@" .venv 2> /dev/null || { rm -rf .venv && "$PYTHON" -m venv --without-pip "$@" .venv; }
}
if [ ! -x .venv/bin/python ]; then
    if "$PYTHON" -c "import torch" 2> /dev/null; then
        make_venv --system-site-packages
        # A Python that is itself a venv: its packages are not the "system" ones of the
        # new venv (those are its base's), so they are put on the path explicitly.
        "$PYTHON" -c "import site; print('\n'.join(site.getsitepackages()))" \
            > "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/00_system_python.pth"
    else
        make_venv
    fi
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
PIP=(python -m pip install --quiet)
if [ -n "$WHEELS" ]; then
    PIP+=(--no-index --find-links "$WHEELS")
else
    "${PIP[@]}" --upgrade pip
fi
python -c "import torch" 2> /dev/null || "${PIP[@]}" "torch==2.13.0"
TORCH=$(python -c "import importlib.metadata as m; print(m.version('torch'))")
CUDA=$(python -c "import torch; print(torch.version.cuda or '')")
case "${CUDA%%.*}" in
    "" | 12) UCX=ucx ;;
    13) UCX=ucx-cu13 ;;
    *) UCX="" && echo "setup.sh: no UCX build for CUDA $CUDA; the data plane uses TCP" >&2 ;;
esac
UCX=${SPECPIPE_UCX_EXTRA-$UCX}
if [ -n "$WHEELS" ] && [ -n "$UCX" ]; then # a folder without UCX's wheels: TCP only
    UCX_WHEEL=ucxx_cu12 && [ "$UCX" = ucx-cu13 ] && UCX_WHEEL=ucxx_cu13
    compgen -G "$WHEELS/$UCX_WHEEL-*.whl" > /dev/null \
        || { echo "setup.sh: no $UCX_WHEEL wheel in $WHEELS: no UCX (TCP data plane)" >&2 && UCX=""; }
fi
EXTRAS=$(echo "$EXTRAS,$UCX" | sed -e 's/^,*//' -e 's/,*$//' -e 's/,,*/,/g')
echo "setup.sh: torch $TORCH (CUDA ${CUDA:-none}) kept; installing .${EXTRAS:+[$EXTRAS]}${WHEELS:+ from $WHEELS}"
# torch pinned to the one there: what needs another fails here instead of replacing it
"${PIP[@]}" -e ".${EXTRAS:+[$EXTRAS]}" "torch==$TORCH"
