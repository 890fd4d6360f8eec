"""No peer can hold a data-plane receiver or sender (issue 22, N3), and a frame's header
has no effect before its tags verify (N10).

N3 as probed: 1024 connections each sending a byte every 5 s were held forever (the
frame deadline counted from the last byte), and the next request that needed a new
connection hung 45 s with no error reaching the router. Here, with short deadlines set
by the test: a dripping frame is closed by its deadline from its first byte, a
connection that never begins a frame by the handshake deadline, one peer's half-open
connections do not shut out another peer, and a sender learns at once (TransportError)
that a receiver did not accept its connection or did not take its frame. N10: a header
whose tag does not verify never reaches the owner's `admit` (which may fail a request
because of it) and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import struct
import threading
import time

import pytest
import torch
from specpipe.common.spec.messages import Activation
from specpipe.services.transport import Inbox, TransportError, decode, make_transport
from specpipe.services.transport.auth import FrameAuth
from specpipe.services.transport.codec import encode, payload_bytes

UCX = pytest.param(
    "ucx",
    marks=pytest.mark.skipif(
        not __import__("specpipe.services.transport.ucx", fromlist=["available"]).available(),
        reason="ucxx not installed",
    ),
)
KINDS = ["tcp", UCX]
ATTACKER = "127.0.0.2"  # another peer address on loopback (all of 127/8 is local)


def _act(rid: str, n: int, seed: int = 0, width: int = 8) -> Activation:
    g = torch.Generator().manual_seed(seed)
    return Activation(rid, positions=torch.arange(n), node_ids=torch.arange(n),
                      parent_ids=torch.full((n,), -1), hidden=torch.randn(n, width, generator=g))  # fmt: skip


def _plain_frame(rid: str, n: int) -> bytes:
    header, payload = encode(_act(rid, n), seq=0)
    hb = header.SerializeToString()
    data = payload_bytes(payload).tobytes()
    return struct.pack("<IQ", len(hb), len(data)) + hb + data


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _closed(s: socket.socket) -> bool:
    """Whether the receiver closed `s` (anything it sent, its hello, is read past)."""
    while select.select([s], [], [], 0)[0]:
        try:
            if not s.recv(4096):
                return True
        except ConnectionError:
            return True
    return False


def _closed_within(s: socket.socket, seconds: float) -> float | None:
    """Seconds until the receiver closed `s`, or None if it did not within `seconds`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if _closed(s):
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


async def _in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _run(kind: str, scenario: str, *args) -> None:
    """Run `scenario(kind, *args)`: in this process for TCP; for UCX in a fresh one
    (ucxx binds its progress to the first event loop of a process)."""
    if kind == "tcp":
        asyncio.run(globals()[scenario](kind, *args))
        return
    import subprocess
    import sys
    from pathlib import Path

    code = (
        f"import asyncio; from tests.unit.test_transport_limits import {scenario} as s; "
        f"asyncio.run(s({kind!r}, *{args!r}))"
    )
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]


# -- N3: deadlines ---------------------------------------------------------------------------


def test_a_dripping_frame_is_closed_by_its_deadline_from_its_first_byte() -> None:
    """One byte every 0.2 s never leaves the connection quiet for long, but the frame
    it belongs to is still incomplete 1 s after its first byte: closed then."""

    def drip(port: int) -> float | None:
        s = _connect(port)
        t0 = time.monotonic()
        try:
            for b in _plain_frame("a", 4):  # a whole frame, far too slowly
                if _closed(s):
                    return time.monotonic() - t0
                with contextlib.suppress(OSError):
                    s.send(bytes([b]))
                time.sleep(0.2)
                if time.monotonic() - t0 > 10:
                    return None
            return None
        finally:
            s.close()

    async def main() -> None:
        inbox = Inbox()
        q = inbox.open("a")
        rx = make_transport("tcp", inbox, admit=inbox.admit)
        rx.frame_seconds, rx.handshake_seconds, rx.check_every = 1.0, 5.0, 0.05
        await rx.start()
        try:
            closed_after = await _in_thread(drip, rx.port)
            assert closed_after is not None, "a dripping frame was held past its deadline"
            assert closed_after >= 0.9  # it was the frame deadline, not something sooner
            assert q.empty()
            await asyncio.sleep(0.1)
            assert len(rx._slots) == 0
        finally:
            await rx.close()

    asyncio.run(main())


