"""Router pieces that need no deployment: request ids, request defaults, and how much of
the client's deadline each backend call gets."""

from __future__ import annotations

import os
import re

from specpipe.services.router.requests import RequestIds


def test_request_ids_are_unguessable_capabilities(monkeypatch) -> None:
    """128 random bits each (no counter, no pid): one client's id says nothing about
    another's, and routers sharing stages never collide (every container's pid is 1)."""
    monkeypatch.setattr(os, "getpid", lambda: 1)
    routers = [RequestIds() for _ in range(20)]
    ids = [r.next() for r in routers for _ in range(50)]
    assert len(set(ids)) == len(ids)
    for rid in ids:
        assert re.fullmatch(r"[A-Za-z0-9_-]{22}", rid), rid  # 16 bytes, base64url
    # Consecutive ids of one router share no prefix beyond chance.
    r = RequestIds()
    a, b = r.next(), r.next()
    assert a[:6] != b[:6]


def _with_router(fn):
    """fn(router) for a router that knows its model (built in a running event loop, as
    gRPC's asyncio objects need one)."""

    async def call(router):
        return fn(router)

    return _with_router_async(call)


def test_router_defaults_are_the_engines() -> None:
    """A request that leaves width/top_k_children unset gets the engine's defaults
    (64 children per node, capped by the width), not a router-specific number."""
    from specpipe.common.spec.options import DecodeOptions
    from specpipe.services.client import build_request

    req = build_request(prompt_ids=[1, 2, 3], max_new_tokens=4)
    assert not req.HasField("top_k_children") and not req.HasField("width")
    opts = _with_router(lambda r: r.plan(req)).opts
    engine = DecodeOptions(max_new_tokens=4)
    assert opts.top_k_children == engine.top_k_children == 64
    assert opts.width == engine.width
    assert opts.depth == engine.depth
    assert opts.prefill_chunk == engine.prefill_chunk
    req = build_request(prompt_ids=[1], max_new_tokens=4, top_k_children=3)
    explicit = _with_router(lambda r: r.plan(req))
    assert explicit.opts.top_k_children == 3


def test_final_message_carries_regrowths_and_steady_rate_to_the_client() -> None:
    from types import SimpleNamespace

    from specpipe.common.spec.stats import DecodeStats
    from specpipe.services.client.common import Collector
    from specpipe.v1 import generation_pb2 as gen

    st = DecodeStats(mode="specpipe", stages=4, width=8, decode_steps=12, new_tokens=7)
    st.regrowths, st.emit_steps = 3, [4, 5, 6, 8, 9, 10, 12]  # 6 tokens in 8 steps
    driver = SimpleNamespace(stats=st, finish_reason="length", timing=lambda: (1.0, 2.0),
                             cached_tokens=16)  # fmt: skip
    finished = _with_router(lambda r: r._finished(driver, None, 5))
    assert finished.stats.regrowths == 3 and finished.stats.steady_tokens_per_step == 0.75
    assert finished.usage.cached_tokens == 16  # the prompt tokens the path had cached
    collector = Collector()
    collector.add(gen.GenerateResponse(finished=finished))
    done = collector.completion
    spec = done.speculation()
    assert {k: spec[k] for k in ("regrowths", "steady_tokens_per_step")} == {
        "regrowths": 3,
        "steady_tokens_per_step": 0.75,
    }
    assert spec["layers_per_step"] == 1  # one tree layer per step unless asked
    assert "regrowths" not in done.summary()  # the `generate --json` stats keys stay as they are


