"""A router's feeds to one first stage, gathered into `FeedMany` calls.

Every request's driver feeds its own tree layers to stage 1. In one pipeline step the
router verifies many requests at once (their logits arrive in one frame, their draft
answers in one batched forward), and each then feeds its next group: sent as one RPC
each, they reach stage 1 one after another, and its step-alignment window waits on the
late ones. The feeds asked for in one turn of the event loop go out as one `FeedMany`
instead (at most `MAX_FEEDS_PER_CALL` each). Every feed keeps its own outcome, as if it
had been sent alone: a refused feed fails its request only. A stage that does not know
`FeedMany` (an older version during a rolling update) gets single `Feed`s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

import grpc
from specpipe.common.runtime.validation import MAX_FEEDS_PER_CALL
from specpipe.v1 import stage_pb2

log = logging.getLogger(__name__)


def _refusal(code: int, message: str) -> grpc.aio.AioRpcError:
    """A feed's own refusal, raised as the single Feed call would have raised it."""
    status = next((s for s in grpc.StatusCode if s.value[0] == code), grpc.StatusCode.UNKNOWN)
    return grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), message)


class FeedBatcher:
    """Feeds to one stage-1 replica: `feed` returns what awaiting its `Feed` call would."""

    def __init__(self, stub, label: str = "stage 1", max_batch: int = MAX_FEEDS_PER_CALL):
        self.stub, self.label, self.max_batch = stub, label, max_batch
        self.many = True  # False once the stage answered FeedMany with UNIMPLEMENTED
        self.calls = 0  # FeedMany calls sent (for tests and logs)
        self._pending: list[tuple[stage_pb2.FeedRequest, float, asyncio.Future]] = []
        self._flushing = False
        self._sends: set[asyncio.Task] = set()

    def feed(self, request: stage_pb2.FeedRequest, timeout: float) -> Awaitable[None]:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._pending.append((request, timeout, done))
        if not self._flushing:
            self._flushing = True
            loop.call_soon(self._flush)  # after the drivers woken in this turn have fed
        return done

    def _flush(self) -> None:
        self._flushing = False
        pending, self._pending = self._pending, []
        pending = [p for p in pending if not p[2].done()]  # their requests ended meanwhile
        for i in range(0, len(pending), self.max_batch):
            task = asyncio.create_task(self._send(pending[i : i + self.max_batch]))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)

    async def _send(self, batch: list[tuple[stage_pb2.FeedRequest, float, asyncio.Future]]) -> None:
        if not self.many or len(batch) == 1:
            await asyncio.gather(*(self._send_one(*item) for item in batch))
            return
        call = stage_pb2.FeedManyRequest(feeds=[req for req, _, _ in batch])
        try:
            self.calls += 1
            reply = await self.stub.FeedMany(call, timeout=min(t for _, t, _ in batch))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                for _, _, done in batch:
                    _settle(done, error=e)
                return
            log.info("%s does not take FeedMany: feeding it one request a call", self.label)
            self.many = False
            await asyncio.gather(*(self._send_one(*item) for item in batch))
            return
        except Exception as e:  # every waiting feed gets the failure
            for _, _, done in batch:
                _settle(done, error=e)
            return
        if len(reply.outcomes) != len(batch):
            e = RuntimeError(f"{self.label} answered {len(reply.outcomes)} of {len(batch)} feeds")
            for _, _, done in batch:
                _settle(done, error=e)
            return
        for (_, _, done), outcome in zip(batch, reply.outcomes, strict=True):
            refused = outcome.code != grpc.StatusCode.OK.value[0]
            _settle(done, error=_refusal(outcome.code, outcome.message) if refused else None)

    async def _send_one(self, request, timeout: float, done: asyncio.Future) -> None:
        try:
            await self.stub.Feed(request, timeout=timeout)
        except Exception as e:  # handed to the waiting feed
            _settle(done, error=e)
        else:
            _settle(done)


def _settle(done: asyncio.Future, error: BaseException | None = None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)
