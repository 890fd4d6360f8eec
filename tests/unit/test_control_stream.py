"""The router's control streams (services/router/control_stream.py) against fake replicas:
one message per event-loop turn, refusals to their own request only, a broken stream
told to every request on it and reopened, draft calls answered by id, releases awaited,
and a stage without the stream served by the batched unary calls."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from specpipe.services.router.control_stream import DraftStream, StageStream
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, stage_pb2

from .router_fakes import FakeStreamCall, unavailable

NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


def _feed(rid: str) -> stage_pb2.FeedRequest:
    return stage_pb2.FeedRequest(request_id=rid, seq=1)


def _prune(rid: str) -> pb.PruneRequest:
    return pb.PruneRequest(request_id=rid, prune=pb.PruneSignal(seq=1))


class Stage:
    """A stage stub: records each message; refuses the items of `refuse`; breaks the
    stream at message `breaks_at` (1-based); `streams=False`: no Control."""

    def __init__(self, refuse=(), breaks_at: int | None = None, streams: bool = True) -> None:
        self.refuse, self.breaks_at, self.streams = set(refuse), breaks_at, streams
        self.messages: list[stage_pb2.StageControl] = []
        self.unary: list[str] = []

    def Control(self, requests):
        if not self.streams:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "no"
            )

        async def handle(msg):
            self.messages.append(msg)
            if len(self.messages) == self.breaks_at:
                raise unavailable("connection reset")
            refusals = [
                stage_pb2.ControlRefusal(request_id=i.request_id, code=NOT_FOUND, message="gone")
                for i in [*msg.feeds, *msg.prunes]
                if i.request_id in self.refuse
            ]
            released = [r.request_id for r in msg.releases]
            return stage_pb2.StageControlReply(refusals=refusals, released=released)

        return FakeStreamCall(requests, handle)

    async def FeedMany(self, request, timeout: float):
        self.unary += [f"FeedMany:{f.request_id}" for f in request.feeds]
        return stage_pb2.FeedManyResponse(outcomes=[pb.CallOutcome()] * len(request.feeds))

    async def Feed(self, request, timeout: float):
        self.unary.append(f"Feed:{request.request_id}")
        return stage_pb2.FeedResponse()


async def _turns(n: int = 10) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def _attached(stream: StageStream, *rids: str) -> dict[str, list]:
    told: dict[str, list] = {rid: [] for rid in rids}
    for rid in rids:
        stream.attach(rid, lambda code, msg, rid=rid: told[rid].append((code, msg)))
    return told


def test_one_message_per_turn_and_refusals_go_to_their_request() -> None:
    async def main() -> None:
        stage = Stage(refuse={"b"})
        stream = StageStream(stage, "stage 1")
        told = _attached(stream, "a", "b")
        stream.feed(_feed("a"), 1.0)
        stream.feed(_feed("b"), 1.0)
        stream.prune(_prune("a"), 1.0)
        await _turns()
        assert len(stage.messages) == 1  # one turn: one message
        assert [f.request_id for f in stage.messages[0].feeds] == ["a", "b"]
        assert told["a"] == [] and told["b"] == [(NOT_FOUND, "gone")]
        await asyncio.wait_for(stream.release("a"), 5)  # awaited: the stage answered
        assert [r.request_id for r in stage.messages[1].releases] == ["a"]
        await stream.close()

    asyncio.run(main())


def test_a_broken_stream_is_told_to_every_request_on_it_and_reopened() -> None:
    async def main() -> None:
        stage = Stage(breaks_at=2)
        stream = StageStream(stage, "stage 2")
        told = _attached(stream, "a", "b")
        stream.prune(_prune("a"), 1.0)
        await _turns()
        assert told == {"a": [], "b": []}
        stream.prune(_prune("a"), 1.0)  # the stream breaks on this one
        await _turns()
        assert [code for code, _ in told["a"]] == [UNAVAILABLE]
        assert [code for code, _ in told["b"]] == [UNAVAILABLE]  # on it, if idle
        assert "control stream broke" in told["a"][0][1]
        stream.detach("a")
        stream.prune(_prune("b"), 1.0)  # a new stream
        await _turns()
        assert stream.opened == 2 and len(stage.messages) == 3
        assert len(told["b"]) == 1
        await stream.close()

    asyncio.run(main())


def test_a_stage_without_the_stream_gets_batched_unary_calls() -> None:
    async def main() -> None:
        stage = Stage(streams=False)
        stream = StageStream(stage, "old stage")
        told = _attached(stream, "a")
        stream.feed(_feed("a"), 1.0)
        await _turns()
        assert [code for code, _ in told["a"]] == [UNAVAILABLE]  # lost: replayed
        stream.feed(_feed("a"), 1.0)
        stream.feed(_feed("a"), 1.0)
        await _turns()
        assert stage.unary == ["FeedMany:a", "FeedMany:a"] and len(told["a"]) == 1

    asyncio.run(main())


class Draft:
    """A draft stub: proposes token 7 under every row; refuses request "x"; breaks the
    stream when `hang` calls are asked (it answers none of them)."""

    def __init__(self, hang: bool = False) -> None:
        self.hang = hang

    def Control(self, requests):
        async def handle(msg):
            if self.hang:
                raise unavailable("reset")
            answers = []
            for c in msg.calls:
                if c.propose.request_id == "x":
                    answers.append(draft_pb2.DraftAnswer(call_id=c.call_id, code=NOT_FOUND,
                                                         message="not open"))  # fmt: skip
                    continue
                proposal = draft_pb2.ProposeResponse(parent_ids=[1], token_ids=[7], probs=[1.0])
                answers.append(draft_pb2.DraftAnswer(call_id=c.call_id, proposal=proposal))
            return draft_pb2.DraftControlReply(answers=answers)

        return FakeStreamCall(requests, handle)


def test_draft_calls_are_answered_by_id_and_fail_when_the_stream_breaks() -> None:
    async def main() -> None:
        stream = DraftStream(Draft(), "draft")
        ok = stream.call(propose=draft_pb2.ProposeRequest(request_id="a"))
        refused = stream.call(propose=draft_pb2.ProposeRequest(request_id="x"))
        assert list((await asyncio.wait_for(ok, 5)).token_ids) == [7]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(refused, 5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        await stream.close()

        broken = DraftStream(Draft(hang=True), "draft")
        call = broken.call(propose=draft_pb2.ProposeRequest(request_id="a"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(call, 5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        await broken.close()

    asyncio.run(main())


def test_a_turn_of_many_large_items_is_split_below_the_message_budget() -> None:
    from specpipe.services.router import control_stream

    async def main() -> None:
        stage = Stage()
        stream = StageStream(stage, "stage 1")
        big = [
            stage_pb2.FeedRequest(request_id=f"r{i}", seq=1, token_ids=list(range(150_000)))
            for i in range(6)
        ]
        for f in big:
            stream.feed(f, 1.0)
        stream.prune(_prune("r0"), 1.0)
        await asyncio.sleep(0.2)
        assert len(stage.messages) > 1
        assert all(m.ByteSize() <= control_stream.MESSAGE_BUDGET for m in stage.messages)
        feeds = [f.request_id for m in stage.messages for f in m.feeds]
        assert feeds == [f.request_id for f in big]  # in order, none lost
        assert [p.request_id for m in stage.messages for p in m.prunes] == ["r0"]
        await stream.close()

    asyncio.run(main())


def test_a_draft_without_the_stream_gets_unary_calls() -> None:
    class OldDraft:
        def Control(self, requests):
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "no"
            )

        async def Propose(self, request, timeout: float):
            return draft_pb2.ProposeResponse(parent_ids=[1], token_ids=[9], probs=[1.0])

    async def main() -> None:
        stream = DraftStream(OldDraft(), "old draft")
        first = stream.call(propose=draft_pb2.ProposeRequest(request_id="a"))
        with pytest.raises(grpc.aio.AioRpcError) as info:  # lost: the draft is dropped
            await asyncio.wait_for(first, 5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        then = stream.call(1.0, propose=draft_pb2.ProposeRequest(request_id="a"))
        assert list((await asyncio.wait_for(then, 5)).token_ids) == [9]

    asyncio.run(main())


def test_one_send_round_flushes_every_stream_of_a_turn_and_survives_a_failing_one() -> None:
    from specpipe.services.router.send_round import send_round

    async def main() -> None:
        ran: list[str] = []
        loop = asyncio.get_running_loop()
        errors: list[dict] = []
        loop.set_exception_handler(lambda _, ctx: errors.append(ctx))
        handles_before = len(loop._ready)  # type: ignore[attr-defined]
        r = send_round()
        r.add(lambda: ran.append("a"))
        r.add(lambda: 1 / 0)
        r.add(lambda: (ran.append("c"), r.add(lambda: ran.append("next turn"))))
        assert len(loop._ready) == handles_before + 1  # type: ignore[attr-defined]
        await asyncio.sleep(0)
        assert ran == ["a", "c"] and len(errors) == 1
        await asyncio.sleep(0)
        assert ran == ["a", "c", "next turn"]

    asyncio.run(main())


def test_a_finished_loop_leaves_no_send_round_behind() -> None:
    import gc
    import weakref

    from specpipe.services.router.send_round import send_round

    loops: list[weakref.ref] = []

    async def main() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        send_round().add(lambda: None)
        await asyncio.sleep(0)

    for _ in range(3):
        asyncio.run(main())
    gc.collect()
    assert [ref() for ref in loops] == [None, None, None]
