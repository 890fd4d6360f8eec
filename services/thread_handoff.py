"""How the event loop and a service's compute thread hand each other work, shared by a
stage's rounds (compute_round.py) and the draft's batches (draft_rounds.py).

Both directions cost a wake-up: the thread waiting on a condition, the loop on its
self-pipe. Each is paid once per batch, not once per item: `ThreadInbox.wake` tells the
thread once the loop's current callback is done (every part of a batch frame or a
control message is in the inbox first, so one round takes them all; told at each, the
thread took the first part alone: twice the forwards), and `HandOffs` wakes the loop
once per batch of results it has not looked at yet (a wake is a write to the loop's
self-pipe, a read and a turn of the loop), whose callback takes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ThreadInbox(threading.Condition):
    """The condition that guards a compute thread's waiting work; `wake` tells it."""

    def __init__(self) -> None:
        super().__init__()
        self._wake_pending = False  # a `_notify` is scheduled on the event loop

    def wake(self) -> None:
        """New work arrived: on the event loop, the thread is told once the loop's
        current callback is done; from another thread, at once."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # another thread
            self._notify()
            return
        if not self._wake_pending:
            self._wake_pending = True
            loop.call_soon(self._notify)

    def _notify(self) -> None:
        self._wake_pending = False
        with self:
            self.notify()


class HandOffs(Generic[T]):
    """What a compute thread hands the event loop, in order: each item put in a deque,
    and the loop woken (a `call_soon_threadsafe`) only where no wake is pending since the
    loop last found the deque empty. The wake's own callback calls `on_loop(item)` for
    every item there: no event to set and no task to resume per batch (a consumer that
    must await hands its items on to a task of its own)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_loop: Callable[[T], None]) -> None:
        self._loop = loop
        self._on_loop = on_loop
        self._items: deque[T] = deque()
        self._lock = threading.Lock()
        self._woken = False  # a wake is scheduled, or the loop has not found it empty since

    def put(self, item: T) -> None:
        """On the compute thread."""
        with self._lock:
            self._items.append(item)
            if self._woken:
                return
            self._woken = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        """On the event loop, woken: `on_loop` of every item there, in order; one that
        raises leaves the rest to a drain of their own, next turn."""
        while True:
            with self._lock:
                if not self._items:
                    self._woken = False
                    return
                item = self._items.popleft()
            try:
                self._on_loop(item)
            except BaseException:
                self._loop.call_soon(self._drain)
                raise
