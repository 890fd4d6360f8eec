"""Fallback data plane for hosts without UCX: frames over plain asyncio TCP streams.

Same framing as UCX (preamble, protobuf header, raw payload). The receiver reads
straight into buffers it allocates for each frame (a `BufferedProtocol`), so payload
bytes are copied once, from the socket.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import numpy as np
from specpipe.v1 import dataplane_pb2 as pb
from torch import Tensor

from .base import Transport, TransportError
from .codec import (
    PREAMBLE,
    Frame,
    FrameError,
    pack_header,
    parse_header,
    parse_preamble,
    payload_bytes,
    tensor_from_bytes,
)

log = logging.getLogger(__name__)


class _FrameReader(asyncio.BufferedProtocol):
    """Reassembles frames from a byte stream: preamble, header, payload, repeat."""

    def __init__(self, transport: TcpTransport) -> None:
        self.owner = transport
        self._new_frame()

    def _new_frame(self) -> None:
        self._stage = 0  # 0 preamble, 1 header, 2 payload
        self._expect(np.empty(PREAMBLE.size, dtype=np.uint8))
        self._plen = 0
        self._header: pb.FrameHeader | None = None

    def _expect(self, buf: np.ndarray) -> None:
        self._buf, self._view, self._filled = buf, memoryview(buf).cast("B"), 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        try:
            while self._filled == len(self._buf):
                if not self._advance():
                    break
        except FrameError as e:
            log.warning("dropping TCP connection: %s", e)
            self._transport.close()

    def _advance(self) -> bool:
        """A part of the frame is complete; set up the next one. False when waiting."""
        if self._stage == 0:
            hlen, self._plen = parse_preamble(bytes(self._buf))
            self._stage = 1
            self._expect(np.empty(hlen, dtype=np.uint8))
            return hlen == 0
        if self._stage == 1:
            self._header = parse_header(self._buf.tobytes(), self._plen)
            self._stage = 2
            self._expect(np.empty(self._plen, dtype=np.uint8))
            return self._plen == 0
        assert self._header is not None
        payload = tensor_from_bytes(self._header, self._buf if self._plen else None)
        header = self._header
        self._new_frame()
        self.owner.on_frame(Frame(header, payload))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner._readers.discard(self)


class TcpTransport(Transport):
    scheme = "tcp"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._server: asyncio.Server | None = None
        self._readers: set[_FrameReader] = set()
        self._conns: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def start(self, port: int = 0) -> str:
        loop = asyncio.get_running_loop()

        def factory() -> _FrameReader:
            r = _FrameReader(self)
            self._readers.add(r)
            return r

        self._server = await loop.create_server(factory, self.bind_host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.address

    async def _connection(self, address: str) -> asyncio.StreamWriter:
        conn = self._conns.get(address)
        if conn is not None and not conn[1].is_closing():
            return conn[1]
        addr = self._check_scheme(address)
        try:
            reader, writer = await asyncio.open_connection(addr.host, addr.port)
        except OSError as e:
            raise TransportError(f"cannot connect to {address}: {e}") from None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conns[address] = (reader, writer)
        return writer

    async def send_frame(
        self, address: str, header: pb.FrameHeader, payload: Tensor | None = None
    ) -> None:
        if payload is not None and payload.device.type != "cpu":
            payload = payload.cpu()
        data = payload_bytes(payload)
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            writer = await self._connection(address)
            try:
                writer.write(pack_header(header, 0 if data is None else data.nbytes))
                if data is not None:
                    writer.write(memoryview(data))
                await writer.drain()
            except (OSError, RuntimeError) as e:
                self._conns.pop(address, None)
                writer.close()
                raise TransportError(f"sending to {address} failed: {e}") from None

    async def close(self) -> None:
        for _, writer in self._conns.values():
            writer.close()
        self._conns.clear()
        if self._server is not None:
            self._server.close()
            for r in list(self._readers):
                r._transport.close()
            await self._server.wait_closed()
            self._server = None
