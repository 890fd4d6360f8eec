"""Both transports deliver frames intact and in order on loopback, to the inbox of the
right request, and report an unreachable peer as a TransportError."""

from __future__ import annotations

import asyncio

import pytest
import torch
from specpipe.common.spec.messages import Activation
from specpipe.services.transport import Inbox, TransportError, decode, make_transport

KINDS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(
    not __import__("specpipe.services.transport.ucx", fromlist=["available"]).available(),
    reason="ucxx not installed"))]  # fmt: skip


def _act(rid: str, n: int, seed: int) -> Activation:
    g = torch.Generator().manual_seed(seed)
    return Activation(
        rid,
        positions=torch.arange(n) + 5,
        node_ids=torch.arange(n) + 100,
        parent_ids=torch.arange(n) + 99,
        hidden=torch.randn(n, 1536, generator=g),
    )


@pytest.mark.parametrize("kind", KINDS)
def test_frames_arrive_intact_in_order_per_request(kind: str) -> None:
    async def main() -> None:
        inbox = Inbox()
        qa, qb = inbox.open("a"), inbox.open("b")
        rx = make_transport(kind, inbox)
        tx = make_transport(kind, lambda f: None)
        addr = await rx.start()
        await tx.start()
        assert addr.startswith(f"{kind}://127.0.0.1:")
        try:
            sizes = [1, 64, 0, 16, 300]
            for i, n in enumerate(sizes):
                await tx.send(addr, _act("a", n, i), seq=i, after_prune=i // 2)
                await tx.send(addr, _act("b", 2, 100 + i), seq=i)
            await tx.send(addr, _act("gone", 3, 0), seq=0)  # unknown request: dropped
            for i, n in enumerate(sizes):
                fa = await asyncio.wait_for(qa.get(), 10)
                assert fa.header.seq == i and fa.header.after_prune == i // 2
                got = decode(fa)
                if n:
                    assert torch.equal(got.hidden, _act("a", n, i).hidden)
                assert len(got) == n
                fb = await asyncio.wait_for(qb.get(), 10)
                assert fb.header.seq == i and torch.equal(
                    decode(fb).hidden, _act("b", 2, 100 + i).hidden
                )
            await asyncio.sleep(0.05)
            assert inbox.dropped == 1
        finally:
            await tx.close()
            await rx.close()

    asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_unreachable_peer_is_a_transport_error(kind: str) -> None:
    import socket

    async def main() -> None:
        tx = make_transport(kind, lambda f: None)
        await tx.start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # closed again: nobody listens there
        try:
            with pytest.raises(TransportError):
                await asyncio.wait_for(
                    tx.send(f"{kind}://127.0.0.1:{port}", _act("a", 1, 0), 0), 20
                )
            with pytest.raises(TransportError, match="transport is"):
                other = "tcp" if kind == "ucx" else "ucx"
                await tx.send(f"{other}://127.0.0.1:{port}", _act("a", 1, 0), 0)
        finally:
            await tx.close()

    asyncio.run(main())
