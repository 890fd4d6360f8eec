"""Timing work that runs on a device.

CUDA kernels launch asynchronously: a host clock read around a forward measures the
launches, not the work, and the batch-wait window, `--measure-costs` and the `auto`
settings would all see launch time. Every timer of device work goes through here, which
waits for the device before reading the clock at both ends (on the CPU that is free).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

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
def device_timer(
    device: torch.device | str, clock: Callable[[], float] = time.perf_counter
) -> Iterator[Elapsed]:
    """Seconds the block's work took on `device`, set when the block ends (`clock`: the
    host clock read at both ends; tests give a fake one)."""
    elapsed = Elapsed()
    synchronize(device)
    start = clock()
    try:
        yield elapsed
    finally:
        synchronize(device)
        elapsed.seconds = clock() - start


T = TypeVar("T")


def timed_call(device: torch.device | str, fn: Callable[..., T], *args) -> tuple[T, float]:
    """`fn(*args)` and the seconds it took on `device` (for work run on another thread
    whose time its caller needs: a service's compute thread)."""
    with device_timer(device) as elapsed:
        result = fn(*args)
    return result, elapsed.seconds
