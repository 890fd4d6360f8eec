"""A stage's compute round (services/compute_round.py) in one process, without gRPC
calls: its forward is timed on the device (the one device timer) and that time is what
the step aligner learns; arriving hidden states are checked for NaN and infinity on
the compute thread, failing only the request that sent them."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import torch
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange
from specpipe.common.perf.clock import Elapsed
from specpipe.common.runtime.loader import LoadedModel
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation, Prune
from specpipe.services import compute_round
from specpipe.services.stage_service import StageService
from specpipe.services.thread_handoff import HandOffs
from specpipe.services.transport import Frame, encode, make_transport
from specpipe.v1 import stage_pb2

from ..conftest import greedy_verify

DTYPE = torch.float64
WIDTH = 48  # the tiny llama's hidden size


def _last_stage(llama_dir) -> StageService:
    model = load_stage(llama_dir, LayerRange(2, 5, 5), DTYPE)
    return StageService(LoadedModel(StageRuntime(model), "m", "h", 256, ()))


async def _open(svc: StageService, rid: str) -> None:
    # no lease owner and nothing wrong: Open never touches its context
    req = stage_pb2.OpenStageRequest(
        request_id=rid, capacity=64, next_hop="tcp://127.0.0.1:9", verify=greedy_verify()
    )
    await svc.Open(req, None)


def _frame(rid: str, hidden: torch.Tensor) -> Frame:
    """A request's first activation: a one-row tree (its root), verified at once."""
    t = torch.tensor
    act = Activation(
        rid, t([1]), node_ids=t([0]), parent_ids=t([-1]), hidden=hidden, row_tokens=t([7])
    )
    return Frame(*encode(act, 0))


async def _middle_stage_sending_to_a_receiver(llama_dir):
    """A receiver's frames (a queue), the receiver, its address and a middle stage."""
    got: asyncio.Queue = asyncio.Queue()
    rx = make_transport("tcp", got.put_nowait)
    hop = await rx.start()
    model = load_stage(llama_dir, LayerRange(1, 3, 5), DTYPE)
    return got, rx, hop, StageService(LoadedModel(StageRuntime(model), "m", "h", 256, ()))


def test_hidden_states_are_checked_for_nan_on_the_compute_thread(llama_dir) -> None:
    """A frame of NaN hidden states is queued on arrival (the event loop reads no
    values); the round that takes it fails that request alone ("a bad frame") and
    computes the other request of the round."""

    async def main() -> None:
        svc = _last_stage(llama_dir)
        try:
            for rid in ("bad", "good"):
                await _open(svc, rid)
            svc._on_frame(_frame("bad", torch.full((1, WIDTH), float("nan"), dtype=DTYPE)))
            svc._on_frame(_frame("good", torch.zeros(1, WIDTH, dtype=DTYPE)))
            bad = svc._requests["bad"]
            assert not bad.closed and len(bad.order.pending) == 1
            work = svc.rounds._collect()
            assert [w.st.request_id for w in work] == ["bad", "good"]
            assert svc.rounds.compute(work) is not None
            assert "a bad frame: hidden states contain NaN" in str(work[0].error)
            assert work[0].outputs == [None]
            assert work[1].error is None
            ((verified,),) = work[1].outputs  # the root's verification
            assert verified.node_ids[0] == 0 and verified.position == 1
        finally:
            await svc.stop()

    asyncio.run(main())


def test_a_round_is_timed_on_the_device_and_the_aligner_learns_that_time(
    llama_dir, monkeypatch
) -> None:
    events: list[str] = []

    @contextlib.contextmanager
    def timer(device):
        events.append(f"timer on {torch.device(device)}")
        elapsed = Elapsed()
        yield elapsed
        events.append("timer read")
        elapsed.seconds = 0.25

    async def main() -> None:
        svc = _last_stage(llama_dir)
        try:
            await _open(svc, "r")
            run_step = svc.runtime.run_step
            monkeypatch.setattr(
                svc.runtime,
                "run_step",
                lambda step: events.append("forward") or run_step(step),
            )
            monkeypatch.setattr(compute_round, "device_timer", timer)
            monkeypatch.setattr(svc.aligner, "computed", lambda s: events.append(f"aligner {s}"))
            svc._on_frame(_frame("r", torch.zeros(1, WIDTH, dtype=DTYPE)))
            work = svc.rounds._collect()
            await asyncio.get_running_loop().run_in_executor(None, svc.rounds.compute, work)
        finally:
            await svc.stop()

    asyncio.run(main())
    assert events == ["timer on cpu", "forward", "timer read", "aligner 0.25"]