def test_a_connection_that_never_begins_a_frame_is_closed_by_the_handshake_deadline() -> None:
    async def main() -> None:
        rx = make_transport("tcp", lambda f: None)
        rx.frame_seconds, rx.handshake_seconds, rx.check_every = 60.0, 0.5, 0.05
        await rx.start()
        try:
            silent = _connect(rx.port)
            assert await _in_thread(_closed_within, silent, 10) is not None
            silent.close()
        finally:
            await rx.close()

    asyncio.run(main())


# -- N3: half-open connections per peer ------------------------------------------------------


def test_one_peers_half_open_connections_do_not_shut_out_another() -> None:
    """40 connections from one address that send a byte and stop: that address keeps
    at most its 4 half-open slots (its oldest make way for its newest), and a real
    sender from another address (the router, the previous stage), and a real frame from
    the same address, get through. With every slot held by connections that delivered a
    frame, a newcomer is refused."""

    async def main() -> None:
        inbox = Inbox()
        q = inbox.open("a")
        rx = make_transport("tcp", inbox, admit=inbox.admit, max_connections=16,
                            max_half_open_per_peer=4)  # fmt: skip
        rx.check_every = 0.05
        addr = await rx.start()
        tx = make_transport("tcp", lambda f: None)
        attackers: list[socket.socket] = []
        try:
            for _ in range(40):
                s = _connect(rx.port, ATTACKER)
                s.send(b"\x01")  # a frame begun, never finished
                attackers.append(s)
            await asyncio.sleep(0.3)
            assert rx._slots.half_open(ATTACKER) <= 4
            held = [s for s in attackers if not await _in_thread(_closed, s)]
            assert 1 <= len(held) <= 4
            for i in range(3):
                await asyncio.wait_for(tx.send(addr, _act("a", 2, i), seq=i), 10)
            for i in range(3):
                assert (await asyncio.wait_for(q.get(), 10)).header.seq == i
            same = _connect(rx.port, ATTACKER)  # a real peer behind the same address
            same.sendall(_plain_frame("a", 3))
            assert len(decode(await asyncio.wait_for(q.get(), 10))) == 3

            for s in attackers:
                s.close()
            await asyncio.sleep(0.2)
            established = [same]
            while len(rx._slots) < 16:  # fill every slot with connections past a frame
                s = _connect(rx.port, "127.0.0.3")
                s.sendall(_plain_frame("gone", 1))
                established.append(s)
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            assert rx._slots.half_open() == 0
            newcomer = _connect(rx.port, "127.0.0.4")
            assert await _in_thread(_closed_within, newcomer, 5) is not None
            assert rx._slots.refused >= 1
            for s in [*established, newcomer]:
                s.close()
        finally:
            for s in attackers:
                s.close()
            await tx.close()
            await rx.close()

    asyncio.run(main())


# -- N3: a sender is told -----------------------------------------------------------------


def test_a_sender_is_told_when_its_frame_cannot_be_delivered() -> None:
    """A listener that never accepts (its backlog takes the connection, nobody answers),
    a receiver with every slot taken, and a receiver that accepts but never reads: each
    is a TransportError within the deadlines, not a frame lost in a socket buffer."""

    async def main() -> None:
        tx = make_transport("tcp", lambda f: None)
        tx.handshake_seconds, tx.frame_seconds = 0.5, 1.0
        mute = socket.socket()
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)  # never accepted
        try:
            with pytest.raises(TransportError, match="did not accept"):
                await asyncio.wait_for(
                    tx.send(f"tcp://127.0.0.1:{mute.getsockname()[1]}", _act("a", 1), 0), 10
                )

            full = make_transport("tcp", lambda f: None, max_connections=1)
            await full.start()
            holder = _connect(full.port)
            holder.sendall(_plain_frame("gone", 1))  # established: it keeps its slot
            await asyncio.sleep(0.2)
            with pytest.raises(TransportError, match="did not accept"):
                await asyncio.wait_for(tx.send(full.address, _act("a", 1), 0), 10)
            holder.close()
            await full.close()

            stop = threading.Event()
            port = await _in_thread(_start_deaf_receiver, stop)
            big = _act("a", 4096, width=4096)  # 64 MiB: more than the socket buffers hold
            with pytest.raises(TransportError, match="did not take a frame"):
                await asyncio.wait_for(tx.send(f"tcp://127.0.0.1:{port}", big, 0), 20)
            stop.set()
        finally:
            mute.close()
            await tx.close()

    asyncio.run(main())


