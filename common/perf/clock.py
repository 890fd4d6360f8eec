"""Timing work that runs on a device.

CUDA kernels launch asynchronously: a host clock read around a forward measures the
launches, not the work, and the batch-wait window, `--measure-costs` and the `auto`
settings would all see launch time. Every timer of device work goes through here, which
waits for the device before reading the clock at both ends (on the CPU that is free).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait until `device` has finished the work queued so far (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type not in ("cpu", "meta"):  # other accelerators queue work too
        torch.accelerator.synchronize(device)


@dataclass
class Elapsed:
    seconds: float = 0.0


@contextlib.contextmanager
def device_timer(device: torch.device | str) -> Iterator[Elapsed]:
    """Seconds the block's work took on `device`, set when the block ends."""
    elapsed = Elapsed()
    synchronize(device)
    start = time.perf_counter()
    try:
        yield elapsed
    finally:
        synchronize(device)
        elapsed.seconds = time.perf_counter() - start
