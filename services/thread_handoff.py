"""How the event loop and a service's compute thread hand each other work, shared by a
stage's rounds (compute_round.py) and the draft's batches (draft_rounds.py).

Both directions cost a wake-up: the thread waiting on a condition, the loop on its
self-pipe. Each is paid once per batch, not once per item: `ThreadInbox.wake` tells the
thread once the loop's current callback is done (every part of a batch frame or a
control message is in the inbox first, so one round takes them all; told at each, the
thread took the first part alone: twice the forwards; where the transport says when a
read's frames are all delivered, `gathering`, at that end), and `HandOffs` wakes the loop
once per batch of results it has not looked at yet (a wake is a write to the loop's
self-pipe, a read and a turn of the loop). Where a thread can act on a batch itself
(send its frames), it does so only while `HandOffs.settled`: every batch it handed the
loop before has been delivered. That orders the hand-offs, not the wire: a delivered
batch's frames may still wait for the loop to send them (a `call_soon` flush, a
background send), so what the thread sends now can reach the peer before them. Nothing
may rely on the wire order of different batches' frames: the router, for one, matches
the draft's replies by call_id, in whatever order they come.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class ThreadInbox(threading.Condition):
    """The condition that guards a compute thread's waiting work; `wake` tells it."""

    def __init__(self) -> None:
        super().__init__()
        self._wake_pending = False  # a `_notify` is scheduled on the event loop
        self._gathering = 0  # inside `gathering` (on the event loop): wakes wait for its end
        self._gathered = False  # a wake came while gathering
        self.gathering = _Gathering(self)
        # the running loop `wake` last found, and its thread: known again by the thread's
        # id (`asyncio.get_running_loop` is a getpid syscall per call on Python 3.11)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0

    def wake(self) -> None:
        """New work arrived: on the event loop, the thread is told once the loop's
        current callback is done; from another thread, at once."""
        loop = self._loop
        if loop is None or self._loop_thread != threading.get_ident() or not loop.is_running():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # another thread
                self._notify()
                return
            self._loop, self._loop_thread = loop, threading.get_ident()
        if self._gathering:
            self._gathered = True
            return
        if not self._wake_pending:
            self._wake_pending = True
            loop.call_soon(self._notify)

    def _notify(self) -> None:
        self._wake_pending = False
        with self:
            self.notify()


class _Gathering:
    """`ThreadInbox.gathering`: on the event loop, around a callback that may add work
    several times (a read's frames: `Transport.gather`), the thread is told once at its
    end, not by a callback of its own (a turn of the loop, its `epoll_wait`, per step)."""

    __slots__ = ("inbox",)

    def __init__(self, inbox: ThreadInbox) -> None:
        self.inbox = inbox

    def __enter__(self) -> None:
        self.inbox._gathering += 1

    def __exit__(self, *exc: object) -> None:
        inbox = self.inbox
        inbox._gathering -= 1
        if not inbox._gathering and inbox._gathered:
            inbox._gathered = False
            inbox._notify()


class HandOffs(Generic[T]):
    """What a compute thread hands the event loop, in order: each item put in a deque,
    and the loop woken (a `call_soon_threadsafe`) only where no wake is pending since the
    loop last found the deque empty."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[T] = deque()
        self._lock = threading.Lock()
        self._woken = False  # a wake is scheduled, or the loop has not found it empty since
        self._ready = asyncio.Event()
        self._put = self._delivered = 0  # items put, and delivered (`delivered`)

    def put(self, item: T) -> None:
        """On the compute thread."""
        with self._lock:
            self._put += 1
            self._items.append(item)
            if self._woken:
                return
            self._woken = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
            self._loop.call_soon_threadsafe(self._ready.set)

    async def get(self) -> T:
        """On the event loop: the next item, waiting for one."""
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                self._woken = False
            self._ready.clear()  # a put from now on wakes it (its `set` runs after this)
            await self._ready.wait()

    def delivered(self) -> None:
        """On the event loop: the item `get` gave last has been dealt with."""
        self._delivered += 1

    @property
    def settled(self) -> bool:
        """Every item put has been delivered: the compute thread may act on its own
        (send a batch's frames) without passing an earlier batch the loop still holds.
        Delivered is not sent: the loop may send a delivered batch's frames later, after
        what the thread sends now (the module's docstring: no one relies on that order)."""
        return self._put == self._delivered
