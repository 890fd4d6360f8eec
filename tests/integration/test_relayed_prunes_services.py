"""Relayed prunes through the services, every service in one process (3 stages and the
target as its own draft): where every stage relays them the router sends a request's
prunes to stage 1 only, and the tokens are exactly those of prunes sent to every stage,
in every decoding mode; a stage that does not relay them (an older version) makes the
router send them to every stage; a control stream reset mid-request (the request
replayed under a new id) stays exact and leaves no request and no KV block behind on
any stage; a request a later stage lost is replayed as soon as its relayed prunes reach
that stage; an Open after the first stage gets the room of relayed prunes still
upstream. (Every other integration test runs with relay on too: it is the default.)"""

from __future__ import annotations

import asyncio

import pytest
import torch
from specpipe.common.spec.messages import Activation, Prune
from specpipe.services.client.common import build_request
from specpipe.services.control import prune_to_proto, rows_to_proto
from specpipe.services.draft_service import DraftService
from specpipe.services.stage_service import StageService
from specpipe.services.transport import Inbox, make_transport
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import stage_pb2

from ..router_config import router_service
from .test_control_streams import _reset
from .test_services_alignment import _samples
from .test_services_stage import _stage
from .test_services_stalls import _Proxy, _tokens

RANGES = ((0, 2), (2, 4), (4, 5))
CASES = [("specpipe", 0.0, 0), ("specpipe", 0.9, 7), ("specinfer", 0.0, 0), ("pp", 0.9, 3)]


def _request(mode: str, temperature: float, seed: int, n: int = 16):
    return build_request(prompt_ids=[3, 4, 5, 9], mode=mode, max_new_tokens=n, ignore_eos=True,
                         temperature=temperature, seed=seed)  # fmt: skip


def _prune_calls(svc: StageService) -> int:
    """Prune signals the stage took from a router (not those relayed on frames)."""
    return int(_samples(svc)["specpipe:stage_prunes_per_call_sum"])


def _holds_nothing(svc: StageService) -> bool:
    pool = svc.runtime.pool
    return not svc._requests and pool.used_blocks == pool.cached_blocks


async def _served(stages, draft, cases, **router_kw) -> list[list[int]]:
    """Each case's tokens through a router of its own over the running services."""
    addrs = [f"127.0.0.1:{s.port}" for s in stages]
    router = router_service(addrs, f"127.0.0.1:{draft.port}", **router_kw)
    await router.start(startup_timeout=30)
    try:
        return [
            _tokens([r async for r in router.engine.generate(_request(*case))]) for case in cases
        ]
    finally:
        await router.stop()


async def _services(llama_dir) -> tuple[list[StageService], DraftService]:
    stages = [StageService(_stage(llama_dir, a, b, 5)) for a, b in RANGES]
    draft = DraftService(llama_dir, "float64")
    for svc in (*stages, draft):
        svc.port = await svc.start()
    return stages, draft


async def _wait_empty(stages: list[StageService]) -> None:
    for _ in range(200):  # releases are answered before the blocks' round ends
        if all(_holds_nothing(s) for s in stages):
            return
        await asyncio.sleep(0.02)
    raise AssertionError([(len(s._requests), s.runtime.pool.used_blocks) for s in stages])


def test_relayed_prunes_reach_every_stage_from_the_first_and_are_exact(llama_dir) -> None:
    async def main() -> None:
        stages, draft = await _services(llama_dir)
        try:
            broadcast = await _served(stages, draft, CASES, no_relay_prunes=True)
            sent = [_prune_calls(s) for s in stages]
            assert min(sent) > 0 and len(set(sent)) == 1  # every prune to every stage
            relayed = await _served(stages, draft, CASES)
            assert relayed == broadcast
            assert all(len(t) == 16 for t in relayed)
            more = [_prune_calls(s) - n for s, n in zip(stages, sent, strict=True)]
            assert more[0] > 0 and more[1:] == [0, 0]  # the router's prunes: stage 1 only
            await _wait_empty(stages)
        finally:
            for svc in (*stages, draft):
                await svc.stop()

    asyncio.run(main())


