"""Tokenizing (and chat templates) off the router's event loop, bounded
(docs/architecture.md, "9. Security").

Two lanes of threads: short texts (up to SHORT_CHARS characters) have a thread of
their own, so a neighbour's short prompt never waits behind long ones; long texts share
LONG_THREADS threads, and at most `budget` characters of them may be queued or running
at once. A text beyond that is refused at once, RESOURCE_EXHAUSTED (HTTP 429), instead
of waiting in an unbounded queue while its request holds its memory (a tokenizer's
encoding of a million characters takes hundreds of MB). The router's budget is
BUDGET_PROMPTS prompt of the largest size its context admits (1M characters for a
32k context: many ordinary long prompts at once), so a prompt of any admissible size
gets through whenever no other long one is being tokenized.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc

from .requests import RequestFailed

T = TypeVar("T")
SHORT_CHARS = 16 << 10
SHORT_THREADS = 1
LONG_THREADS = 2
BUDGET_PROMPTS = 1
MAX_SHORT_JOBS = 256  # short texts queued or running


class TokenizingQueue:
    """Runs tokenizer calls on the two lanes, refusing what is over their bounds."""

    def __init__(self) -> None:
        self._short = ThreadPoolExecutor(SHORT_THREADS, thread_name_prefix="tokenize-short")
        self._long = ThreadPoolExecutor(LONG_THREADS, thread_name_prefix="tokenize")
        self._lock = threading.Lock()
        self.long_chars = 0  # characters of long texts queued or running
        self.short_jobs = 0

    def full(self, chars: int, budget: int) -> bool:
        """Whether a text of at least `chars` characters would be refused now (the HTTP
        API asks before it reads and parses a large body)."""
        return chars > SHORT_CHARS and bool(self.long_chars) and self.long_chars + chars > budget

    async def run(self, chars: int, budget: int, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on a tokenizer thread, for a text of `chars` characters; refused
        (RequestFailed, RESOURCE_EXHAUSTED) when its lane is full. `budget`: the
        characters of long texts the lane may hold."""
        short = chars <= SHORT_CHARS
        with self._lock:
            if short and self.short_jobs >= MAX_SHORT_JOBS:
                raise RequestFailed(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the router has {self.short_jobs} prompts waiting to be tokenized: "
                    "retry later",
                )
            if not short and self.long_chars and self.long_chars + chars > budget:
                raise RequestFailed(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the router is tokenizing {self.long_chars} characters of long prompts "
                    f"(at most {budget} at once): retry later",
                )
            if short:
                self.short_jobs += 1
            else:
                self.long_chars += chars
        lane = self._short if short else self._long
        try:
            job = lane.submit(fn, *args)
        except RuntimeError:  # shut down
            self._release(short, chars)
            raise RequestFailed(
                grpc.StatusCode.UNAVAILABLE, "the router is shutting down"
            ) from None
        # Released when the thread is done with it (or it is cancelled before it
        # started), not when the waiting request gives up: the budget counts real work.
        job.add_done_callback(lambda _f: self._release(short, chars))
        return await asyncio.wrap_future(job)

    def _release(self, short: bool, chars: int) -> None:
        with self._lock:
            if short:
                self.short_jobs -= 1
            else:
                self.long_chars -= chars

    def shutdown(self) -> None:
        for lane in (self._short, self._long):
            lane.shutdown(wait=False, cancel_futures=True)
