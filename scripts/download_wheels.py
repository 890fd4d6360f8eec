#!/usr/bin/env python3
"""Download the wheels a machine without a package index needs to install SpecPipe
(`scripts/setup.sh --wheels DIR`), on a machine that has an index.

For a target Python version and platform (`pip download --python-version --platform
--only-binary=:all:`), it walks the project's requirements (its dependencies, the chosen
extras, UCX's build for the target's CUDA, and the build system's own), one package at a
time with `--no-deps`, reading each wheel's requirements for the target, and skips torch
(the target keeps its own: its requirements are never followed) and every package the
target already has in a version that satisfies the requirement (`--have`: a `pip freeze`
of the target, names alone for packages whose version is not known). What is downloaded
is what setup.sh installs there and nothing more; the total is checked against what may
travel with a working tree (the device tool carries 64 MiB per call, the tree included).

    scripts/download_wheels.py -d .whl --have scripts/gpu_image_packages.txt --cuda 13
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pip always carries it
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux_2_39_x86_64",
             "manylinux1_x86_64", "linux_x86_64")  # fmt: skip
ALWAYS_SKIPPED = ("torch",)  # the target's own build is kept (setup.sh pins it)
UCX_EXTRA = {"12": "ucx", "13": "ucx-cu13"}  # the target's CUDA major -> pyproject extra


@dataclass
class Target:
    python_version: str  # "3.12"
    platforms: list[str]
    have: dict[str, Version | None]  # canonical name -> version (None: present, unknown)
    skipped: set[str]
    env: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        env = default_environment()
        env.update(python_version=self.python_version, python_full_version=f"{self.python_version}.0",
                   sys_platform="linux", platform_system="Linux", os_name="posix",
                   platform_machine="x86_64", implementation_name="cpython",
                   platform_python_implementation="CPython")  # fmt: skip
        self.env = env

    def applies(self, req: Requirement, extras: set[str]) -> bool:
        if req.marker is None:
            return True
        return any(req.marker.evaluate({**self.env, "extra": e}) for e in extras or {""})

    def satisfied(self, req: Requirement, isolated: bool = False) -> bool:
        """Whether the target needs no wheel for `req` (`isolated`: a build requirement,
        which pip installs into an isolated build environment whatever the target has)."""
        name = canonicalize_name(req.name)
        if name in self.skipped:
            return True
        if isolated or name not in self.have:
            return False
        version = self.have[name]
        return version is None or req.specifier.contains(version, prereleases=True)


def read_have(path: Path | None) -> dict[str, Version | None]:
    """`name==version` lines (pip freeze), or a name alone: present, version unknown."""
    have: dict[str, Version | None] = {}
    if path is None:
        return have
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        have[canonicalize_name(name.strip())] = Version(version.strip()) if version else None
    return have


def project_requirements(
    extras: list[str], cuda: str | None
) -> tuple[list[Requirement], list[Requirement]]:
    """The project's requirements with `extras` and UCX's for `cuda`, and its build
    system's."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project, optional = meta["project"], meta["project"].get("optional-dependencies", {})
    chosen = list(extras)
    if cuda:
        major = cuda.split(".")[0]
        if major not in UCX_EXTRA:
            raise SystemExit(f"no UCX build for CUDA {cuda} (known: {', '.join(UCX_EXTRA)})")
        chosen.append(UCX_EXTRA[major])
    unknown = [e for e in chosen if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extras {unknown} (pyproject.toml has {sorted(optional)})")
    texts = [*project["dependencies"], *(r for e in chosen for r in optional[e])]
    return [Requirement(t) for t in texts], [
        Requirement(t) for t in meta["build-system"]["requires"]
    ]


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    return [Requirement(v) for k, v in re.findall(r"^(Requires-Dist): (.+)$", text, re.M)]


def wheel_of(folder: Path, name: str) -> Path | None:
    for w in folder.glob("*.whl"):
        if canonicalize_name(w.name.split("-")[0]) == name:
            return w
    return None


def download(req: Requirement, target: Target, folder: Path) -> Path:
    spec = f"{req.name}{req.specifier}"
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--only-binary=:all:", "--implementation", "cp",
           "--python-version", target.python_version, "-d", str(folder), spec]  # fmt: skip
    for p in target.platforms:
        cmd += ["--platform", p]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pip could not download {spec}:\n{proc.stderr.strip()[-2000:]}")
    wheel = wheel_of(folder, canonicalize_name(req.name))
    if wheel is None:
        raise SystemExit(f"pip downloaded no wheel of {spec}")
    return wheel


