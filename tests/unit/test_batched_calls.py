"""The router's control calls to a stage: the feeds (or prunes) of one event-loop turn go
out as one FeedMany (PruneMany), each keeps its own outcome, and a stage without the
batched call gets single calls."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from specpipe.services.router.batched import CallBatcher, stage_batchers
from specpipe.services.router.calls import backend_error
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import stage_pb2


def _error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeStage:
    """A first stage's stub: records calls; refuses the feeds of `refuse` (request id ->
    status); `many=False` is a stage that does not know FeedMany; `fail` fails FeedMany."""

    def __init__(self, many=True, refuse=None, fail: grpc.StatusCode | None = None) -> None:
        self.many, self.refuse, self.fail = many, refuse or {}, fail
        self.calls: list[tuple[str, list[str], float]] = []

    async def Feed(self, request, timeout: float) -> stage_pb2.FeedResponse:
        self.calls.append(("Feed", [request.request_id], timeout))
        if request.request_id in self.refuse:
            raise _error(self.refuse[request.request_id], f"{request.request_id} refused")
        return stage_pb2.FeedResponse()

    async def FeedMany(self, request, timeout: float) -> stage_pb2.FeedManyResponse:
        self.calls.append(("FeedMany", [f.request_id for f in request.feeds], timeout))
        if not self.many:
            raise _error(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        if self.fail is not None:
            raise _error(self.fail, "stage went away")
        outcomes = []
        for f in request.feeds:
            code = self.refuse.get(f.request_id, grpc.StatusCode.OK)
            msg = f"{f.request_id} refused" if code != grpc.StatusCode.OK else ""
            outcomes.append(pb.CallOutcome(code=code.value[0], message=msg))
        return stage_pb2.FeedManyResponse(outcomes=outcomes)

    async def Prune(self, request, timeout: float) -> pb.PruneResponse:
        self.calls.append(("Prune", [request.request_id], timeout))
        return pb.PruneResponse()

    async def PruneMany(self, request, timeout: float) -> pb.PruneManyResponse:
        self.calls.append(("PruneMany", [p.request_id for p in request.prunes], timeout))
        if not self.many:
            raise _error(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        bad = grpc.StatusCode.FAILED_PRECONDITION
        return pb.PruneManyResponse(outcomes=[
            pb.CallOutcome(code=bad.value[0], message="duplicate") if p.prune.seq == 0
            else pb.CallOutcome() for p in request.prunes
        ])  # fmt: skip


def _feed(rid: str) -> stage_pb2.FeedRequest:
    return stage_pb2.FeedRequest(request_id=rid, seq=1, token_ids=[3])


def feeds(stage: FakeStage) -> CallBatcher:
    return stage_batchers(stage, "stage")[0]


async def _drivers(batcher: CallBatcher, rids: list[str], timeout=5.0) -> list:
    """Each request feeds from its own task, all woken in the same turn (as drivers are
    by one frame of logits); their outcomes (None or the exception)."""

    async def one(rid: str):
        try:
            await batcher.call(_feed(rid), timeout)
        except grpc.aio.AioRpcError as e:
            return e
        return None

    return await asyncio.gather(*(one(r) for r in rids))


def test_the_feeds_of_one_turn_are_one_call_and_each_keeps_its_outcome() -> None:
    stage = FakeStage(refuse={"b": grpc.StatusCode.NOT_FOUND})
    batcher = feeds(stage)
    outcomes = asyncio.run(_drivers(batcher, ["a", "b", "c"], timeout=7.0))
    assert stage.calls == [("FeedMany", ["a", "b", "c"], 7.0)]
    assert outcomes[0] is None and outcomes[2] is None
    refused = outcomes[1]
    assert refused.code() == grpc.StatusCode.NOT_FOUND and refused.details() == "b refused"
    # the driver sees it as it would see a single Feed's refusal
    single = FakeStage(many=False, refuse={"b": grpc.StatusCode.NOT_FOUND})
    alone = asyncio.run(_drivers(feeds(single), ["b"]))[0]
    fake = type("B", (), {"label": "stage 0:2 at x"})()
    got, want = (backend_error(fake, "receiving rows", e) for e in (refused, alone))
    assert (got.code, got.message, got.replayable) == (want.code, want.message, want.replayable)


def test_a_request_near_its_deadline_does_not_shorten_the_others_call() -> None:
    stage = FakeStage()
    batcher = feeds(stage)

    async def main() -> None:
        await asyncio.gather(batcher.call(_feed("a"), 60.0), batcher.call(_feed("late"), 0.01))

    asyncio.run(main())
    assert stage.calls == [("FeedMany", ["a", "late"], 60.0)]


def test_a_stage_without_feed_many_gets_single_feeds_from_then_on() -> None:
    stage = FakeStage(many=False)
    batcher = feeds(stage)

    async def main() -> None:
        assert await _drivers(batcher, ["a", "b"]) == [None, None]
        assert not batcher.batching
        assert await _drivers(batcher, ["c", "d"]) == [None, None]

    asyncio.run(main())
    assert [c[0] for c in stage.calls] == ["FeedMany", "Feed", "Feed", "Feed", "Feed"]
    assert [c[1] for c in stage.calls[1:]] == [["a"], ["b"], ["c"], ["d"]]


def test_a_failed_call_fails_every_feed_in_it() -> None:
    stage = FakeStage(fail=grpc.StatusCode.UNAVAILABLE)
    outcomes = asyncio.run(_drivers(feeds(stage), ["a", "b"]))
    assert [e.code() for e in outcomes] == [grpc.StatusCode.UNAVAILABLE] * 2


def test_more_feeds_than_a_call_holds_go_as_several_calls() -> None:
    stage = FakeStage()
    rids = [f"r{i}" for i in range(7)]
    batcher = feeds(stage)
    batcher.max_batch = 3
    assert asyncio.run(_drivers(batcher, rids)) == [None] * 7
    assert [c[1] for c in stage.calls] == [rids[:3], rids[3:6], rids[6:]]
    assert [c[0] for c in stage.calls] == ["FeedMany", "FeedMany", "Feed"]  # one: no batch


def test_a_feed_whose_request_ended_before_the_call_is_not_sent() -> None:
    stage = FakeStage()
    batcher = feeds(stage)

    async def main() -> None:
        gone = asyncio.ensure_future(batcher.call(_feed("gone"), 5.0))
        kept = batcher.call(_feed("kept"), 5.0)
        gone.cancel()
        await kept
        with pytest.raises(asyncio.CancelledError):
            await gone

    asyncio.run(main())
    assert stage.calls == [("Feed", ["kept"], 5.0)]


def test_prunes_of_one_turn_are_one_prune_many() -> None:
    stage = FakeStage()
    prunes = stage_batchers(stage, "stage")[1]

    async def main() -> list:
        calls = [
            prunes.call(pb.PruneRequest(request_id=rid, prune=pb.PruneSignal(seq=seq)), 3.0)
            for rid, seq in (("a", 1), ("b", 0), ("c", 2))
        ]
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(main())
    assert stage.calls == [("PruneMany", ["a", "b", "c"], 3.0)]
    assert outcomes[0] is None and outcomes[2] is None
    assert outcomes[1].code() == grpc.StatusCode.FAILED_PRECONDITION
