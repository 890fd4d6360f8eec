"""The chart's install notes on GPU buffers over UCX say what the services decide
(services/transport/device_memory.py): staged through host memory with authenticated
frames, or with a UCX_TLS that enables no cuda_copy; nothing said otherwise."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from specpipe.services.transport.device_memory import tls_moves_cuda

from .conftest import CHART

STAGED = "copied through host memory"


def _notes(helm, tmp_path, values: dict) -> str:
    """The notes `helm install` prints for a GPU deployment over UCX with `values`."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"transport": "ucx", "gpu": {"enabled": True}, **values}))
    cmd = [str(helm), "install", "specpipe", str(CHART), "--dry-run=client", "-f", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout
    return out[out.index("NOTES:") :]


@pytest.mark.parametrize(
    "tls",
    ["", "rc,tcp", "rc,cuda_copy", "cuda,tcp", "all", "^cuda_ipc", "^cuda_copy", "rc,cuda_ipc"],
)
def test_the_notes_say_when_gpu_buffers_are_staged_as_the_services_decide(
    helm, tmp_path, tls
) -> None:
    values: dict = {"security": {"enabled": False}}
    if tls:
        values["ucxEnv"] = [{"name": "UCX_TLS", "value": tls}]
    staged = bool(tls) and not tls_moves_cuda(tls)  # unset: the GPU default moves CUDA memory
    assert (STAGED in _notes(helm, tmp_path, values)) is staged, tls


def test_the_notes_say_authenticated_frames_are_staged(helm, tmp_path) -> None:
    assert "authenticated (security.enabled)" in _notes(helm, tmp_path, {})