def test_rounds_reach_the_event_loop_in_order_with_one_wake_per_batch() -> None:
    """The compute thread's rounds (`HandOffs`) arrive in the order put; rounds put
    while the loop has not yet looked wake it once, and a get with none waiting waits
    for the next."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        wakes: list[object] = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), real(*a))[1]  # type: ignore[method-assign]
        rounds = HandOffs(loop)

        def put(items) -> None:
            t = threading.Thread(target=lambda: [rounds.put(i) for i in items])
            t.start()
            t.join()

        put(range(5))
        assert [await rounds.get() for _ in range(5)] == list(range(5))
        assert len(wakes) == 1
        waiting = asyncio.ensure_future(rounds.get())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        put([5, 6])
        assert await asyncio.wait_for(waiting, 5) == 5
        assert await rounds.get() == 6
        assert len(wakes) == 2

    asyncio.run(main())


def test_a_round_of_prunes_only_reaches_the_event_loop_only_if_one_failed(llama_dir) -> None:
    """A round with outputs is handed to the event loop; one of prunes only that all
    applied has nothing to deliver and is not; one whose prune failed is (its request
    fails there)."""

    async def main() -> None:
        model = load_stage(llama_dir, LayerRange(1, 3, 5), DTYPE)
        svc = StageService(LoadedModel(StageRuntime(model), "m", "h", 256, ()))
        rounds = svc.rounds
        try:
            await svc.Open(stage_pb2.OpenStageRequest(
                request_id="a", capacity=64, next_hop="tcp://127.0.0.1:9"), None)  # fmt: skip
            svc._on_frame(_frame("a", torch.zeros(1, WIDTH, dtype=DTYPE)))
            t = torch.tensor

            def round_posts() -> list:
                posted: list = []
                rounds._hand_off(rounds._launch(rounds._prepare(rounds._collect())), posted.append)
                return posted

            ((work, failed, _),) = round_posts()
            assert failed is None and len(work[0].outputs) == 1
            order = svc._requests["a"].order
            with rounds.inbox:
                order.add_prune(1, Prune(t([0]), t([], dtype=torch.long), 0))
            assert round_posts() == []
            with rounds.inbox:
                order.add_prune(2, Prune(t([99]), t([], dtype=torch.long), 99))
            ((work, failed, _),) = round_posts()
            assert failed is None and "cannot commit node ids [99]" in str(work[0].error)
        finally:
            await svc.stop()

    asyncio.run(main())


def test_the_compute_thread_sends_a_round_itself_once_the_loop_sent_the_earlier_ones(
    llama_dir,
) -> None:
    """A round's frames leave from the compute thread (issue 34 point 4: no wake of the
    event loop, no turn) where that keeps their order: the first round goes through the
    loop (it opens the connection); later ones, every earlier round delivered, are sent
    by the thread and posted nowhere; without a connection a round is posted, and while
    a posted round is undelivered the next is posted too. Every frame arrives, in order."""

    async def main() -> None:
        got, rx, hop, svc = await _middle_stage_sending_to_a_receiver(llama_dir)
        rounds = svc.rounds
        handed = rounds._rounds = HandOffs(asyncio.get_running_loop())  # as `run_forever`'s
        t = torch.tensor

        def step(seq: int) -> list:
            """A one-node layer (a chain: its parent is the last one) through a round."""
            hidden = torch.zeros(1, WIDTH, dtype=DTYPE)
            act = Activation("a", t([seq]), node_ids=t([seq]), parent_ids=t([seq - 1]),
                             hidden=hidden)  # fmt: skip
            svc._on_frame(Frame(*encode(act, seq)))
            posted: list = []

            def post(item) -> None:  # as `run_forever`'s, without its loop
                posted.append(item)
                handed.put(item)

            rounds._hand_off(rounds._launch(rounds._prepare(rounds._collect())), post)
            return posted

        async def deliver(posted: list) -> None:
            for item in posted:
                await rounds._delivered(*item)
                handed.delivered()

        try:
            await svc.Open(stage_pb2.OpenStageRequest(
                request_id="a", capacity=64, next_hop=hop), None)  # fmt: skip
            first = step(0)  # no connection yet: the loop's
            assert len(first) == 1
            await deliver(first)
            assert step(1) == [] and step(2) == []  # the thread's
            svc.transport._drop(hop)  # type: ignore[attr-defined]
            later = step(3) + step(4)  # no connection, then one round undelivered
            assert len(later) == 2
            await deliver(later)
            assert step(5) == []
            seqs = [(await asyncio.wait_for(got.get(), 10)).header.seq for _ in range(6)]
            assert seqs == list(range(6))
        finally:
            await svc.stop()
            await rx.close()

    asyncio.run(main())


def test_a_round_whose_frames_fail_to_be_made_fails_only_its_requests(llama_dir, monkeypatch):
    """A bug making a round's frames on the compute thread (`_outgoing`) fails that
    round's requests alone: the thread lives on and the next request is served."""

    async def main() -> None:
        got, rx, hop, svc = await _middle_stage_sending_to_a_receiver(llama_dir)
        rounds = svc.rounds
        made = rounds._outgoing
        calls = []

        def outgoing(work):
            calls.append(work)
            if len(calls) == 1:
                raise ValueError("a bug")
            return made(work)

        monkeypatch.setattr(rounds, "_outgoing", outgoing)
        computing = asyncio.create_task(rounds.run_forever())
        t = torch.tensor
        try:
            for rid in ("a", "b"):
                await svc.Open(stage_pb2.OpenStageRequest(
                    request_id=rid, capacity=64, next_hop=hop), None)  # fmt: skip
            hidden = torch.zeros(1, WIDTH, dtype=DTYPE)
            root = Activation("a", t([0]), node_ids=t([0]), parent_ids=t([-1]), hidden=hidden)
            svc._on_frame(Frame(*encode(root, 0)))
            for _ in range(500):
                if svc._requests["a"].closed:
                    break
                await asyncio.sleep(0.01)
            assert svc._requests["a"].closed
            root.request_id = "b"
            svc._on_frame(Frame(*encode(root, 0)))
            frame = await asyncio.wait_for(got.get(), 10)
            assert frame.header.request_id == "b"
            assert not computing.done() and not svc._requests["b"].closed
        finally:
            computing.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await computing
            await svc.stop()
            await rx.close()

    asyncio.run(main())
