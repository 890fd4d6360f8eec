"""Fallback data plane for hosts without UCX: frames over plain asyncio TCP streams.

Same framing as UCX: preamble, protobuf header, raw payload; with `--secure`, the
header's tag right after the header and the payload's tag after the payload (`auth.py`).
The receiver answers every connection it accepts with a 16-byte hello (the challenge
with `--secure`) and reads through a staging buffer of `STAGING_BYTES` (a
`BufferedProtocol`): one read takes every small part of a frame, and of the frames
behind it, at once (a frame read part by part cost a read and a turn of the event loop
per part: five for a step's small frame). A payload of at least `STAGING_BYTES` still to
come is read straight into the buffer allocated for it, so a large payload's bytes are
copied once, from the socket; only frames its owner admitted (see `base.py`) are kept,
others are read past. A sender writes a frame of at most `JOIN_BYTES` (preamble, header,
payload and tags) as one buffer: one send, one TCP segment.

Connections are bounded (`base.py`, `admission.py`): at most `max_connections` inbound
at once and `max_half_open_per_peer` of them per peer address without a complete frame
yet (the oldest half-open one goes first), a new connection must begin a frame within
`handshake_seconds`, a frame must be complete within `frame_seconds` of its first byte,
and a connection idle for `idle_seconds` is closed. Senders wait for the hello at most
`handshake_seconds` and for a frame to be taken at most `frame_seconds`; they notice a
connection the peer closed (it restarted, or closed it idle) before they write and open
a new one, and retry a frame once on a fresh connection when a write on a cached one
fails, so a peer's restart costs no request.

One module: a connection's bytes leave from the event loop (buffered writes, reconnects)
or from a stage's compute thread (`send_now`), and both keep one order under one lock
over one state (the buffer, the secure tags' sequence, whether the connection is
stale); split, each half would hold invariants only the other can keep.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from specpipe.v1 import dataplane_pb2 as pb
from torch import Tensor

from . import batch
from .admission import ConnectionSlots
from .auth import (
    CHALLENGE_BYTES,
    HEADER_TAG_BYTES,
    PAYLOAD_TAG_BYTES,
    FrameAuth,
    FrameAuthError,
    FrameMac,
)
from .base import Transport, TransportError, log, rlog
from .codec import (
    PREAMBLE,
    Frame,
    FrameError,
    framed_bytes,
    parse_header,
    parse_preamble,
    payload_bytes,
    tensor_from_bytes,
)

STAGING_BYTES = 1 << 16  # the receiver's reads of small parts, several frames at once
JOIN_BYTES = 1 << 16  # a frame's payload up to this is joined with its header: one send
SEND_NOW_BYTES = 1 << 20  # `send_now`'s frames up to this many bytes together, else the loop's

PREAMBLE_, HEADER, PAYLOAD, TAGS = range(4)


class _FrameReader(asyncio.BufferedProtocol):
    """Reassembles frames from a byte stream: preamble, header [+ tag], payload,
    [payload tag], repeat; and keeps the connection's deadlines."""

    def __init__(self, transport: TcpTransport) -> None:
        self.owner = transport
        self._transport: asyncio.Transport | None = None
        self._mac: FrameMac | None = None
        self._staging: memoryview | None = None
        self._direct = False  # the last read went straight into the part's buffer
        self._frames = 0
        self._opened = self._last_frame = time.monotonic()
        self._frame_started: float | None = None  # the first byte of the frame being read
        self._timer: asyncio.TimerHandle | None = None
        self._preamble = np.empty(PREAMBLE.size, dtype=np.uint8)  # parsed at once: reused
        self._new_frame()

    def _new_frame(self) -> None:
        self._stage = PREAMBLE_
        self._expect(self._preamble)
        self._plen = 0
        self._header: pb.FrameHeader | None = None
        self._hbytes = b""
        self._payload: np.ndarray | None = None
        self._keep = True
        self._frame_started = None

    def _expect(self, buf: np.ndarray, discard: int = 0) -> None:
        """Read into `buf`; or, with `discard`, read past that many bytes."""
        self._buf, self._view, self._filled = buf, memoryview(buf).cast("B"), 0
        self._discard = discard

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        owner = self.owner
        peer = transport.get_extra_info("peername")
        if not owner._accept(self, str(peer[0]) if peer else ""):
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        challenge = FrameAuth.challenge()  # the hello: "accepted"
        if owner.auth is not None:
            self._mac = owner.auth.session(challenge)
        transport.write(challenge)  # type: ignore[attr-defined]
        self._arm()

    def close(self, why: str) -> None:
        """Close the connection (it broke a limit or a rule); `why` is logged."""
        rlog.warning("tcp-close", "tcp: closing a connection: %s", why)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.owner._slots.closed(self)
        if self._transport is not None:
            self._transport.close()

    def _arm(self) -> None:
        if self.owner.check_every > 0:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.owner.check_every, self._check_deadlines)

    def _check_deadlines(self) -> None:
        self._timer = None
        if self._transport is None or self._transport.is_closing():
            return
        owner, now = self.owner, time.monotonic()
        if self._frame_started is not None:
            if now - self._frame_started > owner.frame_seconds:
                self.close(f"a frame not complete {owner.frame_seconds:g} s after its first byte")
                return
        elif self._frames == 0:
            if now - self._opened > owner.handshake_seconds:
                self.close(f"no frame within {owner.handshake_seconds:g} s of connecting")
                return
        elif now - self._last_frame > owner.idle_seconds:
            self.close(f"idle for {owner.idle_seconds:g} s")
            return
        self._arm()

    def get_buffer(self, sizehint: int) -> memoryview:
        rest = len(self._buf) - self._filled
        self._direct = not self._discard and rest >= STAGING_BYTES
        if self._direct:  # a large payload: straight into its buffer
            return self._view[self._filled :]
        if self._staging is None:
            self._staging = memoryview(bytearray(STAGING_BYTES))
        return self._staging

    def buffer_updated(self, nbytes: int) -> None:
        try:
            with self.owner.gather:  # the frames of this read delivered, then the owner told
                if self._direct:
                    self._filled += nbytes
                    self._take(memoryview(b""))
                else:
                    assert self._staging is not None
                    self._take(self._staging[:nbytes])
        except (FrameError, FrameAuthError) as e:
            self.close(f"dropping it: {e}")

    def _take(self, data: memoryview) -> None:
        """Bytes read: into the parts they complete, each complete part acted on (the next
        part set up, a complete frame delivered), until `data` is used up."""
        at, n = 0, len(data)
        while True:
            if at < n and self._stage == PREAMBLE_ and not self._filled:
                end = self._whole(data, at)
                if end is not None:
                    at = end
                    continue
            size = self._discard or len(self._buf)
            take = min(size - self._filled, n - at)
            if take:
                if self._frame_started is None:
                    self._frame_started = time.monotonic()
                if not self._discard:
                    self._view[self._filled : self._filled + take] = data[at : at + take]
                self._filled += take
                at += take
            if self._filled < size:
                return
            self._advance()

    def _whole(self, data: memoryview, at: int) -> int | None:
        """A frame that lies whole in `data` from `at` (most frames: one read takes a
        small frame, and the frames behind it): checked and delivered from the read's
        bytes in one pass, with no buffer per part and only a kept payload copied. Its
        end; None where it does not lie whole there (it is read part by part)."""
        if len(data) - at < PREAMBLE.size:
            return None
        hlen, plen = self._preamble_of(data[at : at + PREAMBLE.size])
        mac = self._mac
        h = at + PREAMBLE.size
        p = h + hlen + (HEADER_TAG_BYTES if mac is not None else 0)
        end = p + plen + (PAYLOAD_TAG_BYTES if mac is not None else 0)
        if end > len(data):
            return None
        hbytes = bytes(data[h : h + hlen])
        if mac is not None:  # authentic before it has any effect
            mac.check_header(hbytes, data[h + hlen : p])
        header = parse_header(hbytes, plen)
        keep = self.owner._admitted(header)
        payload = np.array(data[p : p + plen], dtype=np.uint8) if keep and plen else None
        if mac is not None:
            if keep:
                mac.check_payload(payload, data[p + plen : end])
            else:
                mac.skip_payload()
        self._complete(header, payload, keep)
        return end

    def _preamble_of(self, data) -> tuple[int, int]:
        """(header, payload) lengths a preamble announces, within the owner's limits."""
        hlen, plen = parse_preamble(data)
        limit = self.owner.max_payload_bytes
        if plen > limit:
            raise FrameError(f"a frame announces {plen} payload bytes; at most {limit}")
        return hlen, plen

    def _advance(self) -> None:
        """A part of the frame is complete: set up the next one (or deliver the frame)."""
        owner = self.owner
        if self._stage == PREAMBLE_:
            hlen, self._plen = self._preamble_of(bytes(self._buf))
            self._stage = HEADER
            tag = HEADER_TAG_BYTES if self._mac is not None else 0
            self._expect(np.empty(hlen + tag, dtype=np.uint8))
            return
        if self._stage == HEADER:
            raw = self._buf.tobytes()
            if self._mac is not None:  # authentic before it has any effect
                self._hbytes = raw[:-HEADER_TAG_BYTES]
                self._mac.check_header(self._hbytes, raw[-HEADER_TAG_BYTES:])
            else:
                self._hbytes = raw
            self._header = parse_header(self._hbytes, self._plen)
            self._keep = owner._admitted(self._header)
            self._stage = PAYLOAD
            if not self._keep:
                self._expect(np.empty(0, dtype=np.uint8), discard=self._plen)
            else:
                self._expect(np.empty(self._plen, dtype=np.uint8))
            return
        if self._stage == PAYLOAD:
            self._payload = self._buf if self._keep and self._plen else None
            if self._mac is not None:
                self._stage = TAGS
                self._expect(np.empty(PAYLOAD_TAG_BYTES, dtype=np.uint8))
                return
        else:  # the payload's tag
            assert self._mac is not None
            if self._keep:
                self._mac.check_payload(self._payload, self._buf.tobytes())
            else:
                self._mac.skip_payload()
        assert self._header is not None
        self._complete(self._header, self._payload, self._keep)

    def _complete(self, header: pb.FrameHeader, payload: np.ndarray | None, keep) -> None:
        """A frame read whole (`payload`: its bytes, checked against the header)."""
        if self._frames == 0:
            self.owner._slots.established(self)
        self._frames += 1
        self._last_frame = time.monotonic()
        self._new_frame()
        if keep:
            frame = (
                Frame(header, tensor_from_bytes(header, None))
                if payload is None
                else Frame(header, raw=payload)  # its tensor made where it is read
            )
            self.owner._deliver(frame, keep)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.owner._slots.closed(self)
        self.owner._readers.discard(self)


