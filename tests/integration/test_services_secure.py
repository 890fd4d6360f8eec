"""The --secure planes with every service in one process (issue 13, "What was found"):
unauthenticated calls to stages and the draft are refused, Configure is off unless
allowed, forged VERIFIED and ERROR frames for a victim's request id (learnt from its
`Started`) change nothing, next hops are checked, and generation through mutual TLS and
authenticated frames gives the engine's tokens."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from specpipe.common.spec.messages import Verified
from specpipe.services.client import build_request
from specpipe.services.control import verified_to_proto
from specpipe.services.draft_service import DraftService
from specpipe.services.security import Security, make_pki
from specpipe.services.stage_service import StageService
from specpipe.services.transport import make_transport
from specpipe.services.transport.auth import FrameAuth
from specpipe.services.transport.codec import Kind, error_header
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, draft_pb2_grpc, stage_pb2, stage_pb2_grpc

from ..conftest import greedy_verify
from ..router_config import router_service
from .conftest import reference
from .test_services_stage import _stage

Code = grpc.StatusCode


@pytest.fixture(scope="module")
def security(tmp_path_factory) -> Security:
    return Security.load(make_pki(tmp_path_factory.mktemp("pki")))


@contextlib.asynccontextmanager
async def _secure(llama_dir, security: Security):
    stages = [
        StageService(_stage(llama_dir, a, b, 5), security=security) for a, b in ((0, 2), (2, 5))
    ]
    draft = DraftService(llama_dir, "float64", security=security)
    ports = [await s.start() for s in stages]
    dport = await draft.start()
    addrs = [f"127.0.0.1:{p}" for p in ports]
    router = router_service(
        addrs, f"127.0.0.1:{dport}", security=security, health_check_interval=0.2
    )
    await router.start(startup_timeout=30)
    try:
        yield router, stages, draft, addrs, f"127.0.0.1:{dport}"
    finally:
        await router.stop()
        for svc in (*stages, draft):
            await svc.stop()


async def _code(call) -> Code:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    return Code.OK


def test_secure_generation_and_forged_frames(llama_dir, security) -> None:
    prompt = [3, 14, 15]

    async def main():
        async with _secure(llama_dir, security) as (router, *_):
            outputs = {}
            for mode in ("pp", "specpipe"):
                run = router.engine.generate(build_request(prompt_ids=prompt, mode=mode,
                                                    max_new_tokens=12, ignore_eos=True))  # fmt: skip
                started = await run.__anext__()
                rid = started.started.request_id
                await _forge(router.engine.transport.address, rid)
                tokens = []
                async for r in run:
                    if r.HasField("delta"):
                        tokens += r.delta.token_ids
                outputs[mode] = tokens
            return outputs

    outputs = asyncio.run(main())
    for mode, tokens in outputs.items():
        assert tokens == reference(llama_dir, "oracle", 2, prompt, mode, 12), mode


async def _forge(address: str, rid: str) -> None:
    """What an attacker on the network sends the router for a request id it learnt: a
    VERIFIED frame drawing token 7 at the root, and an ERROR frame, without the
    deployment's secret (none, and a wrong one)."""
    forged = pb.FrameHeader(
        request_id=rid, kind=Kind.PAYLOAD_KIND_VERIFIED, sender="evil",
        verified=verified_to_proto(Verified(rid, (0,), (7,), 3)),
    )  # fmt: skip
    for auth in (None, FrameAuth(b"guess" * 8)):
        tx = make_transport("tcp", lambda f: None, auth=auth)
        try:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(tx.send_frame(address, forged), 5)
                await asyncio.wait_for(
                    tx.send_frame(address, error_header(rid, "attacker's message", "evil")), 5
                )
        finally:
            await tx.close()
    await asyncio.sleep(0.1)


