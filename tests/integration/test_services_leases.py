"""Leases and the router's watchdog, with every service in one process (issue 13: a
killed router's requests stayed on every stage and the draft forever; a request accepted
while a stage was frozen hung 60 s). Stages and the draft free a request whose router
stops renewing it, a restarted router frees its predecessor's requests at once, an idle
request is kept alive by the keep-alive, and the watchdog fails a request that makes no
progress."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

import grpc
import pytest
from specpipe.services.client import build_request
from specpipe.services.draft_service import DraftService
from specpipe.services.router.requests import RequestFailed
from specpipe.services.router.service import RouterService
from specpipe.services.stage_service import StageService
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, draft_pb2_grpc, stage_pb2, stage_pb2_grpc

from ..conftest import greedy_verify
from ..router_config import router_service
from .test_services_stage import _stage


class _FreezableStage(StageService):
    """A stage whose Open hangs once `frozen` is set (to an Event it then sets)."""

    frozen: asyncio.Event | None = None

    async def Open(self, request, context):
        if self.frozen is not None:
            self.frozen.set()
            await asyncio.sleep(60)
        return await super().Open(request, context)


async def _consume(run) -> list:
    return [r async for r in run]


@contextlib.asynccontextmanager
async def _services(llama_dir, lease: float):
    stages = [
        _FreezableStage(_stage(llama_dir, a, b, 5), lease_seconds=lease)
        for a, b in ((0, 2), (2, 5))
    ]
    draft = DraftService(llama_dir, "float64", lease_seconds=lease)
    ports = [await s.start() for s in stages]
    dport = await draft.start()
    try:
        yield stages, draft, [f"127.0.0.1:{p}" for p in ports], f"127.0.0.1:{dport}"
    finally:
        for svc in (*stages, draft):
            await svc.stop()


def _held(stages, draft) -> list[int]:
    return [len(s.leases) + len(s._requests) for s in stages] + [
        draft.runtime.runtime.info().active_requests + len(draft.leases)
    ]


async def _router(addresses, draft, **kw) -> RouterService:
    router = router_service(addresses, draft, health_check_interval=0.2, **kw)
    await router.start(startup_timeout=30)
    return router


async def _until(pred, seconds: float) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < seconds, "timed out"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def _abandon(router: RouterService) -> None:
    """What kill -9 does to a router, as its peers see it: no Release, no renewal."""
    router.engine.keepalive.stop()
    for task in router.engine.backends._tasks:  # the health monitor and discovery
        task.cancel()
    await router.engine.transport.close()
    await router.server.stop(None)


def _request(mode: str, n: int = 200):
    return build_request(prompt_ids=[3, 4, 5], mode=mode, max_new_tokens=n, ignore_eos=True)


def test_a_dead_routers_requests_expire_and_a_restarted_one_frees_them(llama_dir) -> None:
    async def main() -> None:
        async with _services(llama_dir, lease=1.0) as (stages, draft, addrs, daddr):
            router = await _router(addrs, daddr, router_name="router-a")
            runs = [router.engine.generate(_request(m)) for m in ("pp", "specpipe")]
            for run in runs:
                await run.__anext__()  # started
                await run.__anext__()  # a first token
            # open everywhere (the draft's runtime may open its request after the token)
            await _until(lambda: _held(stages, draft) == [4, 4, 2], 10)
            await _abandon(router)
            freed = await _until(lambda: not any(_held(stages, draft)), 10)
            assert freed < 4  # the 1 s lease, checked every 0.25 s

            # The same router name restarted: its predecessor's requests go at once.
            for s in (*stages, draft):
                s.leases.seconds = 600.0
            first = await _router(addrs, daddr, router_name="router-b")
            run = first.engine.generate(_request("specpipe"))
            await run.__anext__()
            await run.__anext__()
            await _abandon(first)
            # held (600 s leases now): CI once read the draft's [.., 1] right after the
            # first token, its runtime's open not yet counted
            await _until(lambda: _held(stages, draft) == [2, 2, 2], 10)
            t0 = time.monotonic()
            again = await _router(addrs, daddr, router_name="router-b")
            await _until(lambda: not any(_held(stages, draft)), 10)
            assert time.monotonic() - t0 < 5
            await again.stop()

    asyncio.run(main())


def test_the_keep_alive_holds_an_idle_request(llama_dir) -> None:
    """A client that reads slowly leaves its request without traffic; the router's
    keep-alive renews it (a third of the lease), so it completes."""

    async def main() -> None:
        async with _services(llama_dir, lease=0.6) as (stages, draft, addrs, daddr):
            router = await _router(addrs, daddr)
            try:
                assert router.engine.keepalive.interval() == pytest.approx(0.2)
                run = router.engine.generate(_request("specpipe", 12))
                got = [await run.__anext__(), await run.__anext__()]
                await asyncio.sleep(2.0)  # three leases without reading
                got += [r async for r in run]
                tokens = [t for r in got if r.HasField("delta") for t in r.delta.token_ids]
                assert len(tokens) == 12 and got[-1].finished.finish_reason == "length"
            finally:
                await router.stop()
            await _until(lambda: not any(_held(stages, draft)), 5)

    asyncio.run(main())


def test_renew_names_lost_requests_and_refuses_a_replaced_router(llama_dir) -> None:
    token, other = b"t" * 16, b"u" * 16

    async def main() -> None:
        async with _services(llama_dir, lease=60.0) as (stages, draft, addrs, daddr):
            async with grpc.aio.insecure_channel(addrs[0]) as ch:
                stub = stage_pb2_grpc.StageStub(ch)
                desc = await stub.Describe(pb.DescribeRequest())
                assert desc.lease_seconds == 60.0
                await stub.Open(stage_pb2.OpenStageRequest(verify=greedy_verify(),
                    request_id="a", capacity=16, next_hop="tcp://127.0.0.1:9",
                    lease_owner="r", lease_epoch=2, lease_token=token))  # fmt: skip
                resp = await stub.Renew(
                    pb.RenewRequest(owner="r", epoch=2, token=token, request_ids=["a", "lost"])
                )
                assert list(resp.unknown_ids) == ["lost"]
                with pytest.raises(grpc.aio.AioRpcError) as info:  # an older process
                    await stub.Renew(pb.RenewRequest(owner="r", epoch=1, token=other))
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                with pytest.raises(grpc.aio.AioRpcError) as info:  # not its token
                    await stub.Renew(pb.RenewRequest(owner="r", epoch=2, token=other))
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                for bad in (pb.RenewRequest(), pb.RenewRequest(owner="r", epoch=2)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:  # no owner, no token
                        await stub.Renew(bad)
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert len(stages[0]._requests) == 1
            open_draft = draft_pb2.OpenDraftRequest(
                request_id="d", capacity=16, prompt_ids=[1, 2], lease_owner="r", lease_epoch=2,
                lease_token=token,
            )  # fmt: skip
            async with grpc.aio.insecure_channel(daddr) as ch:
                d = draft_pb2_grpc.DraftStub(ch)
                await d.Open(open_draft)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await d.Open(open_draft)
                assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
                await d.Renew(pb.RenewRequest(owner="r", epoch=3, token=other))  # it restarted
                assert draft.runtime.runtime.info().active_requests == 0

    asyncio.run(main())


@contextlib.asynccontextmanager
async def _from_another_host(port: int):
    """A relay whose connections reach 127.0.0.1:`port` from 127.0.0.2: a caller on
    another host as a service sees it (its gRPC peer address), on loopback alone."""

    async def pipe(reader, writer) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def relay(reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection(
            "127.0.0.1", port, local_addr=("127.0.0.2", 0)
        )
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer),
                             return_exceptions=True)  # fmt: skip

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


def _tokens(responses) -> list[int]:
    return [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]


def test_a_renewal_from_elsewhere_frees_nothing(llama_dir) -> None:
    """Issue 22, N1: one unauthenticated Renew naming the router with the epoch "~x"
    (epochs compared as text) freed every request of the router on a stage: the request
    in flight failed, and later ones were refused ("epoch ... was replaced"). Without
    mutual TLS a lease owner is the router's name at the caller's host: a caller on
    another host naming the router with the largest epoch, and opening a request under
    its name, neither frees nor renews its requests; the request in flight completes
    with exactly the quiet run's tokens and later requests open."""

    async def main() -> None:
        async with _services(llama_dir, lease=60.0) as (stages, draft, addrs, daddr):
            router = await _router(addrs, daddr, router_name="router-a")
            try:
                quiet = _tokens(await _consume(router.engine.generate(_request("specpipe", 24))))
                run = router.engine.generate(_request("specpipe", 24))
                got = [await run.__anext__(), await run.__anext__()]  # open everywhere
                held = _held(stages, draft)
                wire_ids = [d.wire_id for d in router.engine.drivers.values()]
                forged = pb.RenewRequest(owner=router.engine.name, epoch=(1 << 64) - 1,
                                         token=b"x" * 16, request_ids=wire_ids)  # fmt: skip
                lease = dict(lease_owner=router.engine.name, lease_epoch=(1 << 64) - 1,
                             lease_token=b"x" * 16)  # fmt: skip
                for address, stub_of in [
                    *((a, stage_pb2_grpc.StageStub) for a in addrs),
                    (daddr, draft_pb2_grpc.DraftStub),
                ]:
                    async with (
                        _from_another_host(int(address.rpartition(":")[2])) as relay,
                        grpc.aio.insecure_channel(relay) as ch,
                    ):
                        stub = stub_of(ch)
                        renewed = await stub.Renew(forged)
                        assert list(renewed.unknown_ids) == wire_ids  # none of them is its
                        if stub_of is stage_pb2_grpc.StageStub:
                            await stub.Open(stage_pb2.OpenStageRequest(verify=greedy_verify(),
                                request_id="forged", capacity=16,
                                next_hop="tcp://127.0.0.1:9", **lease))  # fmt: skip
                        else:
                            await stub.Open(draft_pb2.OpenDraftRequest(
                                request_id="forged", capacity=16, prompt_ids=[1, 2], **lease))  # fmt: skip
                        await stub.Release(pb.RequestRef(request_id="forged"))
                assert _held(stages, draft) == held
                got += [r async for r in run]
                assert _tokens(got) == quiet and got[-1].finished.finish_reason == "length"
                assert (
                    _tokens(await _consume(router.engine.generate(_request("specpipe", 24))))
                    == quiet
                )
            finally:
                await router.stop()

    asyncio.run(main())


