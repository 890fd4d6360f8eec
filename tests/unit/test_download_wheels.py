"""scripts/download_wheels.py chooses exactly the wheels a target lacks: the project's
requirements for the target's Python and platform, followed through each wheel's own,
never torch (nor what only torch needs), nothing the target has in a version that
satisfies the requirement, and always the build system's (pip builds in isolation).
`pip download` is replaced by a folder of tiny wheels: nothing is fetched."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from .test_setup import make_wheel, module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dw():
    spec = importlib.util.spec_from_file_location(
        "download_wheels", ROOT / "scripts" / "download_wheels.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["download_wheels"] = mod  # its dataclasses look themselves up there
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules["download_wheels"]


def test_only_what_the_target_lacks_is_downloaded(dw, tmp_path, monkeypatch) -> None:
    index = tmp_path / "index"
    index.mkdir()
    make_wheel(index, "app-dep", "2.0", module("app_dep", "2.0"),
               requires=("sub-dep>=1", "winonly; sys_platform == 'win32'",
                         "py313only; python_version >= '3.13'"))  # fmt: skip
    make_wheel(index, "sub-dep", "1.2", module("sub_dep", "1.2"))
    make_wheel(index, "old-there", "3.0", module("old_there", "3.0"))
    make_wheel(index, "setuptools", "80.0", module("setuptools", "80.0"))
    asked: list[str] = []

    def download(req, target, folder):
        asked.append(str(req))
        name = dw.canonicalize_name(req.name)
        wheel = dw.wheel_of(index, name)
        assert wheel is not None, f"asked for {req}"
        return Path(shutil.copy(wheel, folder))

    monkeypatch.setattr(dw, "download", download)
    have = tmp_path / "have.txt"
    have.write_text(
        "# the target's\nold-there==1.0\nfine-there==5.1\nunknown-version\nsetuptools==70\n"
    )
    target = dw.Target("3.12", ["manylinux_2_28_x86_64"], dw.read_have(have), {"torch"})
    reqs = [dw.Requirement(r) for r in ("torch>=2.9", "app-dep>=1", "old-there>=2",
                                        "fine-there>=5", "unknown-version>=9")]  # fmt: skip
    build = [dw.Requirement("setuptools>=77")]
    got = dw.resolve(reqs, build, target, tmp_path / "out")
    assert sorted(got) == ["app-dep", "old-there", "setuptools", "sub-dep"]
    assert "torch" not in " ".join(asked)
    assert not any("winonly" in a or "py313only" in a for a in asked)  # markers for 3.12 linux


def test_a_requirement_seen_twice_gets_one_version_for_both(dw, tmp_path, monkeypatch) -> None:
    versions = {"lib": ["1.0", "1.5"]}
    index = tmp_path / "index"
    index.mkdir()

    def download(req, target, folder):
        ok = [v for v in versions["lib"] if req.specifier.contains(v)]
        return make_wheel(folder, "lib", ok[-1], module("lib", ok[-1]))

    monkeypatch.setattr(dw, "download", download)
    target = dw.Target("3.12", ["manylinux_2_28_x86_64"], {}, set())
    reqs = [dw.Requirement("lib<1.2"), dw.Requirement("lib>=0.5")]
    got = dw.resolve(reqs, [], target, tmp_path / "out")
    assert got["lib"].name.startswith("lib-1.0-")
    assert [w.name for w in (tmp_path / "out").glob("*.whl")] == [got["lib"].name]
