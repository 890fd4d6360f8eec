"""Primary data plane: frames over UCX (`ucxx`), which uses RDMA/NVLink where present
and TCP otherwise (DESIGN 5).

A frame is three tagged messages on one endpoint: a 16-byte preamble (header and
payload lengths), the protobuf header, then the payload sent straight from the
tensor's memory (a numpy view on CPU, the CUDA buffer on GPU). The receiver allocates
the payload on its own device and receives into it. Messages of one endpoint are
matched in order, so frames to one address arrive in the order they were sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import numpy as np
import torch
from specpipe.v1 import dataplane_pb2 as pb
from torch import Tensor

from .base import Transport, TransportError
from .codec import Frame, FrameError, parse_header, payload_bytes, tensor_from_bytes

log = logging.getLogger(__name__)

# Defaults measured on loopback TCP (DESIGN 5); an operator's environment wins.
UCX_DEFAULTS = {
    "UCX_TLS": "tcp",
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}

_initialized = False


def _ucxx():
    """Import and initialize ucxx once per process (blocking progress: lowest latency)."""
    global _initialized
    for k, v in UCX_DEFAULTS.items():
        os.environ.setdefault(k, v)
    import ucxx

    if not _initialized:
        ucxx.init(progress_mode=os.environ.get("SPECPIPE_UCX_PROGRESS", "blocking"))
        _initialized = True
    return ucxx


def available() -> bool:
    try:
        import ucxx  # noqa: F401
    except Exception:
        return False
    return True


class UcxTransport(Transport):
    scheme = "ucx"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._listener = None
        self._eps: dict[str, object] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._handlers: set[asyncio.Task] = set()
        self._peers: set = set()  # endpoints that connected to our listener

    async def start(self, port: int = 0) -> str:
        ucxx = _ucxx()

        async def handler(ep) -> None:
            task = asyncio.current_task()
            if task is not None:
                self._handlers.add(task)
            self._peers.add(ep)
            try:
                await self._serve(ep)
            finally:
                self._peers.discard(ep)
                if task is not None:
                    self._handlers.discard(task)

        self._listener = ucxx.create_listener(handler, port=port)
        self.port = self._listener.port
        return self.address

    async def _serve(self, ep) -> None:
        """Receive frames from one peer until it goes away."""
        pre = np.empty(2, dtype=np.uint64)
        while True:
            try:
                await ep.recv(pre)
                hlen, plen = int(pre[0]), int(pre[1])
                hbuf = np.empty(hlen, dtype=np.uint8)
                if hlen:
                    await ep.recv(hbuf)
                header = parse_header(hbuf.tobytes(), plen)
                buf = None
                if plen:
                    buf = (
                        np.empty(plen, dtype=np.uint8)
                        if self.device == "cpu"
                        else torch.empty(plen, dtype=torch.uint8, device=self.device)
                    )
                    await ep.recv(buf)
                payload = tensor_from_bytes(header, buf)
            except FrameError as e:
                log.warning("dropping UCX connection: %s", e)
                break
            except Exception:  # the peer closed or died: ucxx raises its own errors
                break
            self.on_frame(Frame(header, payload))
        with contextlib.suppress(Exception):
            await ep.close()

    async def _endpoint(self, address: str):
        ep = self._eps.get(address)
        if ep is not None and not ep.closed:
            return ep
        addr = self._check_scheme(address)
        ucxx = _ucxx()
        try:
            ep = await ucxx.create_endpoint(addr.host, addr.port)
        except Exception as e:
            raise TransportError(f"cannot connect to {address}: {e}") from None
        self._eps[address] = ep
        return ep

    async def send_frame(
        self, address: str, header: pb.FrameHeader, payload: Tensor | None = None
    ) -> None:
        if payload is None or payload.numel() == 0:
            buf = None
        elif payload.device.type == "cpu":
            buf = payload_bytes(payload)
        else:  # CUDA buffers go as they are (UCX_TLS must include a CUDA transport)
            buf = payload.reshape(-1).view(torch.uint8)
        hb = np.frombuffer(header.SerializeToString(), dtype=np.uint8)
        pre = np.array([hb.nbytes, 0 if buf is None else buf.nbytes], dtype=np.uint64)
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            ep = await self._endpoint(address)
            try:
                await ep.send(pre)
                if hb.nbytes:
                    await ep.send(hb)
                if buf is not None:
                    await ep.send(buf)
            except Exception as e:
                self._eps.pop(address, None)
                raise TransportError(f"sending to {address} failed: {e}") from None

    async def close(self) -> None:
        for ep in [*self._eps.values(), *self._peers]:
            with contextlib.suppress(Exception):
                await ep.close()
        self._eps.clear()
        self._peers.clear()
        handlers = list(self._handlers)
        for t in handlers:
            t.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
