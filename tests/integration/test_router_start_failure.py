"""A request that fails while the router makes its controller or driver (after its
admission) keeps neither its running slot nor its tuning ticket: a leaked ticket would
mark every later request of another setting as mixed, and a leaked slot would shrink
the router's capacity for good."""

from __future__ import annotations

import asyncio

import pytest
from specpipe.services.router import engine as engine_module

from ..router_config import router_service
from .test_relayed_prunes_services import _request, _services
from .test_services_stalls import _tokens


def test_a_request_failing_after_admission_leaves_no_slot_and_no_ticket(
    llama_dir, monkeypatch
) -> None:
    real = engine_module.make_controller
    calls = []

    def fails_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("a controller that cannot be made")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "make_controller", fails_once)

    async def main() -> None:
        stages, draft = await _services(llama_dir)
        addrs = [f"127.0.0.1:{s.port}" for s in stages]
        router = router_service(addrs, f"127.0.0.1:{draft.port}")
        await router.start(startup_timeout=30)
        engine = router.engine
        try:
            with pytest.raises(RuntimeError, match="cannot be made"):
                [r async for r in engine.generate(_request("specpipe", 0.0, 0))]
            assert not engine.admission.scheduler.running
            assert all(
                not o.live and not o.tickets
                for o in (v.overlaps for v in engine.tuning.versions.values())
            )
            got = _tokens([r async for r in engine.generate(_request("specpipe", 0.0, 0))])
            assert len(got) == 16
            assert not engine.admission.scheduler.running
        finally:
            await router.stop()
            for svc in (*stages, draft):
                await svc.stop()

    asyncio.run(main())
