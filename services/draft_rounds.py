"""The draft's batched forwards on a compute thread of their own (issue 34, point 4).

The event loop puts each request's work (a Propose, a prefill chunk) into the inbox and
wakes the thread; the thread takes every waiting request's first item as one batch as
soon as the `StepAligner` lets it start (the calls of one pipeline step reach the draft
spread over the router's handling of the step: a bounded wait for the expected ones),
computes it, answers what it can itself (`answer_now`: the replies to control frames,
sent from the thread where no batch of its waits for the loop and the transport can send
at once, issue 34 point 4; an earlier batch's replies, which the loop sends, may still
reach the router after them: the router matches replies by call_id, not by order) and
hands the rest of the batch and its results to the event loop (`HandOffs`: one wake-up
per batch the loop has not looked at yet; thread_handoff.py, which the stages share). So
a batch whose input is already there never waits for a turn of the event loop, and a
forward costs the loop at most one wake-up, none where the thread answered it all
(`benchmarks/README.md`, "Draft host work, session 41" and "Session 45: the draft's
loop"). A stage does the same with more phases (services/compute_round.py); the draft's
work of a request depends on its last answer, so there is nothing to prepare ahead and a
batch is computed and handed off in one go.

`inbox` guards the waiting work and the aligner: the event loop holds it to add work,
to tell the aligner of arrivals and departures, and the thread to take a batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from specpipe.common.runtime.alignment import StepAligner

from .thread_handoff import HandOffs, ThreadInbox

log = logging.getLogger(__name__)


class Waiting(Protocol):
    """One request's item of work."""

    @property
    def request_id(self) -> str: ...

    def gone(self) -> bool:
        """Its caller went away: it is dropped, not computed."""


W = TypeVar("W", bound=Waiting)


AnswerNow = Callable[[list[W], Sequence], tuple[list[W], list]]


class DraftRounds(Generic[W]):
    """The waiting work and the thread that computes it: `compute(batch)` gives one
    result per item (on the thread); `answer_now(batch, results)`, on the thread while
    no batch handed to the loop waits, answers what it can and gives back the items
    (and their results) left for the loop; `run_forever(deliver)` runs the thread and
    calls `deliver(batch, results)` on the event loop for each batch (or its rest)."""

    def __init__(
        self,
        aligner: StepAligner,
        compute: Callable[[list[W]], Sequence],
        answer_now: AnswerNow | None = None,
    ) -> None:
        self.aligner = aligner
        self.inbox = ThreadInbox()
        self.waiting: list[W] = []  # in arrival order
        self._compute = compute
        self._answer_now = answer_now
        self._stopped = True

    def add(self, item: W) -> None:
        """On the event loop: `item` joins the next batch (the thread is told once the
        loop's current callback is done: the calls of one control message join one)."""
        with self.inbox:
            self.waiting.append(item)
        self.inbox.wake()

    def take_all(self) -> list[W]:
        """Every waiting item, taken (the loop stopped: they are failed)."""
        with self.inbox:
            items, self.waiting = self.waiting, []
        return items

    async def run_forever(self, deliver: Callable[[list[W], Sequence], None]) -> None:
        """Start the compute thread and deliver what it computes until cancelled (the
        thread stops after its batch); a thread that died (a bug) ends this too."""
        batches: HandOffs[tuple[list[W], Sequence] | BaseException] = HandOffs(
            asyncio.get_running_loop()
        )
        self._stopped = False
        threading.Thread(
            target=self._serve, args=(batches,), name="draft rounds", daemon=True
        ).start()
        try:
            while True:
                item = await batches.get()
                if isinstance(item, BaseException):
                    raise RuntimeError("draft: its compute thread died") from item
                deliver(*item)
                batches.delivered()
        finally:
            with self.inbox:
                self._stopped = True
                self.inbox.notify()

    # -- on the compute thread ---------------------------------------------------------------
    def _serve(self, batches: HandOffs) -> None:
        try:
            while (batch := self._next()) is not None:
                results = self._compute(batch)
                if self._answer_now is not None and batches.settled:
                    batch, results = self._answer_now(batch, results)
                if batch:
                    batches.put((batch, results))
        except BaseException as e:  # a bug: the service fails what it holds
            log.exception("draft: the compute thread failed")
            batches.put(e)

    def _next(self) -> list[W] | None:
        """The next batch, once the aligner lets it start; None when stopped."""
        with self.inbox:
            while not self._stopped:
                if not self.waiting:
                    self.aligner.started()
                    self.inbox.wait()
                    continue
                ready = {w.request_id for w in self.waiting}
                hold = self.aligner.hold(ready, self.aligner.requests)
                if hold > 0:
                    self.inbox.wait(hold)
                    continue
                self.aligner.started(ready)
                if batch := self._take():
                    return batch
            return None

    def _take(self) -> list[W]:
        """Each request's first waiting item (its calls come one after another; a later
        one waits for the next batch); items whose caller went away are dropped."""
        batch: list[W] = []
        rest: list[W] = []
        taken: set[str] = set()
        for item in self.waiting:
            if item.gone():
                continue
            (rest if item.request_id in taken else batch).append(item)
            taken.add(item.request_id)
        self.waiting = rest
        return batch