def test_the_watchdog_replays_a_request_that_makes_no_progress(llama_dir) -> None:
    """A path that sends nothing for the stall timeout (a stage frozen while its health
    check still answers) counts as lost: the request is replayed and, when that keeps
    happening, fails UNAVAILABLE with a message that says so. A request whose Open hangs
    on a frozen stage gives that path up as soon as the health monitor marks the stage
    down (and, with no other replica, fails UNAVAILABLE saying why)."""

    async def main() -> None:
        async with _services(llama_dir, lease=60.0) as (stages, _, addrs, daddr):
            router = await _router(addrs, daddr, path_stall_seconds=1.0, max_replays=1,
                                   replay_seconds=0.5)  # fmt: skip
            try:
                real = stages[1].rounds._launch
                stages[1].rounds._launch = lambda r: time.sleep(3) or real(r)
                with pytest.raises(RequestFailed) as info:
                    async for _ in router.engine.generate(_request("pp", 4)):
                        pass
                assert info.value.code == grpc.StatusCode.UNAVAILABLE
                assert "made no progress for 1 s" in info.value.message
                assert "given up after 1 replays" in info.value.message
                stages[1].rounds._launch = real

                engine = router.engine  # the second half: a path silent for 30 s is trusted
                engine.driver_settings = replace(engine.driver_settings, stall_timeout=30.0)
                stages[0].frozen = asyncio.Event()  # its Open now hangs
                run = asyncio.ensure_future(_consume(router.engine.generate(_request("pp", 4))))
                await asyncio.wait_for(stages[0].frozen.wait(), 10)
                (stage0,) = [b for b in router.engine.backends.stages if b.address == addrs[0]]
                router.engine._backend_down(stage0, "health check timed out")
                with pytest.raises(RequestFailed) as info:
                    await asyncio.wait_for(run, 5)  # not the Open's own 10 s
                assert info.value.code == grpc.StatusCode.UNAVAILABLE
                assert "went down" in info.value.message, info.value.message
            finally:
                await router.stop()

    asyncio.run(main())
