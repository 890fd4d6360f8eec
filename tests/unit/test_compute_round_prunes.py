"""A stage's prunes without rounds of their own (services/compute_round.py): a prune
that arrives with no turn of its request due does not wake the compute thread and is
applied first by the request's next round, with the same outputs as in a round of its
own; one that a waiting activation needs wakes it; while the KV pool is short of
blocks a prune is applied at once, so the blocks it drops are free for admission."""

from __future__ import annotations

import asyncio

import torch
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime.loader import LoadedModel
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation, Prune
from specpipe.services.control import prune_to_proto
from specpipe.services.stage_service import StageService
from specpipe.services.transport import Frame, encode
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import stage_pb2

DTYPE = torch.float64
WIDTH = 48  # the tiny llama's hidden size
PROMPT = 8


def _middle_stage(llama_dir) -> StageService:
    model = load_stage(llama_dir, LayerRange(1, 3, 5), DTYPE)
    return StageService(LoadedModel(StageRuntime(model), "m", "h", 256, ()))


def _hidden(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, WIDTH, dtype=DTYPE, generator=torch.Generator().manual_seed(seed))


def _layer(seq: int, after_prune: int) -> Frame:
    """Request "a"'s tree layer `seq`: a root and three rows below it (node ids 4 per
    layer), created after `after_prune` prunes."""
    t, node, pos = torch.tensor, 4 * seq, PROMPT + seq - 1
    act = Activation(
        "a",
        t([pos, pos + 1, pos + 1, pos + 2]),
        node_ids=torch.arange(node, node + 4),
        parent_ids=t([-1, node, node, node + 1]),
        hidden=_hidden(4, seq),
    )
    return Frame(*encode(act, seq, after_prune))


def _prune(seq: int) -> pb.PruneRequest:
    """Prune `seq`: layer `seq`'s root committed, the rest of that layer dropped."""
    node = 4 * seq
    prune = Prune(torch.tensor([node]), torch.tensor([], dtype=torch.long), node + 3)
    return pb.PruneRequest(request_id="a", prune=prune_to_proto(prune, seq))


async def _prefilled(svc: StageService) -> None:
    await svc.Open(stage_pb2.OpenStageRequest(
        request_id="a", capacity=64, next_hop="tcp://127.0.0.1:9"), None)  # fmt: skip
    prompt = Activation("a", torch.arange(PROMPT), committed=True, hidden=_hidden(PROMPT, 99))
    svc._on_frame(Frame(*encode(prompt, 0)))
    svc.rounds.compute(svc.rounds._collect())
    svc._on_frame(_layer(1, 0))
    svc.rounds.compute(svc.rounds._collect())


def _counting_wakes(svc: StageService) -> list[int]:
    wakes: list[int] = []
    svc.rounds.inbox.wake = lambda: wakes.append(1)  # type: ignore[method-assign]
    return wakes


def _hold(svc: StageService) -> float | None:
    with svc.rounds.inbox:
        return svc.rounds._hold()


def test_a_prune_with_no_turn_due_waits_for_the_next_round_with_the_same_outputs(
    llama_dir,
) -> None:
    async def main() -> None:
        deferred, apart = _middle_stage(llama_dir), _middle_stage(llama_dir)
        try:
            for svc in (deferred, apart):
                await _prefilled(svc)
            wakes = _counting_wakes(deferred)
            assert deferred._take_prune(_prune(1)) is None
            order = deferred._requests["a"].order
            assert wakes == [] and _hold(deferred) is None  # no round for it alone
            assert order.applied == 0 and 1 in order.prunes
            deferred._on_frame(_layer(2, 1))
            assert wakes == [1] and _hold(deferred) == 0.0
            (work,) = deferred.rounds._collect()
            assert [s for s, _ in work.prunes] == [1] and [s for s, _ in work.turns] == [2]
            deferred.rounds.compute([work])
            assert order.applied == 1 and work.error is None

            # the same prune in a round of its own, then the layer (as before)
            assert apart._take_prune(_prune(1)) is None
            (alone,) = apart.rounds._collect(turns=False)
            assert alone.turns == []
            apart.rounds.compute([alone])
            apart._on_frame(_layer(2, 1))
            (ref,) = apart.rounds._collect()
            assert ref.prunes == []
            apart.rounds.compute([ref])

            ((out,),) = [w.outputs for w in (work,)]
            ((expected,),) = [w.outputs for w in (ref,)]
            assert torch.equal(out.hidden, expected.hidden)
            assert torch.equal(out.node_ids, expected.node_ids)
            caches = [s.runtime._caches["a"] for s in (deferred, apart)]
            assert caches[0].n_committed == caches[1].n_committed == PROMPT + 1
        finally:
            await deferred.stop()
            await apart.stop()

    asyncio.run(main())


def test_a_prune_that_a_waiting_activation_needs_wakes_the_compute_thread(llama_dir) -> None:
    async def main() -> None:
        svc = _middle_stage(llama_dir)
        try:
            await _prefilled(svc)
            wakes = _counting_wakes(svc)
            svc._on_frame(_layer(2, 1))  # arrives before the prune it was created after
            assert _hold(svc) is None and len(wakes) == 1
            assert svc._take_prune(_prune(1)) is None
            assert len(wakes) == 2 and _hold(svc) == 0.0
        finally:
            await svc.stop()

    asyncio.run(main())


def test_a_prune_is_applied_at_once_while_the_pool_is_short_of_blocks(llama_dir) -> None:
    async def main() -> None:
        svc = _middle_stage(llama_dir)
        try:
            await _prefilled(svc)
            pool = svc.runtime.pool
            pool.max_blocks = pool.used_blocks  # no block free: a new request is refused
            wakes = _counting_wakes(svc)
            assert svc._take_prune(_prune(1)) is None
            assert wakes == [1] and _hold(svc) == 0.0
            (work,) = svc.rounds._collect(turns=False)
            assert [s for s, _ in work.prunes] == [1] and work.turns == []
            svc.rounds.compute([work])
            assert work.error is None and pool.free_blocks >= 1  # the layer's block is back
            await svc.Open(stage_pb2.OpenStageRequest(
                request_id="b", capacity=64, next_hop="tcp://127.0.0.1:9"), None)  # fmt: skip
            assert "b" in svc._requests
        finally:
            await svc.stop()

    asyncio.run(main())
