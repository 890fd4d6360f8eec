"""Credentials without a deployment (services/security.py, services/transport/auth.py): a
throwaway PKI, mutual TLS that refuses clients without a certificate of the deployment's
CA, and frame tags that a forger or a replay cannot pass."""

from __future__ import annotations

import asyncio
import stat

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from specpipe.services.security import (
    CA_FILE,
    DATA_KEY_FILE,
    KEY_FILE,
    Security,
    SecurityError,
    make_pki,
)
from specpipe.services.transport.auth import FrameAuth, FrameAuthError


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_throwaway_pki_files(pki, tmp_path) -> None:
    for name in (KEY_FILE, DATA_KEY_FILE):
        assert stat.S_IMODE((pki / name).stat().st_mode) == 0o600
    assert not list(pki.glob("ca.key"))  # the CA's key is not kept
    a, b = Security.load(pki), Security.load(pki)
    assert a.data_secret == b.data_secret and len(a.data_secret) == 32
    # Without data.key, the secret is derived from the (shared) TLS key: same for all.
    for name in (CA_FILE, "tls.crt", KEY_FILE):
        (tmp_path / name).write_bytes((pki / name).read_bytes())
    derived = Security.load(tmp_path)
    assert derived.data_secret == Security.load(tmp_path).data_secret != a.data_secret
    with pytest.raises(SecurityError, match=r"ca\.crt"):
        Security.load(tmp_path / "missing")
    (tmp_path / "short.key").write_text("abcd\n")
    with pytest.raises(SecurityError, match="fewer than"):
        Security.load(tmp_path, tmp_path / "short.key")


def test_frame_tags_verify_in_order_only() -> None:
    auth = FrameAuth(b"k" * 32)
    challenge = auth.challenge()
    tx, rx = auth.session(challenge), auth.session(challenge)
    payload = np.arange(1000, dtype=np.uint8)
    frames = [(b"header %d" % i, payload if i % 2 else None) for i in range(4)]
    tags = [tx.tag(h, p) for h, p in frames]
    for (h, p), t in zip(frames[:2], tags[:2], strict=True):
        rx.verify(h, p, t)
    with pytest.raises(FrameAuthError):  # a replay of frame 1 as frame 2
        rx.verify(*frames[1], tags[1])
    rx2 = auth.session(challenge)
    with pytest.raises(FrameAuthError):  # a changed payload byte
        bad = payload.copy()
        bad[7] ^= 1
        rx2.verify(frames[0][0], None, tags[0]) or rx2.verify(frames[1][0], bad, tags[1])
    other = auth.session(auth.challenge())  # another connection: another key
    with pytest.raises(FrameAuthError):
        other.verify(*frames[0], tags[0])
    forger = FrameAuth(b"x" * 32).session(challenge)
    with pytest.raises(FrameAuthError):
        auth.session(challenge).verify(frames[0][0], None, forger.tag(frames[0][0], None))
    rx3 = auth.session(challenge)
    rx3.skip()  # a frame dropped unread keeps the counters in step
    rx3.verify(*frames[1], tags[1])
    with pytest.raises(FrameAuthError):
        FrameAuth(b"short")


def test_mutual_tls_refuses_clients_without_a_deployment_certificate(pki, tmp_path) -> None:
    sec = Security.load(pki)
    stranger = Security.load(make_pki(tmp_path / "other"))

    async def main():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", sec.server_credentials())
        await server.start()
        target = f"127.0.0.1:{port}"

        async def check(channel) -> str:
            async with channel:
                stub = health_pb2_grpc.HealthStub(channel)
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                except grpc.aio.AioRpcError as e:
                    return e.code().name
                return "OK"

        try:
            ok = await check(
                grpc.aio.secure_channel(target, sec.channel_credentials(), sec.channel_options())
            )
            plain = await check(grpc.aio.insecure_channel(target))
            no_cert = await check(
                grpc.aio.secure_channel(
                    target, grpc.ssl_channel_credentials(sec.ca), sec.channel_options()
                )
            )
            other_ca = await check(
                grpc.aio.secure_channel(
                    target,
                    grpc.ssl_channel_credentials(sec.ca, stranger.key, stranger.cert),
                    sec.channel_options(),
                )
            )
            return ok, plain, no_cert, other_ca
        finally:
            await server.stop(None)

    ok, *refused = asyncio.run(main())
    assert ok == "OK"
    assert refused == ["UNAVAILABLE"] * 3, refused


def test_specpipe_certs_writes_a_secrets_files(tmp_path, capsys) -> None:
    from specpipe.cli import main

    assert main(["certs", str(tmp_path / "tls"), "--host", "10.0.0.7", "--days", "3"]) == 0
    sec = Security.load(tmp_path / "tls")
    assert len(sec.data_secret) == 32
    assert "kubectl create secret generic specpipe-internal-tls" in capsys.readouterr().out