class _RecordingStub:
    """A stage stub that records the timeout of every call."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []
        self.fed = 0

    async def Open(self, request, timeout: float) -> None:
        self.timeouts.append(timeout)

    async def Feed(self, request, timeout: float) -> None:
        self.timeouts.append(timeout)

    def Control(self, requests):
        """The control stream: its feeds are counted (they have no timeout of their own:
        the stream outlives every request)."""
        from .router_fakes import FakeStreamCall

        async def handle(msg) -> None:
            self.fed += len(msg.feeds)

        return FakeStreamCall(requests, handle)


def _open_timeouts(deadline_in: float | None) -> list[float]:
    """Timeouts a request's first stage calls get, with the client's deadline that far off."""
    import asyncio
    import time
    from types import SimpleNamespace

    from specpipe.common.spec.controller import make_controller
    from specpipe.common.spec.options import DecodeOptions, Mode
    from specpipe.services.router.backends import RequestPath
    from specpipe.services.router.calls import NO_LEASE, Deadline
    from specpipe.services.router.control_stream import control_stream
    from specpipe.services.router.executor import CommandExecutor
    from specpipe.services.router.path_session import PathSession
    from specpipe.services.transport import Inbox

    stub = _RecordingStub()
    stages = []
    for i in range(2):
        control = control_stream("stage", stub, f"stage {i}")
        stages.append(SimpleNamespace(stub=stub, desc=SimpleNamespace(data_address=f"tcp://h:{i}"),
                                      active=0, version="h", control=control, label=f"stage {i}"))  # fmt: skip
    opts = DecodeOptions(max_new_tokens=4, prefill_chunk=2)
    controller = make_controller(Mode.PP, "r", [1, 2, 3, 4, 5], opts, 2)

    async def main() -> None:
        deadline = Deadline(None if deadline_in is None else time.monotonic() + deadline_in)
        path, events = RequestPath(stages, None), []
        session = PathSession(controller, None, path, "tcp://r:1", Inbox(), events.append, deadline)
        await session._open_stages(path)
        executor = CommandExecutor(path, "r", 1, events.append, deadline, NO_LEASE)
        for cmd in controller.start():
            executor.execute(cmd)
        for _ in range(20):
            await asyncio.sleep(0)
        assert events == []  # no call failed
        executor.stop()
        for s in stages:
            await s.control.close()

    asyncio.run(main())
    assert stub.fed == 3  # two prefill chunks and the root, on stage 1's control stream
    assert len(stub.timeouts) == 2  # Open on both stages
    return stub.timeouts


def test_backend_calls_get_the_rest_of_the_clients_deadline() -> None:
    assert all(0 < t <= 5.0 for t in _open_timeouts(5.0))
    # No client deadline: the cap; Open at most 10 s (a replica that cannot answer that
    # quickly is skipped for another path).
    assert _open_timeouts(None) == [10.0] * 2
    assert _open_timeouts(500.0) == [10.0] * 2
    assert all(t == 0.01 for t in _open_timeouts(-1.0))  # already past: fail fast


def test_modes_without_a_draft_run_while_the_draft_is_down() -> None:
    """pp and autoregressive never ask for a draft (specpipe and specinfer do, and go on
    without one when none is up: test_backends), so a dead draft never refuses them."""
    import grpc
    import pytest
    from specpipe.services.client import build_request
    from specpipe.services.router.backends import NoPath
    from specpipe.services.router.service import RequestFailed

    async def asked(router, mode):  # what the service asks the backends for, per mode
        seen = []

        def path(version=None, need_draft=True, exclude=(), prompt=(), cache_salt=b""):
            seen.append(need_draft)
            raise NoPath("none")

        router.backends.path = path
        agen = router.generate(build_request(prompt_ids=[1, 2], mode=mode, max_new_tokens=2))
        with pytest.raises(RequestFailed) as info:
            await agen.__anext__()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        return seen

    for mode, needs in (("pp", False), ("autoregressive", False), ("specpipe", True)):
        assert _with_router_async(lambda r, m=mode: asked(r, m)) == [needs]


def _with_router_async(fn):
    """await fn(router), for a router as in `_with_router`."""
    import asyncio

    from specpipe.services.router.backends import ModelInfo

    from ..router_config import router_engine

    async def main():
        svc = router_engine(["127.0.0.1:9"], "127.0.0.1:9")
        svc.model = ModelInfo("m", "h", num_layers=4, vocab_size=97, max_positions=256,
                              eos_token_ids=(96,), ranges=[(0, 4)])  # fmt: skip
        try:
            return await fn(svc)
        finally:
            await svc.backends.close()

    return asyncio.run(main())


def test_a_router_is_built_from_its_configuration_alone() -> None:
    """`specpipe router` builds the engine from its RouterConfig (and the live objects
    made from it): every setting lands where it acts, none is patched in afterwards; the
    gRPC front end holds that engine and takes its own settings from the same config."""
    import asyncio

    from specpipe.services.auth import ApiKeys
    from specpipe.services.config import RouterConfig, SchedulingConfig
    from specpipe.services.router.discovery import StaticDiscovery
    from specpipe.services.router.engine import RouterEngine
    from specpipe.services.router.service import RouterService

    config = RouterConfig(
        stages=("127.0.0.1:9",), path_stall_seconds=30.0, replica_stall_seconds=1.5,
        replay_seconds=4.0, max_replays=2, model_id="served", router_name="r1",
        health_check_interval=0.25, describe_internals=True, http_header_timeout=3.0,
        scheduling=SchedulingConfig(max_running=3, max_waiting=4, late_draft_wait_ms=2.5),
    )  # fmt: skip

    async def main():
        engine = RouterEngine(
            config, discovery=StaticDiscovery(list(config.stages), []), api_keys=ApiKeys()
        )
        svc = RouterService(engine)
        s = engine.driver_settings
        try:
            return (
                engine.backends.stall_seconds, s.stall_timeout, s.replay_timeout,
                s.max_replays, engine.model_id_override, engine.name, s.late_draft_wait,
                engine.scheduler.max_running, engine.scheduler.max_waiting,
                engine.backends.check_interval, svc.describe_internals,
                svc.limits.header_timeout, svc.engine is engine,
            )  # fmt: skip
        finally:
            await engine.backends.close()

    assert asyncio.run(main()) == (
        1.5, 30.0, 4.0, 2, "served", "r1", 0.0025, 3, 4, 0.25, True, 3.0, True
    )  # fmt: skip
