"""A request's draft lane (services/router/draft_lane.py): calls one at a time in the
order they were made, each answer to its own taker, a call past its deadline given up
by the loop's one sweep (the lane fails, nothing after it is sent), close."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
from specpipe.services.router.calls import Deadline
from specpipe.services.router.draft_lane import DraftLane, sweep_of


class Calls:
    """The calls a lane started, by name, each a future the test answers."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.futures: dict[str, asyncio.Future] = {}
        self.answers: list[tuple[str, object]] = []
        self.failures: list[tuple[str, BaseException]] = []

    def start(self, name: str):
        def go(draft) -> asyncio.Future:
            self.started.append(name)
            f = self.futures[name] = asyncio.get_running_loop().create_future()
            return f

        return go

    def taker(self, name: str):
        return lambda result: self.answers.append((name, result))

    def failed(self, what: str, error: BaseException) -> None:
        self.failures.append((what, error))


def lane_of(calls: Calls, max_call: float = 60.0) -> DraftLane:
    return DraftLane(SimpleNamespace(label="d0"), Deadline(None, max_call), calls.failed)  # type: ignore[arg-type]


async def turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_calls_go_one_at_a_time_in_the_order_they_were_made() -> None:
    async def main() -> None:
        calls = Calls()
        lane = lane_of(calls)
        for name in ("open", "prefill", "propose"):
            lane.add(name, calls.start(name), calls.taker(name))
        assert calls.started == ["open"]  # the next waits for this one's answer
        calls.futures["open"].set_result(None)
        await turns()
        assert calls.started == ["open", "prefill"]
        calls.futures["prefill"].set_result("p")
        await turns()
        calls.futures["propose"].set_result("layer")
        await turns()
        assert calls.answers == [("open", None), ("prefill", "p"), ("propose", "layer")]
        lane.add("again", calls.start("again"))  # an idle lane sends at once
        assert calls.started[-1] == "again" and not calls.failures

    asyncio.run(main())


def test_a_call_past_its_deadline_fails_the_lane_and_nothing_after_it_is_sent() -> None:
    async def main() -> None:
        slow, quick = Calls(), Calls()
        patient = lane_of(slow, max_call=30.0)  # armed first, at the later deadline
        patient.add("propose", slow.start("propose"))
        lane = lane_of(quick, max_call=0.05)  # an earlier deadline moves the sweep's timer
        lane.add("propose", quick.start("propose"), quick.taker("propose"))
        lane.add("prune", quick.start("prune"))
        await asyncio.sleep(0.3)
        ((what, error),) = quick.failures
        assert what == "propose"
        assert isinstance(error, grpc.aio.AioRpcError)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no answer from d0" in (error.details() or "")
        assert quick.futures["propose"].cancelled()  # given up: the stream forgets it
        assert quick.started == ["propose"] and lane.closed  # the prune was never sent
        lane.add("later", quick.start("later"))
        assert quick.started == ["propose"]
        # The other lane's call is within its deadline, and the sweep waits for it.
        assert not slow.failures and not slow.futures["propose"].done()
        assert sweep_of(asyncio.get_running_loop()).lanes == {patient}
        patient.close()
        assert slow.futures["propose"].cancelled() and not slow.failures
        assert not sweep_of(asyncio.get_running_loop()).lanes  # closed lanes are forgotten

    asyncio.run(main())


def test_a_failed_call_or_a_bad_answer_fails_the_lane() -> None:
    async def main() -> None:
        calls = Calls()
        lane = lane_of(calls)
        lane.add("prefill", calls.start("prefill"))
        lane.add("propose", calls.start("propose"), lambda result: 1 / 0)
        lane.add("prune", calls.start("prune"))
        calls.futures["prefill"].set_result(None)
        await turns()
        calls.futures["propose"].set_result("garbled")
        await turns()
        ((what, error),) = calls.failures
        assert what == "propose" and isinstance(error, ZeroDivisionError)
        assert calls.started == ["prefill", "propose"]

        refused = Calls()
        lane = lane_of(refused)
        lane.add("prefill", refused.start("prefill"))
        refused.futures["prefill"].set_exception(RuntimeError("refused"))
        await turns()
        assert [(w, str(e)) for w, e in refused.failures] == [("prefill", "refused")]

    asyncio.run(main())


def test_one_reply_answers_many_lanes_in_place_in_its_order() -> None:
    """The draft's answers to many requests in one reply are each handed to its lane
    where the reply is read (no loop turn between them); a refused one fails only its
    own lane, an answer for a closed lane is dropped."""
    from specpipe.services.router.control_stream import DraftStream
    from specpipe.v1 import draft_pb2

    async def main() -> None:
        stream = DraftStream(SimpleNamespace(), "d0")
        stream._flushing = True  # nothing is sent: the test answers by hand
        draft = SimpleNamespace(label="d0", control=stream)
        got: list[tuple[str, object]] = []
        failed: list[tuple[str, BaseException]] = []
        lanes = {}
        for name in ("a", "b", "c", "gone"):
            lane = DraftLane(draft, Deadline(None, 60.0),  # type: ignore[arg-type]
                             lambda what, e, n=name: failed.append((n, e)))  # fmt: skip
            req = draft_pb2.ProposeRequest(request_id=name)
            lane.add("propose", lambda d, r=req: d.control.call(propose=r),
                     lambda result, n=name: got.append((n, result)))  # fmt: skip
            lanes[name] = lane
        lanes["gone"].close()
        ids = [c.call_id for c in stream._calls]
        proposal = draft_pb2.ProposeResponse(token_ids=[5])
        reply = draft_pb2.DraftControlReply(answers=[
            draft_pb2.DraftAnswer(call_id=ids[2], proposal=proposal),
            draft_pb2.DraftAnswer(call_id=ids[1], code=grpc.StatusCode.NOT_FOUND.value[0],
                                  message="not open"),
            draft_pb2.DraftAnswer(call_id=ids[0]),
            draft_pb2.DraftAnswer(call_id=ids[3], proposal=proposal),
        ])  # fmt: skip
        stream._on_reply(reply)
        assert got == [("c", proposal), ("a", None)]  # at once, in the reply's order
        ((name, error),) = failed
        assert name == "b" and error.code() == grpc.StatusCode.NOT_FOUND
        assert not stream._waiting
        for lane in lanes.values():
            lane.close()

    asyncio.run(main())