def _start_deaf_receiver(stop: threading.Event) -> int:
    """A receiver that answers the hello and then reads nothing; its port."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.sendall(FrameAuth.challenge())
        stop.wait(30)
        conn.close()
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


async def ucx_limits_scenario(kind: str) -> None:
    """The UCX listener: half-open endpoints make way for newer ones (so a real sender
    gets through), and silent endpoints and endpoints whose frame never completes are
    closed by the deadlines."""
    import numpy as np
    from specpipe.services.transport.ucx import _ucxx

    inbox = Inbox()
    q = inbox.open("a")
    rx = make_transport(kind, inbox, admit=inbox.admit, max_half_open_per_peer=3)
    rx.handshake_seconds, rx.frame_seconds = 60.0, 1.0
    addr = await rx.start()
    ucxx = _ucxx()
    tx = make_transport(kind, lambda f: None)

    async def until_held(n: int) -> None:
        deadline = time.monotonic() + 15
        while len(rx._slots) != n:
            assert time.monotonic() < deadline, f"{len(rx._slots)} endpoints held, not {n}"
            await asyncio.sleep(0.05)

    try:
        silent = [await ucxx.create_endpoint("127.0.0.1", rx.port) for _ in range(8)]
        deadline = time.monotonic() + 15
        while rx._slots.evicted < 5:  # the oldest made way for the newest
            assert time.monotonic() < deadline, f"{rx._slots.evicted} evicted"
            await asyncio.sleep(0.05)
        await until_held(3)
        for i in range(2):
            await asyncio.wait_for(tx.send(addr, _act("a", 2, i), seq=i), 20)
        for i in range(2):
            assert (await asyncio.wait_for(q.get(), 20)).header.seq == i
        for ep in silent:
            with contextlib.suppress(Exception):
                await ep.close()
        await until_held(1)  # the real sender's

        rx.handshake_seconds = 0.5
        late = [await ucxx.create_endpoint("127.0.0.1", rx.port) for _ in range(2)]
        stuck = await ucxx.create_endpoint("127.0.0.1", rx.port)
        await stuck.send(np.array([10, 100], dtype=np.uint64))  # a header that never comes
        await until_held(1)  # closed by the handshake and the frame deadlines
        await tx.send(addr, _act("a", 2, 9), seq=9)
        assert (await asyncio.wait_for(q.get(), 20)).header.seq == 9
        for ep in [*late, stuck]:
            with contextlib.suppress(Exception):
                await ep.close()
    finally:
        await tx.close()
        await rx.close()


@pytest.mark.parametrize("kind", [UCX])
def test_ucx_endpoints_are_bounded_like_tcp_connections(kind: str) -> None:
    _run(kind, "ucx_limits_scenario")


# -- N10: nothing of an unauthenticated header ------------------------------------------------


async def forged_header_scenario(kind: str) -> None:
    """A frame for a known request with another key's tags (and a header the owner would
    fail the request for: more rows than it takes, attacker's text as its sender) never
    reaches `admit` and leaves the request as it was; the real peer's frames arrive."""
    key, other = FrameAuth(b"k" * 32), FrameAuth(b"x" * 32)
    inbox = Inbox()
    q = inbox.open("victim", max_rows=2)
    seen: list[str] = []

    def admit(h) -> bool:
        seen.append(h.sender)
        return inbox.admit(h)

    rx = make_transport(kind, inbox, auth=key, admit=admit)
    addr = await rx.start()
    forger = make_transport(kind, lambda f: None, auth=other)
    good = make_transport(kind, lambda f: None, auth=key)
    try:
        with contextlib.suppress(TransportError, TimeoutError):
            await asyncio.wait_for(
                forger.send(addr, _act("victim", 5), seq=0, sender="ATTACKER TEXT"), 10
            )
        await asyncio.sleep(0.3)
        assert seen == [] and q.empty()
        await good.send(addr, _act("victim", 2), seq=1, sender="stage")
        f = await asyncio.wait_for(q.get(), 10)
        assert f.header.seq == 1 and f.header.sender == "stage" and seen == ["stage"]
    finally:
        for t in (forger, good, rx):
            await t.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_header_with_bad_tags_changes_nothing(kind: str) -> None:
    _run(kind, "forged_header_scenario")