def test_a_stage_that_does_not_relay_prunes_gets_them_from_the_router(llama_dir) -> None:
    async def main() -> None:
        stages, draft = await _services(llama_dir)
        older = stages[1]
        describe = older._describe

        def without_relay():
            desc = describe()
            desc.relay_prunes = False
            return desc

        older._describe = without_relay  # type: ignore[method-assign]
        try:
            relayed_before = await _served(stages, draft, CASES[:1])
            sent = [_prune_calls(s) for s in stages]
            assert min(sent) > 0 and len(set(sent)) == 1  # broadcast: the path has an older stage
            older._describe = describe  # type: ignore[method-assign]
            assert await _served(stages, draft, CASES[:1]) == relayed_before
            await _wait_empty(stages)
        finally:
            for svc in (*stages, draft):
                await svc.stop()

    asyncio.run(main())


@pytest.mark.parametrize("victim", [1, 2])
def test_a_reset_mid_request_with_relayed_prunes_replays_exactly_and_leaks_nothing(
    llama_dir, victim
) -> None:
    """The router's connection to a stage reset mid-request: the request is replayed
    under a new id (its copy released everywhere, relayed prunes in flight with it
    dropped as frames of a released request), exactly, and no stage keeps a row of it."""

    async def main() -> None:
        stages, draft = await _services(llama_dir)
        proxies = [_Proxy(s.port) for s in stages]
        addrs = [await p.start() for p in proxies]
        router = router_service(addrs, f"127.0.0.1:{draft.port}", health_check_interval=0.2,
                                path_stall_seconds=60.0, replay_seconds=20.0)  # fmt: skip
        await router.start(startup_timeout=30)
        try:
            reference = _tokens(
                [r async for r in router.engine.generate(_request("specpipe", 0.0, 0, 40))]
            )
            run = router.engine.generate(_request("specpipe", 0.0, 0, 40))
            got: list[int] = []
            while len(got) < 3:
                got += _tokens([await asyncio.wait_for(run.__anext__(), 30)])
            (driver,) = router.engine.drivers.values()
            assert driver.session.executor.relay and _prune_calls(stages[victim]) == 0
            _reset(proxies[victim])

            async def rest() -> list:
                return [r async for r in run]

            got += _tokens(await asyncio.wait_for(rest(), 60))
            assert got == reference and len(driver.replay_seconds) == 1
            await _wait_empty(stages)
        finally:
            for p in proxies:
                await p.close()
            await router.stop()
            for svc in (*stages, draft):
                await svc.stop()

    asyncio.run(main())


@pytest.mark.parametrize("victim", [1, 2])
def test_a_request_a_later_stage_lost_is_replayed_at_once_and_exactly(
    llama_dir, victim, caplog
) -> None:
    """A stage after the first loses a request mid-request (its lease expired there):
    the router sends it nothing with relay on, but the next relayed prunes that reach
    it make it tell the router (NOT_FOUND), which replays the request then, exactly, not
    after its path stalls (60 s here) or its keep-alive (every 20 s) finds it lost."""

    async def main() -> None:
        stages, draft = await _services(llama_dir)
        addrs = [f"127.0.0.1:{s.port}" for s in stages]
        router = router_service(addrs, f"127.0.0.1:{draft.port}", path_stall_seconds=60.0,
                                replay_seconds=20.0)  # fmt: skip
        await router.start(startup_timeout=30)
        try:
            reference = _tokens(
                [r async for r in router.engine.generate(_request("specpipe", 0.0, 0, 40))]
            )
            run = router.engine.generate(_request("specpipe", 0.0, 0, 40))
            got: list[int] = []
            while len(got) < 3:
                got += _tokens([await asyncio.wait_for(run.__anext__(), 30)])
            (driver,) = router.engine.drivers.values()
            assert driver.session.executor.relay
            lost = stages[victim]
            await lost._expire(driver.wire_id)  # what its lease's end does

            async def rest() -> list:
                return [r async for r in run]

            got += _tokens(await asyncio.wait_for(rest(), 30))
            assert got == reference and len(driver.replay_seconds) == 1
            (why,) = [r.getMessage() for r in caplog.records if "replaying" in r.getMessage()]
            assert f"is not open on {lost.name}" in why
            await _wait_empty(stages)
        finally:
            await router.stop()
            for svc in (*stages, draft):
                await svc.stop()

    caplog.set_level("WARNING", logger="specpipe.services.router.driver")
    asyncio.run(main())


