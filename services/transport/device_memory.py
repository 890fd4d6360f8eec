"""Whether a transport carries its device's memory as it is (docs/architecture.md,
"6. Control plane and data plane", "Device memory on the data plane").

One decision for every transport: TCP is a byte stream from host memory, so it never
does (`HOST_ONLY`); UCX does for a transport on a GPU when UCX's CUDA module
loads, CUDA is there, the UCX_TLS its process runs with enables `cuda_copy`
(without it UCX cannot tell device memory from host memory and would read a device
pointer as host memory), and frames are not authenticated (`--secure` tags are
computed over host memory). Where it does, payloads leave from the device and arrive
into a buffer on the receiver's device; otherwise they are staged through host memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
from dataclasses import dataclass

import torch

# UCX_TLS unless the environment sets it: TCP on the CPU; on a GPU also cuda_copy
# (device <-> wire) and cuda_ipc (GPU to GPU between processes of one host).
HOST_TLS = "tcp"
CUDA_TLS = "tcp,cuda_copy,cuda_ipc"
_CUDA_COPY = {"cuda", "cuda_copy", "all"}  # names (aliases) that enable cuda_copy


@dataclass(frozen=True)
class DeviceMemory:
    """Whether payloads on the transport's device are sent from where they are and
    received into a buffer there (no host staging), and why (or why not), as the
    service logs it."""

    carried: bool
    why: str


HOST_ONLY = DeviceMemory(False, "payloads are staged through host memory")


def tls_moves_cuda(tls: str) -> bool:
    """Whether a UCX_TLS value enables `cuda_copy`: named (or `cuda`, `all`), or not
    excluded by a `^` list."""
    text = tls.strip()
    names = {t.strip().lstrip("\\") for t in text.lstrip("^").split(",")}
    if text.startswith("^"):
        return not names & _CUDA_COPY
    return bool(names & _CUDA_COPY)


@functools.cache
def cuda_module_error() -> str | None:
    """Why UCX's CUDA transports cannot work here, None when they can: their module
    (`libuct_cuda`, in the libucx wheel's module directory or `UCX_MODULE_DIR`) must be
    on disk and load, with the CUDA libraries it was built against (a cu12 build on a
    CUDA 13 machine, or one without a driver, is on disk and does not load). Loaded the
    way UCX loads it, after UCX's own libraries; a failure is the loader's message."""
    dirs = [os.environ.get("UCX_MODULE_DIR", "")]
    with contextlib.suppress(ImportError):
        import libucx

        dirs.append(os.path.join(os.path.dirname(libucx.__file__), "lib", "ucx"))
        with contextlib.suppress(Exception):  # its own libraries (libucs...) first
            libucx.load_library()
    found = sorted(p for d in dirs if d for p in glob.glob(os.path.join(d, "libuct_cuda.so*")))
    if not found:
        return "this UCX has no CUDA module (libuct_cuda)"
    try:
        ctypes.CDLL(found[0])
    except OSError as e:
        return f"UCX's CUDA module does not load: {e}"
    return None


def cuda_module_loads() -> bool:
    return cuda_module_error() is None


def cuda_available() -> bool:
    return torch.cuda.is_available()


def default_tls(device: str) -> str:
    """UCX_TLS for a process whose UCX starts for a transport on `device` (unless the
    environment sets it): the CUDA transports only where they can work."""
    if torch.device(device).type == "cuda" and cuda_module_loads() and cuda_available():
        return CUDA_TLS
    return HOST_TLS


def ucx_device_memory(device: str, secure: bool, tls: str) -> DeviceMemory:
    """Whether a UCX transport on `device`, authenticating frames or not (`secure`),
    in a process whose UCX runs with `tls`, carries the device's memory as it is."""
    if torch.device(device).type == "cpu":
        return DeviceMemory(False, "payloads are in host memory")
    if secure:
        why = "--secure frames are authenticated in host memory"
    elif not cuda_module_loads():
        why = cuda_module_error() or "UCX's CUDA module does not load"
    elif not cuda_available():
        why = "CUDA is not available"
    elif not tls_moves_cuda(tls):
        why = f"UCX_TLS={tls} enables no cuda_copy"
    else:
        return DeviceMemory(True, f"{device} buffers go as they are (UCX_TLS={tls})")
    return DeviceMemory(False, f"{HOST_ONLY.why}: {why}")