@dataclass
class _Conn:
    """A sender's connection. Its bytes are written by the event loop (`write`) and, from
    another thread, by `TcpTransport.send_now` (a `sock.send` of its own, where nothing
    waits in the asyncio transport's buffer): `lock` keeps the two in order, and the
    frames' tags (`mac`) with them. What a thread's send left unsent (`tail`) is written
    by the loop before anything else."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    mac: FrameMac | None
    loop: asyncio.AbstractEventLoop
    sock: socket.socket | None = None  # a duplicate of the connection's, for `send_now`
    lock: threading.Lock = field(default_factory=threading.Lock)
    tail: memoryview | None = None
    broken: bool = False  # a thread's send failed: the loop drops it
    watch: asyncio.Future | None = None  # closes `sock` when asyncio closes its socket

    @property
    def stale(self) -> bool:
        """The peer closed it (restarted, or closed it idle): nothing sent on it arrives."""
        return self.broken or self.writer.is_closing() or self.reader.at_eof()

    def write(self, frames: list[tuple[bytes, np.ndarray | None]]) -> None:
        """On the event loop: a thread's unsent tail, then `frames` (header bytes and
        payload), their tags made in the order they are written."""
        with self.lock:
            self.flush()
            for hb, data in frames:
                for buffer in _frame_writes(self.mac, hb, data):
                    self.writer.write(buffer)

    def flush(self) -> None:
        """On the event loop, under `lock`: what a thread's send left unsent, written."""
        if self.tail is not None:
            tail, self.tail = self.tail, None
            self.writer.write(tail)

    def close(self) -> None:
        with self.lock:
            if self.sock is not None:
                self.sock.close()
        self.writer.close()