class _Refused(Exception):
    pass


class _Context:
    """What a handler's `context.abort` does, without gRPC: raises what refused it."""

    async def abort(self, code, message: str):
        raise _Refused(code, message)


async def _until(check, what: str) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


@pytest.mark.parametrize("ranges", [((0, 2), (2, 4)), ((0, 1), (1, 2), (2, 4))])
def test_an_open_after_the_first_stage_gets_the_room_of_prunes_still_upstream(
    llama_dir, ranges
) -> None:
    """Request a's relayed prune waits at stage 1 (no turn of a is due there), and the
    later stage's pool has no free block but the one that prune frees there. Request b
    is opened on every stage at once, as a router opens a path: stage 1 passes its
    waiting prune on, to be applied at once at every stage after it (`prunes_now`: a
    stage between, with room, would otherwise keep it until a's next turn), and the
    short stage's Open waits for it, instead of refusing b (RESOURCE_EXHAUSTED) while
    the room it needs is on its way."""

    async def main() -> None:
        inbox = Inbox()
        sink = make_transport("tcp", inbox)
        router = await sink.start()
        stages = [StageService(_stage(llama_dir, a, b, 5)) for a, b in ranges]
        for svc in stages:
            await svc.start()
        hops = [s.transport.address for s in stages[1:]] + [router]
        first, short = stages[0], stages[-1]

        async def open_everywhere(rid: str) -> None:
            await asyncio.gather(*(
                svc.Open(stage_pb2.OpenStageRequest(request_id=rid, capacity=64, next_hop=hop,
                                                    report_to=router), _Context())
                for svc, hop in zip(stages, hops, strict=True)
            ))  # fmt: skip

        try:
            await open_everywhere("a")
            t = torch.tensor
            prompt = Activation("a", torch.arange(8), committed=True)
            layer = Activation(
                "a", t([8, 9, 9, 10]), node_ids=t([4, 5, 6, 7]), parent_ids=t([-1, 4, 4, 5])
            )
            for seq, act in enumerate((prompt, layer)):
                feed = stage_pb2.FeedRequest(request_id="a", seq=seq, rows=rows_to_proto(act),
                                             token_ids=[3] * len(act))  # fmt: skip
                assert first._take_feed(feed) is None
            # a's rows in the short stage's cache (taken from its order is not yet: the
            # round that took them may not have allocated their blocks)
            await _until(lambda: short.runtime._caches["a"].num_tree_rows == 4, "a's rows")
            pool = short.runtime.pool
            pool.max_blocks = pool.used_blocks  # full: only a's prune frees a block here
            prune = Prune(t([4]), t([], dtype=torch.long), 7)
            relayed = pb.PruneRequest(request_id="a", prune=prune_to_proto(prune, 1), relay=True)
            assert first._take_prune(relayed) is None
            assert first._requests["a"].order.applied == 0  # waits for a's next turn there
            await open_everywhere("b")
            assert "b" in short._requests
            assert [s._requests["a"].order.applied for s in stages] == [1] * len(stages)
        finally:
            for svc in stages:
                await svc.stop()
            await sink.close()

    asyncio.run(main())
