"""The router's control streams (services/router/control_stream.py) broken mid-request,
every service in one process: the connection to a stage reset (the stream breaks, the
stage lives on) replays the request on the other replica of that stage, and its tokens
are exactly an undisturbed run's; the draft's reset makes the request go on without it,
exactly too. A killed stage or draft process: tests/integration/test_elastic.py."""

from __future__ import annotations

import asyncio

import pytest
from specpipe.services.draft_service import DraftService
from specpipe.services.stage_service import StageService

from ..router_config import router_service
from .test_services_stage import _stage
from .test_services_stalls import _Proxy, _request, _tokens


def _reset(proxy: _Proxy) -> None:
    """Every connection through the proxy reset (RST): new ones pass again."""
    writers, proxy._writers = proxy._writers, []
    for w in writers:
        w.transport.abort()


@pytest.mark.parametrize("victim", ["stage1", "draft"])
def test_a_control_stream_reset_mid_request_replays_it_exactly(llama_dir, victim) -> None:
    async def main() -> None:
        ranges = ((0, 2), (2, 5), (2, 5))  # two replicas of the last stage
        stages = [StageService(_stage(llama_dir, a, b, 5)) for a, b in ranges]
        draft = DraftService(llama_dir, "float64")
        ports = [await s.start() for s in (*stages, draft)]
        proxies = [_Proxy(p) for p in ports]
        addrs = [await p.start() for p in proxies]
        router = router_service(addrs[:3], addrs[3], health_check_interval=0.2,
                                path_stall_seconds=60.0, replay_seconds=20.0)  # fmt: skip
        await router.start(startup_timeout=30)
        try:
            reference = _tokens([r async for r in router.engine.generate(_request("specpipe", 40))])
            assert len(reference) == 40
            run = router.engine.generate(_request("specpipe", 40))
            got: list[int] = []
            while len(got) < 3:
                got += _tokens([await asyncio.wait_for(run.__anext__(), 30)])
            (driver,) = router.engine.drivers.values()
            on_path = [addrs.index(b.address) for b in driver.path.backends]
            # one stream per replica on the path so far, for both requests
            assert {b.control.opened for b in driver.path.backends} == {1}
            _reset(proxies[on_path[1] if victim == "stage1" else 3])

            async def rest() -> list:
                return [r async for r in run]

            got += _tokens(await asyncio.wait_for(rest(), 60))
            assert got == reference
            if victim == "draft":
                # a Propose in flight fails (the request goes on without the draft);
                # with none in flight, the next call takes a new stream
                assert driver.stats.draft_drops <= 1 and not driver.replay_seconds
            else:
                assert len(driver.replay_seconds) == 1
                assert addrs.index(driver.path.stages[1].address) != on_path[1]
        finally:
            for p in proxies:
                await p.close()
            await router.stop()
            for svc in (*stages, draft):
                await svc.stop()

    asyncio.run(main())
