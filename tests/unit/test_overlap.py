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


def _prefill_and_root(rid: str) -> Activation:
    return Activation(rid, t(0, 1, 2), committed=True, tokens=t(5, 9, 13))


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
        rounds = svc.rounds
        reads = DeviceReads([])
        try:
            for rid in ("a", "b"):
                await _open(svc, rid, "tcp://127.0.0.1:9")
                _add(svc, rid, 0, _prefill_and_root(rid))
            turns = [
                lambda rid: _add(svc, rid, 1, _layer(rid, (3, 3), (0, 1), (-1, -1), (7, 11))),
                lambda rid: (
                    svc._requests[rid].order.add_prune(1, Prune(t(), t(0, 1), horizon=1)),
                    _add(svc, rid, 2, _layer(rid, (4,), (2,), (0,), (4,)), after=1),
                ),
            ]
            for n in range(len(turns) + 1):
                if n == 1:  # storage allocated at the first forward: device memory from now
                    runtime = svc.runtime
                    reads = DeviceReads([*runtime.model.parameters(), runtime.pool.k,
                                         runtime.pool.v])  # fmt: skip
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
                assert all(isinstance(w.outputs[-1], list) for w in work)  # verified
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
                _add(svc, "r", 0, _prefill_and_root("r"))
                _until(lambda: len(ran) == 1)
                _add(svc, "r", 1, _layer("r", (3, 3), (0, 1), (-1, -1), (7, 11)))
                _until(lambda: len(ran) == 2)
                done.set()

            threading.Thread(target=feed, daemon=True).start()
            assert done.wait(30)  # blocks the event loop until both rounds ran
            assert out.empty()  # nothing delivered yet: the loop took no turn
            got = [await asyncio.wait_for(out.get(), 30) for _ in range(2)]
            assert all(f.header.kind == pb.PAYLOAD_KIND_VERIFIED for f in got)
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
