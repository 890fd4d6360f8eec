"""Fallback data plane for hosts without UCX: frames over plain asyncio TCP streams.

Same framing as UCX (preamble, protobuf header, raw payload; with `--secure`, a
challenge first and two tags after every frame, see `auth.py`). The receiver reads
straight into buffers it allocates for each frame (a `BufferedProtocol`), so payload
bytes are copied once, from the socket, and only for frames its owner admitted (see
`base.py`); others are read past through a small scratch buffer.

Connections are bounded: at most `max_connections` inbound at once, a frame must be
complete within `FRAME_SECONDS` of its first byte (and a connection's first frame within
as long of its opening), and a connection idle for `IDLE_SECONDS` is closed. Senders
notice a connection the peer closed (it restarted, or closed it idle) before they
write and open a new one, and retry a frame once on a fresh connection when a write
fails, so a peer's restart costs no request.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from dataclasses import dataclass

import numpy as np
from specpipe.v1 import dataplane_pb2 as pb
from torch import Tensor

from .auth import CHALLENGE_BYTES, TAG_BYTES, FrameAuthError, FrameMac
from .base import Transport, TransportError, rlog
from .codec import (
    PREAMBLE,
    Frame,
    FrameError,
    parse_header,
    parse_preamble,
    payload_bytes,
    tensor_from_bytes,
)

FRAME_SECONDS = 30.0  # a frame's bytes, once it has begun (and a first frame after connecting)
IDLE_SECONDS = 600.0  # no frame at all: the sender reconnects when it has one
CHALLENGE_SECONDS = 10.0  # a secure receiver answers a connection with its challenge at once
_SCRATCH = 1 << 16

PREAMBLE_, HEADER, PAYLOAD, TAGS = range(4)


class _FrameReader(asyncio.BufferedProtocol):
    """Reassembles frames from a byte stream: preamble, header, payload, [tags], repeat."""

    def __init__(self, transport: TcpTransport) -> None:
        self.owner = transport
        self._transport: asyncio.Transport | None = None
        self._mac: FrameMac | None = None
        self._scratch: np.ndarray | None = None
        self._frames = 0
        self._last = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._new_frame()

    def _new_frame(self) -> None:
        self._stage = PREAMBLE_
        self._expect(np.empty(PREAMBLE.size, dtype=np.uint8))
        self._plen = 0
        self._header: pb.FrameHeader | None = None
        self._hbytes = b""
        self._payload: np.ndarray | None = None
        self._keep = True

    def _expect(self, buf: np.ndarray, discard: int = 0) -> None:
        """Read into `buf`; or, with `discard`, read that many bytes into scratch space."""
        self._buf, self._view, self._filled = buf, memoryview(buf).cast("B"), 0
        self._discard = discard

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        owner = self.owner
        if len(owner._readers) > owner.max_connections:
            rlog.warning(
                "tcp-conns", "tcp: refusing a connection: %d open (the most)", len(owner._readers)
            )
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if owner.auth is not None:
            challenge = owner.auth.challenge()
            self._mac = owner.auth.session(challenge)
            transport.write(challenge)  # type: ignore[attr-defined]
        self._arm()

    def _arm(self) -> None:
        if self.owner.check_every > 0:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.owner.check_every, self._check_idle)

    def _check_idle(self) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        quiet = time.monotonic() - self._last
        mid_frame = self._stage != PREAMBLE_ or self._filled > 0 or self._frames == 0
        limit = self.owner.frame_seconds if mid_frame else self.owner.idle_seconds
        if quiet > limit:
            what = "a frame stalled" if mid_frame else "idle"
            rlog.warning("tcp-idle", "tcp: closing a connection: %s for %.0f s", what, quiet)
            self._transport.close()
            return
        self._arm()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._discard:
            if self._scratch is None:
                self._scratch = np.empty(_SCRATCH, dtype=np.uint8)
            return memoryview(self._scratch)[: min(self._discard - self._filled, _SCRATCH)]
        return self._view[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        self._last = time.monotonic()
        try:
            while self._filled == (self._discard or len(self._buf)):
                if not self._advance():
                    break
        except (FrameError, FrameAuthError) as e:
            rlog.warning("tcp-drop", "tcp: dropping a connection: %s", e)
            assert self._transport is not None
            self._transport.close()

    def _advance(self) -> bool:
        """A part of the frame is complete; set up the next one. False when waiting."""
        owner = self.owner
        if self._stage == PREAMBLE_:
            hlen, self._plen = parse_preamble(bytes(self._buf))
            if self._plen > owner.max_payload_bytes:
                raise FrameError(
                    f"a frame announces {self._plen} payload bytes; at most {owner.max_payload_bytes}"
                )
            self._stage = HEADER
            self._expect(np.empty(hlen, dtype=np.uint8))
            return hlen == 0
        if self._stage == HEADER:
            self._hbytes = self._buf.tobytes()
            self._header = parse_header(self._hbytes, self._plen)
            self._keep = owner._admitted(self._header)
            self._stage = PAYLOAD
            if not self._keep:
                self._expect(np.empty(0, dtype=np.uint8), discard=self._plen)
            else:
                self._expect(np.empty(self._plen, dtype=np.uint8))
            return self._plen == 0
        if self._stage == PAYLOAD:
            self._payload = self._buf if self._keep and self._plen else None
            if self._mac is not None:
                self._stage = TAGS
                self._expect(np.empty(TAG_BYTES, dtype=np.uint8))
                return False
        else:  # tags
            assert self._mac is not None
            if self._keep:
                self._mac.verify(self._hbytes, self._payload, self._buf.tobytes())
            else:
                self._mac.skip()
        return self._complete()

    def _complete(self) -> bool:
        header, payload, keep = self._header, self._payload, self._keep
        assert header is not None
        self._frames += 1
        self._new_frame()
        if keep:
            self.owner._deliver(Frame(header, tensor_from_bytes(header, payload)), keep)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.owner._readers.discard(self)


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    mac: FrameMac | None

    @property
    def stale(self) -> bool:
        """The peer closed it (restarted, or closed it idle): nothing sent on it arrives."""
        return self.writer.is_closing() or self.reader.at_eof()


class TcpTransport(Transport):
    scheme = "tcp"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._server: asyncio.Server | None = None
        self._readers: set[_FrameReader] = set()
        self._conns: dict[str, _Conn] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.frame_seconds, self.idle_seconds = FRAME_SECONDS, IDLE_SECONDS
        self.check_every = 1.0

    async def start(self, port: int = 0) -> str:
        loop = asyncio.get_running_loop()

        def factory() -> _FrameReader:
            r = _FrameReader(self)
            self._readers.add(r)
            return r

        self._server = await loop.create_server(factory, self.bind_host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.address

    async def _connection(self, address: str) -> _Conn:
        conn = self._conns.get(address)
        if conn is not None and not conn.stale:
            return conn
        if conn is not None:
            self._drop(address)
        addr = self._check_scheme(address)
        try:
            reader, writer = await asyncio.open_connection(addr.host, addr.port)
        except OSError as e:
            raise TransportError(f"cannot connect to {address}: {e}") from None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mac = None
        if self.auth is not None:
            try:
                challenge = await asyncio.wait_for(
                    reader.readexactly(CHALLENGE_BYTES), CHALLENGE_SECONDS
                )
            except (TimeoutError, asyncio.IncompleteReadError, OSError) as e:
                writer.close()
                raise TransportError(
                    f"{address} sent no data-plane challenge (not a --secure peer?): {e!r}"
                ) from None
            mac = self.auth.session(challenge)
        conn = self._conns[address] = _Conn(reader, writer, mac)
        return conn

    def _drop(self, address: str) -> None:
        conn = self._conns.pop(address, None)
        if conn is not None:
            conn.writer.close()

    async def send_frame(
        self, address: str, header: pb.FrameHeader, payload: Tensor | None = None
    ) -> None:
        if payload is not None and payload.device.type != "cpu":
            payload = payload.cpu()
        data = payload_bytes(payload)
        hb = header.SerializeToString()
        plen = 0 if data is None else data.nbytes
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            for attempt in (0, 1):  # a fresh connection once if the cached one broke
                conn = await self._connection(address)
                try:
                    conn.writer.write(PREAMBLE.pack(len(hb), plen) + hb)
                    if data is not None:
                        conn.writer.write(memoryview(data))
                    if conn.mac is not None:
                        conn.writer.write(conn.mac.tag(hb, data))
                    await conn.writer.drain()
                    return
                except (OSError, RuntimeError) as e:
                    self._drop(address)
                    if attempt:
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
