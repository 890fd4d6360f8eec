"""Timing work that runs on a device, without stalling the device's queue while serving.

CUDA kernels launch asynchronously: a host clock read around a forward measures the
launches, not the work. Every timer of device work goes through here, in one of two ways:

- *measuring costs* (`measuring_costs()`: `--measure-costs`, the auto settings, the
  emulated devices' pacer, `specpipe selfcheck`): the device is synchronized at both ends,
  so the time is exactly the block's work (nothing else is queued then);
- *serving* (everything else): no synchronization, so the host prepares the next step
  while the device runs this one. On CUDA two events on the current stream bracket the
  block, and `Elapsed.seconds` is their time once the device has passed the second one
  (None before: the reader never waits; the compute round reads it after the step's
  outputs were handed to the transport, which waited for them anyway). On the CPU the
  work is synchronous and the host clock is exact.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

_MEASURING = contextvars.ContextVar("specpipe_measuring_costs", default=False)


def synchronize(device: torch.device | str) -> None:
    """Wait until `device` has finished the work queued so far (a no-op on the CPU)."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type not in ("cpu", "meta"):  # other accelerators queue work too
        torch.accelerator.synchronize(device)


@contextlib.contextmanager
def measuring_costs() -> Iterator[None]:
    """Timers in this block (on this thread) synchronize the device at both ends: costs
    are being measured, not requests served."""
    token = _MEASURING.set(True)
    try:
        yield
    finally:
        _MEASURING.reset(token)


def is_measuring_costs() -> bool:
    return _MEASURING.get()


class Elapsed:
    """Seconds a block's work took on its device, set when the block ends; for CUDA work
    timed while serving, the time of the block's two events once the device has passed
    the second (before that, the host's time of the block: never a wait)."""

    def __init__(self, seconds: float = 0.0) -> None:
        self._seconds = seconds
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    @property
    def seconds(self) -> float:
        if self._events is not None and self._events[1].query():  # past the block's end
            start, end = self._events
            self._seconds, self._events = start.elapsed_time(end) / 1e3, None
        return self._seconds

    @seconds.setter
    def seconds(self, value: float) -> None:
        self._seconds, self._events = value, None


@contextlib.contextmanager
def device_timer(
    device: torch.device | str, clock: Callable[[], float] = time.perf_counter
) -> Iterator[Elapsed]:
    """Seconds the block's work took on `device` (`clock`: the host clock; tests give a
    fake one). Synchronizes only while measuring costs (module docstring)."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    elapsed = Elapsed()
    if is_measuring_costs():
        synchronize(device)  # a no-op on the CPU
        start = clock()
        try:
            yield elapsed
        finally:
            synchronize(device)
            elapsed.seconds = clock() - start
        return
    events = None
    if device.type == "cuda":
        events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        events[0].record(torch.cuda.current_stream(device))
    start = clock()
    try:
        yield elapsed
    finally:
        elapsed.seconds = clock() - start
        if events is not None:
            events[1].record(torch.cuda.current_stream(device))
            elapsed._events = events


T = TypeVar("T")


def timed_call(device: torch.device | str, fn: Callable[..., T], *args) -> tuple[T, float]:
    """`fn(*args)` and the seconds it took on `device` (for work run on another thread
    whose time its caller needs: a service's compute thread)."""
    with device_timer(device) as elapsed:
        result = fn(*args)
    return result, elapsed.seconds