def _frame_pieces(mac: FrameMac | None, hb: bytes, data: np.ndarray | None) -> list:
    """A frame's parts in the order they are written (its tags made, in order):
    preamble, header, [header tag], [payload], [payload tag]; none copied."""
    out = [PREAMBLE.pack(len(hb), 0 if data is None else data.nbytes), hb]
    if mac is not None:
        out.append(mac.header_tag(hb))
    if data is not None:
        out.append(data)
    if mac is not None:
        out.append(mac.payload_tag(data))
    return out


def _frame_writes(mac: FrameMac | None, hb: bytes, data: np.ndarray | None) -> list:
    """A frame's bytes as written: one buffer where its payload is at most `JOIN_BYTES`
    (one send), else the head, the payload (not copied) and the payload's tag."""
    pieces = _frame_pieces(mac, hb, data)
    if data is None or data.nbytes <= JOIN_BYTES:
        return [b"".join(pieces)]
    at = 2 if mac is None else 3  # the payload's place
    return [b"".join(pieces[:at]), memoryview(data), b"".join(pieces[at + 1 :])]


class TcpTransport(Transport):
    scheme = "tcp"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._server: asyncio.Server | None = None
        self._readers: set[_FrameReader] = set()
        self._slots: ConnectionSlots[_FrameReader] = ConnectionSlots(
            self.max_connections, self.max_half_open_per_peer
        )
        self._conns: dict[str, _Conn] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def _accept(self, reader: _FrameReader, peer: str) -> bool:
        """Whether to keep a new connection from `peer`; closes the ones it replaces."""
        self._slots.max_connections = self.max_connections
        self._slots.max_half_open_per_peer = self.max_half_open_per_peer
        victims = self._slots.open(reader, peer)
        if victims is None:
            rlog.warning("tcp-conns", "tcp: refusing a connection: %d open (the most)",
                         len(self._slots))  # fmt: skip
            return False
        for v in victims:
            v.close(f"a newer connection needs its slot ({peer or '?'} had no complete frame yet)")
        return True

    async def start(self, port: int = 0) -> str:
        loop = asyncio.get_running_loop()

        def factory() -> _FrameReader:
            r = _FrameReader(self)
            self._readers.add(r)
            return r

        self._server = await loop.create_server(factory, self.bind_host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.device != "cpu":
            log.info("tcp data plane on %s: %s", self.device, self.device_memory.why)
        return self.address

    async def _connection(self, address: str) -> tuple[_Conn, bool]:
        """The connection to `address` and whether it is a fresh one."""
        conn = self._conns.get(address)
        if conn is not None and not conn.stale:
            return conn, False
        if conn is not None:
            self._drop(address)
        addr = self._check_scheme(address)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(addr.host, addr.port), self.handshake_seconds
            )
        except (OSError, TimeoutError) as e:
            raise TransportError(f"cannot connect to {address}: {e!r}") from None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            hello = await asyncio.wait_for(
                reader.readexactly(CHALLENGE_BYTES), self.handshake_seconds
            )
        except (TimeoutError, asyncio.IncompleteReadError, OSError) as e:
            writer.close()
            why = "no answer" if isinstance(e, TimeoutError) else "closed"
            raise TransportError(
                f"{address} did not accept the connection ({why} within "
                f"{self.handshake_seconds:g} s: refused for want of slots, not a data-plane "
                "port, or not answering)"
            ) from None
        mac = self.auth.session(hello) if self.auth is not None else None
        dup = sock.dup() if sock is not None else None
        conn = self._conns[address] = _Conn(reader, writer, mac, asyncio.get_running_loop(), dup)
        if dup is not None:  # closed with the asyncio socket: no FIN held back by the dup
            conn.watch = asyncio.ensure_future(self._drop_when_lost(address, conn))
        return conn, True

    async def _drop_when_lost(self, address: str, conn: _Conn) -> None:
        with contextlib.suppress(Exception):
            await conn.writer.wait_closed()
        self._drop(address, conn)

    def _drop(self, address: str, conn: _Conn | None = None) -> None:
        """Close `conn` (by default the connection to `address`), and forget it if it is
        still the one to `address` (not a fresh one that replaced it)."""
        current = self._conns.get(address)
        conn = conn or current
        if conn is None:
            return
        if conn is current:
            del self._conns[address]
        conn.close()

    def post_frame(
        self, address: str, header: pb.FrameHeader, payload: Tensor | None = None
    ) -> bool:
        """Write a small frame now, in one write, where that can neither block nor pass an
        earlier frame whose send has begun: a live connection to `address`, no send to it
        under way and nothing waiting in its buffer. False (nothing sent): `send_frame`
        it. (A caller's own send that has not begun yet is the caller's to wait for.)"""
        return self._post(
            address, header, payload_bytes(None if payload is None else self.staged(payload))
        )

    def post_bytes(self, address: str, header: pb.FrameHeader, data: bytes) -> bool:
        return self._post(address, header, np.frombuffer(data, dtype=np.uint8) if data else None)

    def _post(self, address: str, header: pb.FrameHeader, data: np.ndarray | None) -> bool:
        conn = self._conns.get(address)
        lock = self._locks.get(address)
        if conn is None or conn.stale or (lock is not None and lock.locked()):
            return False
        w = conn.writer
        if w.transport.get_write_buffer_size() or (data is not None and data.nbytes > JOIN_BYTES):
            return False
        conn.write([(header.SerializeToString(), data)])
        return True

    def send_now(self, address: str, parts: list[batch.Part], sender: str = "") -> bool:
        """From any thread (a stage's compute thread: its round's frames sent without a
        turn of the event loop, issue 34 point 4): `parts` to `address` as `send_many`
        would send them, in one `sock.send` where that keeps every frame's order: a
        live connection, no send of the event loop's under way to it, nothing waiting in
        its buffer, host payloads of at most SEND_NOW_BYTES in all. False (nothing sent):
        `send_many` them. What the socket does not take at once the event loop writes
        next (`_Conn.tail`); a send that fails marks the connection for the loop to drop
        (its next `send_frame` opens a fresh one), and returns False."""
        conn = self._conns.get(address)
        lock = self._locks.get(address)
        if conn is not None and conn.stale:
            conn.loop.call_soon_threadsafe(self._drop, address, conn)
            return False
        if conn is None or conn.sock is None or (lock is not None and lock.locked()):
            return False
        try:
            frames: list[tuple[bytes, np.ndarray | None]] = []
            payloads = nparts = nbytes = 0
            for (header, payload), n in batch.frames(parts, sender):
                if payload is not None and payload.device.type != "cpu":
                    return False
                data = payload_bytes(payload)
                hb = header.SerializeToString()
                frames.append((hb, data))
                size = 0 if data is None else data.nbytes
                payloads += size
                nbytes += framed_bytes(len(hb), size)  # a header's `ByteSize` is len(hb)
                nparts += n
            if payloads > SEND_NOW_BYTES:
                return False
        except Exception:  # `send_many`, on the event loop, sends them or fails their requests
            log.debug("tcp: a thread could not make frames for %s", address, exc_info=True)
            return False
        with conn.lock:
            if conn.stale:
                conn.loop.call_soon_threadsafe(self._drop, address, conn)
                return False
            if conn.tail is not None or conn.writer.transport.get_write_buffer_size():
                return False
            pieces = []
            for hb, data in frames:
                pieces += _frame_pieces(conn.mac, hb, data)
            joined = b"".join(pieces)
            # Counted before the bytes leave: the peer may answer, and the answer be
            # read, before this thread runs again (the counters read as sent then).
            self._counted(len(frames), nparts, nbytes)
            try:
                sent = conn.sock.send(joined)
            except BlockingIOError:
                sent = 0
            except OSError as e:
                self._counted(-len(frames), -nparts, -nbytes)
                conn.broken = True  # its tags are spent: the loop reconnects
                conn.loop.call_soon_threadsafe(self._drop, address, conn)
                log.debug("tcp: a thread's send to %s failed: %s", address, e)
                return False
            if sent < len(joined):
                conn.tail = memoryview(joined)[sent:]
                conn.loop.call_soon_threadsafe(self._flush, address, conn)
        return True

    def _flush(self, address: str, conn: _Conn) -> None:
        with conn.lock:
            if not conn.stale:
                conn.flush()
                return
        self._drop(address, conn)

    async def send_frame(
        self, address: str, header: pb.FrameHeader, payload: Tensor | None = None
    ) -> None:
        data = payload_bytes(None if payload is None else self.staged(payload))
        hb = header.SerializeToString()
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            while True:  # once more on a fresh connection if a cached one broke
                conn, fresh = await self._connection(address)
                try:
                    w = conn.writer
                    conn.write([(hb, data)])
                    if w.transport.get_write_buffer_size():  # the peer lags: bounded
                        async with asyncio.timeout(self.frame_seconds):
                            await w.drain()
                    else:
                        await w.drain()  # at once (raises if the connection was lost)
                    return
                except TimeoutError:
                    self._drop(address)
                    raise TransportError(
                        f"{address} did not take a frame within {self.frame_seconds:g} s"
                    ) from None
                except (OSError, RuntimeError) as e:
                    self._drop(address)
                    if fresh:
                        raise TransportError(f"sending to {address} failed: {e}") from None

    async def close(self) -> None:
        for address in list(self._conns):
            self._drop(address)
        if self._server is not None:
            self._server.close()
            for r in list(self._readers):
                if r._transport is not None:
                    r._transport.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