def resolve(
    reqs: list[Requirement], build: list[Requirement], target: Target, folder: Path
) -> dict[str, Path]:
    """Download every requirement the target lacks and theirs, one version of each, and
    the build system's requirements."""
    folder.mkdir(parents=True, exist_ok=True)
    got: dict[str, Path] = {}
    specs: dict[str, Requirement] = {}
    queue = [(r, {""}, True) for r in build] + [(r, {""}, False) for r in reqs]
    while queue:
        req, extras, isolated = queue.pop(0)
        if not target.applies(req, extras) or target.satisfied(req, isolated):
            continue
        name = canonicalize_name(req.name)
        if name in specs:  # seen: one version must satisfy every requirement of it
            merged = Requirement(f"{req.name}{specs[name].specifier & req.specifier}")
            version = Version(got[name].name.split("-")[1])
            if (
                merged.specifier.contains(version, prereleases=True)
                and req.extras <= specs[name].extras
            ):
                continue
            got.pop(name).unlink()
            req = Requirement(
                f"{req.name}[{','.join(req.extras | specs[name].extras)}]{merged.specifier}"
            )
        specs[name] = req
        wheel = wheel_of(folder, name)
        if wheel is None or not req.specifier.contains(Version(wheel.name.split("-")[1]), True):
            if wheel is not None:
                wheel.unlink()
            wheel = download(req, target, folder)
        got[name] = wheel
        print(f"  {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB) for {req}")
        queue += [(r, req.extras | {""}, isolated) for r in wheel_requirements(wheel)]
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "-d", "--dest", type=Path, default=ROOT / ".whl", help="the folder (default .whl)"
    )
    p.add_argument("--python-version", default="3.12", help="the target's Python (default 3.12)")
    p.add_argument(
        "--platform", action="append", help="pip --platform tags (default: manylinux x86_64)"
    )
    p.add_argument("--cuda", default=None, help="the target torch's CUDA version (12.x or 13.x): "
                   "UCX's build for it; none: no UCX (the data plane then uses TCP)")  # fmt: skip
    p.add_argument("--extras", default="", help="comma-separated extras of pyproject.toml")
    p.add_argument("--have", type=Path, default=None,
                   help="what the target has: `pip freeze` lines, or names alone")  # fmt: skip
    p.add_argument("--skip", default="", help="more comma-separated packages never downloaded")
    p.add_argument("--limit-mib", type=float, default=56.0,
                   help="fail above this many MiB (default 56: 64 MiB travel, the tree included)")  # fmt: skip
    args = p.parse_args(argv)
    target = Target(
        args.python_version,
        args.platform or list(PLATFORMS),
        read_have(args.have),
        {canonicalize_name(n) for n in (*ALWAYS_SKIPPED, *args.skip.split(",")) if n},
    )
    extras = [e for e in args.extras.split(",") if e]
    print(f"wheels for Python {target.python_version} on {target.platforms[0]}... into {args.dest}")
    got = resolve(*project_requirements(extras, args.cuda), target, args.dest)
    stray = [w for w in args.dest.glob("*.whl") if w not in got.values()]
    for w in stray:  # from an earlier run for another target: two versions stop an install
        w.unlink()
    total = sum(w.stat().st_size for w in got.values()) / 2**20
    print(f"{len(got)} wheels, {total:.1f} MiB in {args.dest}")
    if total > args.limit_mib:
        print(f"more than {args.limit_mib} MiB: list what the target has (--have)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
