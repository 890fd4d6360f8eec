"""A stalled replica, and an unreachable next hop, with every service in one process
(issue 22: a SIGSTOPped stage replica stalled its stream 7.5 s before the request moved,
N14; a send to a next hop that could not complete hung the request with no error
reaching the router, N3).

A stalled replica is faked by a TCP proxy in front of its gRPC port that stops passing
bytes (what SIGSTOP looks like from the router: connections open, nothing answered). The
health monitor's own timeouts are set far beyond the test, so only the stall limit can
move the request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import grpc
import pytest
from specpipe.services.client import build_request
from specpipe.services.draft_service import DraftService
from specpipe.services.router.requests import RequestFailed
from specpipe.services.stage_service import StageService

from ..router_config import router_service
from .test_services_stage import _stage


class _Proxy:
    """Passes bytes between clients and `upstream` until `stall()`: then holds them."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream)
        self._writers += [w, uw]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(1 << 16):
                    await self.flowing.wait()
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(r, uw), pipe(ur, w))

    def stall(self) -> None:
        self.flowing.clear()

    async def close(self) -> None:
        self.flowing.set()
        for w in self._writers:
            w.close()
        if self.server is not None:
            self.server.close()


def _request(mode: str, n: int):
    return build_request(prompt_ids=[3, 4, 5], mode=mode, max_new_tokens=n, ignore_eos=True)


def _tokens(responses) -> list[int]:
    return [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]


@pytest.mark.parametrize("mode", ["pp", "specpipe"])
def test_a_stalled_replica_is_dead_for_its_requests_within_the_stall_limit(
    llama_dir, mode, caplog
) -> None:
    """Two replicas of the first stage behind proxies; the one a request runs on stops
    answering mid-stream: the request replays on the other within the stall limit (1 s
    here; the health monitor would need 90 s, the path watchdog 60 s) and its tokens
    are exactly those of an undisturbed run."""

    async def main() -> None:
        first = [StageService(_stage(llama_dir, 0, 2, 5)) for _ in range(2)]
        last = StageService(_stage(llama_dir, 2, 5, 5))
        draft = DraftService(llama_dir, "float64")
        ports = [await s.start() for s in (*first, last)]
        dport = await draft.start()
        proxies = [_Proxy(p) for p in ports[:2]]
        addrs = [await p.start() for p in proxies] + [f"127.0.0.1:{ports[2]}"]
        # The proxy stalls the gRPC port only (a SIGSTOPped process stalls its data
        # plane too): the feeds must go where it stalls them, on the control stream.
        router = router_service(addrs, f"127.0.0.1:{dport}", health_check_interval=0.2,
                                path_stall_seconds=60.0, replay_seconds=20.0,
                                replica_stall_seconds=1.0, no_control_frames=True)  # fmt: skip
        router.engine.backends.check_timeout = 30.0  # its own "down" would take 90 s
        await router.start(startup_timeout=30)
        try:
            reference = _tokens([r async for r in router.engine.generate(_request(mode, 40))])
            assert len(reference) == 40
            run = router.engine.generate(_request(mode, 40))
            got: list[int] = []
            while len(got) < 3:
                got += _tokens([await asyncio.wait_for(run.__anext__(), 30)])
            (driver,) = router.engine.drivers.values()
            on_path = driver.path.stages[0].address
            (victim,) = [p for p, a in zip(proxies, addrs, strict=False) if a == on_path]
            victim.stall()

            async def rest() -> list:
                return [r async for r in run]

            got += _tokens(await asyncio.wait_for(rest(), 30))
            assert got == reference
            assert len(driver.replay_seconds) == 1
            assert driver.path.stages[0].address != on_path
        finally:
            for p in proxies:
                await p.close()
            await router.stop()
            for svc in (*first, last, draft):
                await svc.stop()

    with caplog.at_level(logging.WARNING, logger="specpipe.services.router"):
        asyncio.run(main())
    assert any("stalled" in r.getMessage() for r in caplog.records)


def test_a_next_hop_that_does_not_accept_is_an_error_the_router_hears(llama_dir) -> None:
    """The last stage's data port stops accepting (a listener that never answers, as
    when its connection slots are held): the first stage's send fails within its
    handshake deadline, and the router fails the request UNAVAILABLE saying so, instead
    of the request hanging until the path watchdog."""

    async def main() -> None:
        stages = [StageService(_stage(llama_dir, a, b, 5)) for a, b in ((0, 2), (2, 5))]
        ports = [await s.start() for s in stages]
        router = router_service([f"127.0.0.1:{p}" for p in ports], None, health_check_interval=0.2,
                                path_stall_seconds=60.0, replay_seconds=1.0, max_replays=1)  # fmt: skip
        await router.start(startup_timeout=30)
        mute = socket.socket()
        try:
            stages[0].transport.handshake_seconds = 1.0
            # The last stage's data plane goes deaf at its address: its listener is
            # closed and a socket that never accepts takes the port.
            data_port = stages[1].transport.port
            stages[1].transport._server.close()
            await stages[1].transport._server.wait_closed()
            mute.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            mute.bind(("127.0.0.1", data_port))
            mute.listen(8)
            with pytest.raises(RequestFailed) as info:
                await asyncio.wait_for(
                    _drain(router.engine.generate(_request("pp", 8))), 30
                )  # not the watchdog's 60 s
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert "did not accept" in info.value.message, info.value.message
        finally:
            mute.close()
            await router.stop()
            for s in stages:
                await s.stop()

    asyncio.run(main())


async def _drain(run) -> list:
    return [r async for r in run]
