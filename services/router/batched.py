"""A router's unary control calls to one stage replica, gathered into batched calls: what
the router sends a stage that has no control stream (control_stream.py).

Every request's driver feeds its own tree layers to stage 1 and sends its own prune
signals to every stage (to stage 1 only where the stages relay them: executor.py). In
one pipeline step the router verifies many requests at once (their verifications arrive
in one frame), and each then prunes and feeds its next group: sent as one RPC each,
that is 1 + S calls per request and step, which reach a stage one after another (its
step-alignment window then waits on the late ones) and cost the router and
the stages a call's handling each. The calls of one kind that the drivers ask for in one
turn of the event loop go out as one `FeedMany` or `PruneMany` instead (at most
`MAX_CALLS_PER_BATCH` items each). Every item keeps its own outcome, as if it had been
sent alone: a refused feed fails its request only. A stage that does not know the
batched call (an older version during a rolling update) gets single calls from then on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc
from specpipe.common.runtime.validation import MAX_CALLS_PER_BATCH
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import stage_pb2

from ..grpc_util import code_from_number

log = logging.getLogger(__name__)

Single = Callable[[object, float], Awaitable[object]]  # (item, timeout)
Many = Callable[[list, float], Awaitable[Sequence[pb.CallOutcome]]]  # (items, timeout)


def refusal(code: int, message: str) -> grpc.aio.AioRpcError:
    """An item's own refusal, raised as the single call would have raised it."""
    status = code_from_number(code)
    return grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), message)


class CallBatcher:
    """One kind of call to one replica: `call(item, timeout)` returns what awaiting the
    single call would (None, or its error raised)."""

    def __init__(
        self, single: Single, many: Many, label: str, max_batch: int = MAX_CALLS_PER_BATCH
    ) -> None:
        self.single, self.many, self.label, self.max_batch = single, many, label, max_batch
        self.batching = True  # False once the replica answered UNIMPLEMENTED
        self._pending: list[tuple[object, float, asyncio.Future]] = []
        self._flushing = False
        self._sends: set[asyncio.Task] = set()

    def call(self, item, timeout: float) -> Awaitable[None]:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._pending.append((item, timeout, done))
        if not self._flushing:
            self._flushing = True
            loop.call_soon(self._flush)  # after the drivers woken in this turn have asked
        return done

    def _flush(self) -> None:
        self._flushing = False
        pending, self._pending = self._pending, []
        pending = [p for p in pending if not p[2].done()]  # their requests ended meanwhile
        for i in range(0, len(pending), self.max_batch):
            task = asyncio.create_task(self._send(pending[i : i + self.max_batch]))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)

    async def _send(self, batch: list[tuple[object, float, asyncio.Future]]) -> None:
        if not self.batching or len(batch) == 1:
            await asyncio.gather(*(self._send_one(*item) for item in batch))
            return
        try:
            # The longest timeout: a request near its client's deadline must not cut the
            # call short for the others (its own deadline ends it on its side).
            outcomes = await self.many([item for item, _, _ in batch], max(t for _, t, _ in batch))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                _fail(batch, e)
                return
            log.info("%s takes no batched calls: sending them one by one", self.label)
            self.batching = False
            await asyncio.gather(*(self._send_one(*item) for item in batch))
            return
        except Exception as e:  # every waiting item gets the failure
            _fail(batch, e)
            return
        if len(outcomes) != len(batch):
            _fail(batch, RuntimeError(f"{self.label} answered {len(outcomes)} of {len(batch)}"))
            return
        for (_, _, done), outcome in zip(batch, outcomes, strict=True):
            refused = outcome.code != grpc.StatusCode.OK.value[0]
            settle(done, refusal(outcome.code, outcome.message) if refused else None)

    async def _send_one(self, item, timeout: float, done: asyncio.Future) -> None:
        try:
            await self.single(item, timeout)
        except Exception as e:  # handed to the waiting item
            settle(done, e)
        else:
            settle(done)


def stage_batchers(stub, label: str) -> tuple[CallBatcher, CallBatcher]:
    """A stage replica's feeds (stage 1) and prunes."""

    async def feed_many(items: list, timeout: float) -> Sequence[pb.CallOutcome]:
        reply = await stub.FeedMany(stage_pb2.FeedManyRequest(feeds=items), timeout=timeout)
        return reply.outcomes

    async def prune_many(items: list, timeout: float) -> Sequence[pb.CallOutcome]:
        reply = await stub.PruneMany(pb.PruneManyRequest(prunes=items), timeout=timeout)
        return reply.outcomes

    async def feed(item, timeout: float) -> object:
        return await stub.Feed(item, timeout=timeout)

    async def prune(item, timeout: float) -> object:
        return await stub.Prune(item, timeout=timeout)

    return (
        CallBatcher(feed, feed_many, f"{label} (feeds)"),
        CallBatcher(prune, prune_many, f"{label} (prunes)"),
    )


def _fail(batch: list[tuple[object, float, asyncio.Future]], error: BaseException) -> None:
    for _, _, done in batch:
        settle(done, error)


def settle(done: asyncio.Future, error: BaseException | None = None, result=None) -> None:
    """Complete `done` with `error` (or `result`) unless it is done already (cancelled)."""
    if done.done():
        return
    if error is None:
        done.set_result(result)
    else:
        done.set_exception(error)
