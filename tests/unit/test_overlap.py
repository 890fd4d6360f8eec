"""Host work overlaps device work (issue 34 point 4): a stage's compute thread reads the
device only where it hands a round's outputs on (never while it prepares or launches
one), and it takes a round whose input is there without a turn of the event loop."""

from __future__ import annotations

import asyncio
import threading
import time

import torch
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime.loader import LoadedModel
from specpipe.common.runtime.ordering import Pending
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation, Prune
from specpipe.services.stage_service import StageService
from specpipe.services.transport import Inbox, make_transport
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import stage_pb2

from .device_reads import DeviceReads

t = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731


def _whole_model(llama_dir) -> StageService:
    """One stage of all layers: it embeds, runs the layers and verifies."""
    model = load_stage(llama_dir, LayerRange(0, 5, 5), torch.float64)
    return StageService(LoadedModel(StageRuntime(model), "m", "h", 256, ()))


async def _open(svc: StageService, rid: str, next_hop: str) -> None:
    req = stage_pb2.OpenStageRequest(
        request_id=rid, capacity=64, next_hop=next_hop, prefix_token_ids=[5, 9],
        verify=pb.VerifySpec(temperature=0.0, top_p=1.0, output_start=3),
    )  # fmt: skip
    await svc.Open(req, None)


def _add(svc: StageService, rid: str, seq: int, act: Activation, after: int = 0) -> None:
    """Work for `rid` into the stage's inbox, as its event loop adds it."""
    with svc.rounds.inbox:
        svc._requests[rid].order.add_activation(seq, Pending(act, after))
        svc.rounds.wake()


def _start(svc: StageService, rid: str) -> None:
    """A request's prompt (its last token, 13, the first root): activations 0 and 1,
    added together as the event loop adds a frame's parts (the compute thread, told at
    the first, takes both in one round: told between them, it took the first alone)."""
    with svc.rounds.inbox:
        _add(svc, rid, 0, Activation(rid, t(0, 1), committed=True, tokens=t(5, 9)))
        _add(svc, rid, 1, _layer(rid, (2,), (0,), (-1,), (13,)))


def _layer(rid: str, positions, nodes, parents, tokens) -> Activation:
    return Activation(rid, t(*positions), node_ids=t(*nodes), parent_ids=t(*parents),
                      tokens=t(*tokens))  # fmt: skip


def test_a_round_reads_the_device_only_where_it_hands_its_outputs_on(llama_dir) -> None:
    """Rounds of two requests (prefill, a tree layer, a prune and the next layer), each
    prepared, launched and handed off as the compute thread does: no read of device
    memory (the model's weights, the KV pool, what was copied there and all computed
    from them) while a round is prepared or launched; the hand-off reads (the draws)."""

    async def main() -> None:
        svc = _whole_model(llama_dir)
        rounds, runtime = svc.rounds, svc.runtime
        if not runtime.pool.allocated:
            runtime.pool.allocate_storage()
        reads = DeviceReads([*runtime.model.parameters(), runtime.pool.k, runtime.pool.v])
        try:
            for rid in ("a", "b"):
                await _open(svc, rid, "tcp://127.0.0.1:9")
                _start(svc, rid)
            turns = [
                lambda rid: _add(svc, rid, 2, _layer(rid, (3, 3), (1, 2), (0, 0), (7, 11))),
                lambda rid: (
                    svc._requests[rid].order.add_prune(1, Prune(t(0), t(1), horizon=2)),
                    _add(svc, rid, 3, _layer(rid, (4,), (3,), (1,), (4,)), after=1),
                ),
            ]
            for n in range(len(turns) + 1):
                if n:
                    for rid in ("a", "b"):
                        turns[n - 1](rid)
                work = rounds._collect()
                assert {w.st.request_id for w in work} == {"a", "b"}
                with reads:
                    reads.phase = "prepare"
                    r = rounds._prepare(work)
                    reads.phase = "launch"
                    rounds._launch(r)
                    reads.phase = "hand-off"
                    rounds._complete(r)
                assert all(w.error is None for w in work), [w.error for w in work]
                assert all(isinstance(w.outputs[-1], list) for w in work)  # verifications
        finally:
            await svc.stop()
        assert reads.in_phase("prepare") == [] and reads.in_phase("launch") == []
        assert reads.in_phase("hand-off"), "the draws read the device: the check sees reads"

    asyncio.run(main())


def test_the_compute_thread_takes_a_ready_round_while_the_event_loop_is_blocked(
    llama_dir,
) -> None:
    """With its event loop blocked, a stage's compute thread still computes each round
    as its input arrives (two rounds, the second's input added after the first ran);
    their outputs are delivered once the loop runs again."""
    ran: list[str] = []

    async def main() -> None:
        inbox = Inbox()
        out = inbox.open("r")
        router = make_transport("tcp", inbox)
        svc = _whole_model(llama_dir)
        run_step = svc.runtime.run_step
        svc.runtime.run_step = lambda step: (
            ran.append(threading.current_thread().name) or (run_step(step))
        )
        await svc.start()
        try:
            await _open(svc, "r", await router.start())
            done = threading.Event()

            def feed() -> None:
                _start(svc, "r")
                _until(lambda: len(ran) == 1)
                _add(svc, "r", 2, _layer("r", (3, 3), (1, 2), (0, 0), (7, 11)))
                _until(lambda: len(ran) == 2)
                done.set()

            threading.Thread(target=feed, daemon=True).start()
            assert done.wait(30)  # blocks the event loop until both rounds ran
            assert out.empty()  # nothing delivered yet: the loop took no turn
            got = await asyncio.wait_for(out.get(), 30)  # the root's verification
            assert got.header.kind == pb.PAYLOAD_KIND_VERIFIED
        finally:
            await svc.stop()
            await router.close()

    asyncio.run(main())
    assert len(ran) == 2 and all(name.endswith("rounds") for name in ran)


def _until(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the compute thread did not take the round"
        time.sleep(0.005)


def test_the_next_round_is_prepared_while_the_device_runs_the_current_one(llama_dir) -> None:
    """On an asynchronous device (here an emulated one: a forward takes 0.5 s) a round
    whose input arrives while the previous round runs is prepared before the previous
    one is handed off; both are delivered, in order."""
    from specpipe.common.perf.emulate import EmulatedCosts, Pacer

    log: list[str] = []

    async def main() -> None:
        inbox = Inbox()
        outs = [inbox.open(rid) for rid in ("a", "b")]
        router = make_transport("tcp", inbox)
        svc = _whole_model(llama_dir)
        svc.pacer = Pacer(EmulatedCosts.flat(0.5).stage())
        rounds = svc.rounds
        prepare, hand_off = rounds._prepare, rounds._hand_off
        rounds._prepare = lambda work: log.append("prepare") or prepare(work)
        rounds._hand_off = lambda r, post: log.append("hand-off") or hand_off(r, post)
        await svc.start()
        try:
            hop = await router.start()
            for rid in ("a", "b"):
                await _open(svc, rid, hop)
            _start(svc, "a")
            await asyncio.to_thread(_until, lambda: log == ["prepare"])
            _start(svc, "b")
            got = [await asyncio.wait_for(out.get(), 30) for out in outs]
            assert all(f.header.kind == pb.PAYLOAD_KIND_VERIFIED for f in got)
        finally:
            await svc.stop()
            await router.close()

    asyncio.run(main())
    assert log == ["prepare", "prepare", "hand-off", "hand-off"], log
