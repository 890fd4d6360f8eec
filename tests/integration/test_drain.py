"""A draining stage or draft waits only for the requests a router still drives (issue 22,
"Launcher": an idle service took about 30 s to stop on SIGTERM). Its leases shrink to
DRAIN_LEASE_SECONDS when the drain starts, and a live router renews its requests on a
draining replica every DRAIN_RENEW_SECONDS: a crashed router's requests end the drain
within seconds, while a live router's request that is quiet (its client reads slowly)
still finishes there."""

from __future__ import annotations

import asyncio

from specpipe.services.lease import DRAIN_LEASE_SECONDS

from .conftest import reference
from .test_services_leases import _abandon, _held, _request, _router, _services, _until

# Far longer than any drain these tests may take: a drain that waited for its end (what
# a crashed router's requests made it do) fails them by the deadline below.
DRAIN_SECONDS = 600.0
DEADLINE = 60.0


def test_a_draining_service_frees_a_crashed_routers_requests(llama_dir) -> None:
    async def main() -> None:
        async with _services(llama_dir, lease=60.0) as (stages, draft, addrs, daddr):
            router = await _router(addrs, daddr)
            run = router.engine.generate(_request("specpipe"))
            await run.__anext__()  # started
            await run.__anext__()  # a first token: open everywhere
            assert all(_held(stages, draft))
            await _abandon(router)  # kill -9: no Release, no renewal
            drains = [svc.drain(DRAIN_SECONDS) for svc in (*stages, draft)]
            await asyncio.wait_for(asyncio.gather(*drains), DEADLINE)
            assert _held(stages, draft) == [0, 0, 0]

    asyncio.run(main())


def test_a_live_routers_quiet_request_finishes_on_a_draining_stage(llama_dir) -> None:
    """The client reads nothing for twice the drain lease (the request sends nothing
    meanwhile); the router's renewals keep it on the draining stage, where it finishes
    with plain decoding's tokens, and the drain then ends."""
    n = 40

    async def main() -> list[int]:
        async with _services(llama_dir, lease=60.0) as (stages, _draft, addrs, daddr):
            router = await _router(addrs, daddr)
            try:
                run = router.engine.generate(_request("pp", n))
                got = [await run.__anext__(), await run.__anext__()]
                drain = asyncio.ensure_future(stages[1].drain(DRAIN_SECONDS))
                await _until(lambda: any(b.draining for b in router.engine.backends.all), 10)
                await asyncio.sleep(2 * DRAIN_LEASE_SECONDS)
                assert not drain.done()  # it waits for the request
                got += [r async for r in run]
                await asyncio.wait_for(drain, DEADLINE)
            finally:
                await router.stop()
            return [t for r in got if r.HasField("delta") for t in r.delta.token_ids]

    tokens = asyncio.run(main())
    assert tokens == reference(llama_dir, "oracle", 2, [3, 4, 5], "pp", n)