def test_unauthenticated_calls_are_refused(llama_dir, security, tmp_path) -> None:
    """Without a certificate of the deployment's CA no call reaches a stage or the draft
    (Configure, Open with any next hop, Release and Prune of another user's request,
    enumerating ids with Open); Configure stays off even for the deployment itself;
    probes still get health on the plaintext health port."""
    stranger = Security.load(make_pki(tmp_path / "other"))

    async def main():
        async with _secure(llama_dir, security) as (_, _, _, addrs, daddr):
            calls = {
                "Configure": lambda s: s.Configure(stage_pb2.ConfigureStageRequest(model_path="/x")),
                "Open": lambda s: s.Open(stage_pb2.OpenStageRequest(verify=greedy_verify(),
                    request_id="r", capacity=8, next_hop="tcp://10.9.9.9:80")),
                "Release": lambda s: s.Release(pb.RequestRef(request_id="r")),
                "Prune": lambda s: s.Prune(pb.PruneRequest(request_id="r")),
                "Describe": lambda s: s.Describe(pb.DescribeRequest()),
            }  # fmt: skip
            channels = {
                "plaintext": grpc.aio.insecure_channel(addrs[0]),
                "another CA": grpc.aio.secure_channel(
                    addrs[0], stranger.channel_credentials(), stranger.channel_options()
                ),
            }
            refused = {}
            for kind, ch in channels.items():
                stub = stage_pb2_grpc.StageStub(ch)
                for name, call in calls.items():
                    refused[(kind, name)] = await _code(call(stub))
                await ch.close()
            async with grpc.aio.insecure_channel(daddr) as ch:
                open_draft = draft_pb2.OpenDraftRequest(request_id="r", capacity=8, prompt_ids=[1])
                refused[("plaintext", "Draft.Open")] = await _code(
                    draft_pb2_grpc.DraftStub(ch).Open(open_draft)
                )
            async with grpc.aio.secure_channel(
                addrs[0], security.channel_credentials(), security.channel_options()
            ) as ch:
                stub = stage_pb2_grpc.StageStub(ch)
                own = await _code(stub.Configure(stage_pb2.ConfigureStageRequest(model_path="/x")))
                assert (await stub.Describe(pb.DescribeRequest())).ready
            return refused, own

    refused, own = asyncio.run(main())
    assert set(refused.values()) == {Code.UNAVAILABLE}, refused
    assert own == Code.PERMISSION_DENIED


def test_plaintext_health_port_for_probes(llama_dir, security) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]

    async def main():
        svc = StageService(_stage(llama_dir, 0, 5, 5), security=security)
        await svc.start(health_port=free)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{free}") as ch:
                resp = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=5
                )
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
                # Health alone: no Stage service there.
                code = await _code(stage_pb2_grpc.StageStub(ch).Describe(pb.DescribeRequest()))
                assert code == Code.UNIMPLEMENTED
        finally:
            await svc.stop()

    asyncio.run(main())


def test_next_hops_only_to_known_peers(llama_dir) -> None:
    async def main():
        svc = StageService(_stage(llama_dir, 0, 5, 5), peers=["10.0.0.5"])
        port = await svc.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = stage_pb2_grpc.StageStub(ch)

                def open_(hop: str, report: str = ""):
                    return stub.Open(stage_pb2.OpenStageRequest(verify=greedy_verify(),
                        request_id=hop + report, capacity=8, next_hop=hop, report_to=report))  # fmt: skip

                assert await _code(open_("tcp://10.0.0.5:7000")) == Code.OK
                assert await _code(open_("tcp://127.0.0.1:22")) == Code.INVALID_ARGUMENT
                bad_report = open_("tcp://10.0.0.5:7000", "tcp://192.0.2.1:1")
                assert await _code(bad_report) == Code.INVALID_ARGUMENT
        finally:
            await svc.stop()

    asyncio.run(main())


def test_public_tls_on_grpc_and_http(security, tmp_path) -> None:
    """--public-tls-cert/--public-tls-key: the router's public gRPC and HTTP ports speak
    TLS; the SDK trusts a CA file (tls=PATH); plaintext clients get nowhere."""
    import json
    import ssl
    import urllib.request

    from specpipe.services.router.http_api import HttpServer
    from specpipe.services.security import PublicTls

    from specpipe.client import AsyncClient

    pki = make_pki(tmp_path / "public", hosts=["127.0.0.1"])
    tls = PublicTls.load(pki / "tls.crt", pki / "tls.key")

    def get(url: str) -> int:
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        try:
            with urllib.request.urlopen(url, timeout=5, context=ctx) as r:
                return r.status
        except urllib.error.HTTPError as e:
            json.loads(e.read())
            return e.code

    async def main():
        router = router_service(["127.0.0.1:9"], public_tls=tls)
        port = await router.server.start("127.0.0.1", 0)
        http = HttpServer(router.engine)
        hport = await http.start("127.0.0.1", 0, tls)
        try:
            async with AsyncClient(f"127.0.0.1:{port}", timeout=5, tls=pki / "ca.crt") as c:
                assert await c.list_models() == []  # still starting: no model yet
            async with AsyncClient(f"127.0.0.1:{port}", timeout=3) as c:
                with pytest.raises(Exception, match="UNAVAILABLE"):
                    await c.list_models()
            status = await asyncio.to_thread(get, f"https://127.0.0.1:{hport}/health")
            assert status == 503  # starting; but it answered over TLS
            with pytest.raises((urllib.error.URLError, ConnectionError)):
                await asyncio.to_thread(
                    urllib.request.urlopen, f"http://127.0.0.1:{hport}/health", None, 3
                )
        finally:
            await http.stop()
            await router.server.stop(None)
            await router.engine.backends.close()

    asyncio.run(main())