def test_a_tcp_header_is_checked_before_its_payload_is_read() -> None:
    """Raw bytes: a challenge-less forger's header for a known request, with more rows
    than the request takes, followed by junk where the tags go: the connection is
    closed and the request is not failed (before: it got the forger's error text)."""

    async def main() -> None:
        key = FrameAuth(b"k" * 32)
        inbox = Inbox()
        q = inbox.open("victim", max_rows=2)
        rx = make_transport("tcp", inbox, auth=key, admit=inbox.admit)
        rx.check_every = 0.05
        await rx.start()
        try:
            s = _connect(rx.port)
            header, payload = encode(_act("victim", 5), seq=0, sender="ATTACKER TEXT")
            hb = header.SerializeToString()
            data = payload_bytes(payload).tobytes()
            s.sendall(struct.pack("<IQ", len(hb), len(data)) + hb + b"\0" * 32 + data)
            assert await _in_thread(_closed_within, s, 5) is not None
            s.close()
            await asyncio.sleep(0.1)
            assert q.empty() and inbox.dropped == 0
        finally:
            await rx.close()

    asyncio.run(main())


def test_request_ids_are_not_logged_above_debug(caplog) -> None:
    """Request ids are capabilities (docs/architecture.md, "9. Security"): a frame whose
    handling fails is logged without its request id except at DEBUG."""
    import logging

    async def main() -> None:
        def broken(frame) -> None:
            raise RuntimeError("owner failed")

        rx = make_transport("tcp", broken)
        addr = await rx.start()
        tx = make_transport("tcp", lambda f: None)
        try:
            await tx.send(addr, _act("secret-id-123", 1), seq=0)
            await asyncio.sleep(0.3)
        finally:
            await tx.close()
            await rx.close()

    with caplog.at_level(logging.DEBUG, logger="specpipe.services.transport"):
        asyncio.run(main())
    assert any("owner failed" in r.getMessage() for r in caplog.records)
    for r in caplog.records:
        if "secret-id-123" in r.getMessage():
            assert r.levelno <= logging.DEBUG, r.getMessage()


def test_slots_evict_the_oldest_half_open_and_refuse_only_when_all_are_established() -> None:
    from specpipe.services.transport.admission import ConnectionSlots

    slots: ConnectionSlots[str] = ConnectionSlots(max_connections=4, max_half_open_per_peer=2)
    assert slots.open("a1", "A") == [] and slots.open("a2", "A") == []
    assert slots.open("a3", "A") == ["a1"]  # A's own oldest makes way
    assert slots.open("b1", "B") == [] and slots.open("c1", "C") == []
    assert len(slots) == 4 and slots.half_open("A") == 2
    assert slots.open("d1", "D") == ["a2"]  # every slot taken: the oldest half-open
    for c in ("a3", "b1", "c1", "d1"):
        slots.established(c)
    assert slots.half_open() == 0
    assert slots.open("e1", "E") is None and slots.refused == 1  # nothing may go
    slots.closed("b1")
    assert slots.open("e1", "E") == [] and len(slots) == 4
