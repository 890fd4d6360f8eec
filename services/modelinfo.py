"""What a service reports about the device it runs on: free memory, and the device a
`--device` value names."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def free_memory_bytes(device: torch.device | str) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# Share of the device's free memory (after the weights are loaded) a stage or the draft
# gives its KV caches when no --max-cache-gib is given.
DEFAULT_CACHE_FRACTION = 0.8


def cache_budget(device: torch.device | str, fraction: float = DEFAULT_CACHE_FRACTION) -> int:
    """KV cache bytes a service may hold: `fraction` of its device's free memory now."""
    if not 0 < fraction <= 1:
        raise ValueError(f"the cache fraction must be in (0, 1], got {fraction}")
    return int(free_memory_bytes(device) * fraction)


def resolve_device(spec: str) -> str:
    """The torch device a service runs on: `cpu`, `cuda`, `cuda:N`, or `auto` (cuda when
    available, else cpu). Raises ValueError with a one-line reason for anything else, or
    for CUDA on a machine without it (better at start-up than at the first request)."""
    text = spec.strip().lower()
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return "cpu"
    kind, colon, index = text.partition(":")
    if kind != "cuda" or (colon and not index.isdigit()):
        raise ValueError(f"unknown device {spec!r} (choose cpu, cuda, cuda:N or auto)")
    if not torch.cuda.is_available():
        why = "torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"device {spec!r} needs CUDA, and {why} here (use --device cpu or auto)")
    if colon and int(index) >= torch.cuda.device_count():
        raise ValueError(f"device {spec!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return text
