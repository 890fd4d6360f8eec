"""scripts/setup.sh on a machine like the GPU image: a Python that has its own torch (a
venv of its own, as /opt/torch/.venv there) and no package index, only a folder of
wheels. The venv it makes sees that torch and keeps it (a newer torch in the folder is
not taken), installs only what is missing or too old, from the folder alone, and takes
UCX's build for the CUDA version the torch reports.

The project here is a stand-in with setup.sh's own copy: tiny wheels written by hand
and an in-tree build backend, so nothing is downloaded or built (a few seconds).
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BACKEND = '''
"""A PEP 517 backend for the stand-in project: an editable wheel of a .pth."""
import base64, hashlib, os, zipfile

NAME, VERSION = "standin", "0.1"


def _requires():
    import tomllib
    with open("pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    lines = [f"Requires-Dist: {r}" for r in project["dependencies"]]
    for extra, reqs in project["optional-dependencies"].items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {r}; extra == "{extra}"' for r in reqs]
    return lines


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = f"{NAME}-{VERSION}-py3-none-any.whl"
    info = f"{NAME}-{VERSION}.dist-info"
    files = {
        f"{NAME}.pth": os.getcwd() + "\\n",
        f"{info}/METADATA": "\\n".join(["Metadata-Version: 2.1", f"Name: {NAME}",
                                        f"Version: {VERSION}", *_requires()]) + "\\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\\nGenerator: standin\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
    }
    record = []
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as z:
        for path, text in files.items():
            data = text.encode()
            z.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{path},sha256={digest},{len(data)}")
        z.writestr(f"{info}/RECORD", "\\n".join([*record, f"{info}/RECORD,,"]) + "\\n")
    return name
'''


def make_wheel(folder: Path, name: str, version: str, files: dict[str, str],
               requires: tuple[str, ...] = ()) -> Path:  # fmt: skip
    """A pure-Python wheel, written as pip reads one."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    files = {
        **files,
        f"{info}/METADATA": "\n".join([*meta, *(f"Requires-Dist: {r}" for r in requires)]) + "\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(path, "w") as z:
        for name_in, text in files.items():
            data = text.encode()
            z.writestr(name_in, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{name_in},sha256={digest.decode()},{len(data)}")
        z.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return path


def module(name: str, version: str, **attrs: str) -> dict[str, str]:
    body = f"__version__ = {version!r}\n" + "".join(f"{k} = {v!r}\n" for k, v in attrs.items())
    return {f"{name}/__init__.py": body}


def site_packages(env: Path) -> Path:
    return next((env / "lib").glob("python3*/site-packages"))


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    """The GPU image's Python: a venv of its own holding torch 2.11 built for CUDA 13,
    an up-to-date package and an old one."""
    root = tmp_path_factory.mktemp("image")
    venv.EnvBuilder(with_pip=False).create(root / "venv")
    wheels = root / "preinstalled"
    wheels.mkdir()
    torch_files = module("torch", "2.11.0+cu130")
    torch_files["torch/version.py"] = "cuda = '13.0'\n"
    torch_files["torch/__init__.py"] += "from . import version\n"
    for wheel in (
        make_wheel(wheels, "torch", "2.11.0+cu130", torch_files),
        make_wheel(wheels, "present", "1.5", module("present", "1.5")),
        make_wheel(wheels, "olddep", "1.0", module("olddep", "1.0")),
    ):
        with zipfile.ZipFile(wheel) as z:  # installed as pip would, without pip
            z.extractall(site_packages(root / "venv"))
    return root / "venv" / "bin" / "python"


def standin_project(tmp: Path) -> Path:
    project = tmp / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", project / "scripts" / "setup.sh")
    (project / "_backend").mkdir()
    (project / "_backend" / "standin_backend.py").write_text(BACKEND)
    (project / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [build-system]
            requires = []
            build-backend = "standin_backend"
            backend-path = ["_backend"]

            [project]
            name = "standin"
            version = "0.1"
            dependencies = ["torch>=2.9", "present>=1.0", "olddep>=2.0", "newdep>=1.0"]

            [project.optional-dependencies]
            ucx = ["ucxx-cu12>=0.52"]
            ucx-cu13 = ["ucxx-cu13>=0.52"]
            dev = ["devtool>=1.0"]
            bench = []
            """
        )
    )
    return project


def folder_of_wheels(tmp: Path) -> Path:
    wheels = tmp / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "torch", "2.12.0", module("torch", "2.12.0"))  # must not be taken
    make_wheel(wheels, "present", "1.6", module("present", "1.6"))  # newer, not needed
    make_wheel(wheels, "olddep", "2.1", module("olddep", "2.1"))
    make_wheel(wheels, "newdep", "1.0", module("newdep", "1.0"), requires=("present>=1.0",))
    make_wheel(wheels, "devtool", "1.0", module("devtool", "1.0"))
    make_wheel(wheels, "ucxx-cu12", "0.52.0", module("ucxx_cu12", "0.52.0"))
    make_wheel(wheels, "ucxx-cu13", "0.52.0", module("ucxx_cu13", "0.52.0"))
    return wheels


def run_setup(project: Path, python: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    clean.update(
        PYTHON=str(python),
        PIP_INDEX_URL="http://127.0.0.1:9/no-index-here",  # any index use would fail
        PIP_CONFIG_FILE=os.devnull,
        **env,
    )
    return subprocess.run(
        ["bash", "scripts/setup.sh", *args], cwd=project, env=clean,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def in_venv(project: Path, code: str) -> str:
    python = project / ".venv" / "bin" / "python"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="setup.sh is a bash script")


@pytest.fixture(scope="module")
def installed(image, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("setup")
    project = standin_project(tmp)
    return project, run_setup(project, image, "--wheels", str(folder_of_wheels(tmp)))


def test_setup_keeps_the_images_torch_and_installs_only_what_is_missing(image, installed) -> None:
    project, proc = installed
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch 2.11.0+cu130 (CUDA 13.0) kept" in proc.stdout
    image_site = str(site_packages(image.parents[1]))
    own_site = str(site_packages(project / ".venv"))
    got = in_venv(
        project,
        "import torch, present, olddep, newdep, devtool, ucxx_cu13, importlib.util as u; "
        "print(torch.__version__, torch.__file__, present.__version__, present.__file__, "
        "olddep.__version__, olddep.__file__, newdep.__file__, "
        "u.find_spec('ucxx_cu12') is None)",
    ).split()
    torch_version, torch_file, present_v, present_file, old_v, old_file, new_file, no_cu12 = got
    # the image's torch, not the newer one in the folder; what was there stays there
    assert torch_version == "2.11.0+cu130" and torch_file.startswith(image_site)
    assert present_v == "1.5" and present_file.startswith(image_site)
    # too old or missing: installed into the venv from the folder
    assert old_v == "2.1" and old_file.startswith(own_site) and new_file.startswith(own_site)
    assert no_cu12 == "True"  # UCX's build for CUDA 13 only
    assert not list(Path(own_site).glob("torch*"))


def test_setup_without_the_ucx_wheels_goes_on_without_ucx(image, installed, tmp_path) -> None:
    project, _ = installed
    wheels = folder_of_wheels(tmp_path)
    for w in wheels.glob("ucxx*"):
        w.unlink()
    proc = run_setup(project, image, "--wheels", str(wheels), "--extras", "")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no ucxx_cu13 wheel" in proc.stderr and "installing . from" in proc.stdout
    bad = run_setup(project, image, "--wheels", str(tmp_path / "nowhere"))
    assert bad.returncode == 2 and "--wheels needs a folder" in bad.stderr
