"""The router's admission between API keys (issue 35, F2), without a deployment: a
waiting request refused to make room for another key's fails RESOURCE_EXHAUSTED, the
freed slot goes to the key running fewest, and a request's n choices are checked up
front (a draining router says so first)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from specpipe.common.spec.options import Mode
from specpipe.services.auth import ApiKeys
from specpipe.services.router.engine import RouterEngine
from specpipe.services.router.requests import RequestFailed

from ..router_config import router_engine

PLAN = SimpleNamespace(mode=Mode.PP, opts=SimpleNamespace(width=1, depth=1))


def _router(api_keys: ApiKeys | None = None, **scheduling) -> RouterEngine:
    return router_engine(["127.0.0.1:9"], api_keys=api_keys, scheduling=scheduling)


def test_a_bumped_waiting_request_fails_resource_exhausted() -> None:
    async def main():
        router = _router(max_running=1, max_waiting=2, max_waiting_per_key=2)
        try:
            await router.admission.admit("a0", PLAN, 0, None, "key:a")
            a1 = asyncio.ensure_future(router.admission.admit("a1", PLAN, 0, None, "key:a"))
            a2 = asyncio.ensure_future(router.admission.admit("a2", PLAN, 0, None, "key:a"))
            await asyncio.sleep(0)
            b1 = asyncio.ensure_future(router.admission.admit("b1", PLAN, 0, None, "key:b"))
            await asyncio.sleep(0)
            with pytest.raises(RequestFailed) as info:
                await a2  # the newest of the key queueing most
            router.admission.leave("a0")
            await asyncio.sleep(0.05)
            ran = [t.done() for t in (a1, b1)]
            router.admission.leave("a1" if a1.done() else "b1")
            await asyncio.wait_for(asyncio.gather(a1, b1), 5)
            return info.value.code, ran
        finally:
            await router.backends.close()
            router._tokenizing.shutdown()

    code, ran = asyncio.run(main())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ran.count(True) == 1


def test_n_choices_are_checked_up_front_after_draining() -> None:
    asyncio.run(_check_room())


async def _check_room() -> None:
    router = _router(max_running=8, max_waiting=8, api_keys=ApiKeys(["k"]))
    try:
        caller = router.api_keys.caller("Bearer k")
        router.check_room(caller, 1)
        router.check_room(caller, 15)  # 7 running + 8 waiting
        with pytest.raises(RequestFailed) as info:
            router.check_room(caller, 16)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "16 choices" in info.value.message
        router.draining = True
        with pytest.raises(RequestFailed) as info:
            router.check_room(caller, 2)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        await router.backends.close()
        router._tokenizing.shutdown()
