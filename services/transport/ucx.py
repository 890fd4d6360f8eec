"""Primary data plane: frames over UCX (`ucxx`), which uses RDMA/NVLink where present
and TCP otherwise (docs/architecture.md, "6. Control plane and data plane").

A frame is three tagged messages on one endpoint: a 16-byte preamble (header and
payload lengths), the protobuf header, then the payload sent straight from the
tensor's memory (a numpy view on CPU). GPU tensors go as CUDA buffers, and receivers
on a GPU receive into one, only when `UCX_TLS` names a CUDA transport (`cuda_copy`,
`cuda_ipc`, or `all`); otherwise (the default, `UCX_TLS=tcp`) UCX would read a device
pointer as host memory, so payloads are staged through host memory like TCP's.
Messages of one endpoint are matched in order, so frames to one address arrive in the
order they were sent.

Bounds and authentication as over TCP (`base.py`, `auth.py`): the preamble's lengths
are checked before anything is allocated, frames the owner does not admit are received
into a buffer of at most `max_payload_bytes` and dropped, and with `--secure` the
listener sends each new endpoint a challenge and every frame ends with a fourth message,
its tags (payloads then always go through host memory, where the tags are computed). A
sender whose endpoint broke reconnects and retries the frame once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import numpy as np
import torch
from specpipe.v1 import dataplane_pb2 as pb
from torch import Tensor

from .auth import CHALLENGE_BYTES, TAG_BYTES, FrameAuthError
from .base import Transport, TransportError, rlog
from .codec import (
    MAX_HEADER_BYTES,
    Frame,
    FrameError,
    parse_header,
    payload_bytes,
    tensor_from_bytes,
)

log = logging.getLogger(__name__)

# Defaults measured on loopback TCP (docs/architecture.md, "6. Control plane and data
# plane"); an operator's environment wins.
UCX_DEFAULTS = {
    "UCX_TLS": "tcp",
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}

# UCX reads its environment when ucxx is imported: set the defaults before any import.
for _k, _v in UCX_DEFAULTS.items():
    os.environ.setdefault(_k, _v)

_initialized = False
_progress: _Progress | None = None


class _Progress:
    """Progress the UCX worker from the event loop: spin while traffic flows, poll
    gently when idle.

    ucxx's "blocking" and "thread" modes were measured here to cost about half a CPU
    per idle process (their asyncio side keeps polling), which slows every hop on a
    small node shared by several stages. This loop polls the worker continuously for
    `spin` seconds after any send or receive is posted (`kick`), otherwise every
    `idle` seconds. Receivers post a receive only once a message is there (see
    `UcxTransport._serve`), because ucxx waits for a posted request by spinning too.
    """

    def __init__(
        self, worker, loop: asyncio.AbstractEventLoop, replaced, spin: float, idle: float
    ) -> None:
        self.worker, self.loop, self.spin, self.idle = worker, loop, spin, idle
        self._replaced = replaced  # ucxx's progress object: kept alive, its tasks cancelled
        self._event = asyncio.Event()
        self._busy_until = 0.0
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run())

    def kick(self) -> None:
        """Traffic: poll continuously for the next `spin` seconds."""
        self._busy_until = time.monotonic() + self.spin
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self.worker.progress()
            self._event.set()
            if time.monotonic() < self._busy_until:
                await asyncio.sleep(0)
            else:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.idle)

    async def activity(self) -> None:
        """Wait until the worker was progressed again."""
        self._event.clear()
        await self._event.wait()


def _kick() -> None:
    if _progress is not None:
        _progress.kick()


def _ucxx():
    """Import and initialize ucxx once per process; progress it from the running event
    loop with `_Progress` (installed again for each new loop: tests run several)."""
    global _initialized, _progress
    import ucxx

    mode = os.environ.get("SPECPIPE_UCX_PROGRESS", "event")
    if not _initialized:
        ucxx.init(progress_mode="blocking" if mode == "event" else mode)
        _initialized = True
    loop = asyncio.get_running_loop()
    if mode == "event" and (_progress is None or _progress.loop is not loop):
        from ucxx._lib_async import application_context as ac
        from ucxx.core import _get_ctx

        _get_ctx().continuous_ucx_progress(loop)  # ucxx's own progress for this loop
        blocking = ac.ProgressTasks.get(loop)
        if blocking is not None and not isinstance(blocking, _Progress):
            for task in blocking._tasks:
                task.cancel()
            loop.remove_reader(blocking.worker.epoll_file_descriptor)
            spin = float(os.environ.get("SPECPIPE_UCX_SPIN_MS", "20")) / 1e3
            idle = float(os.environ.get("SPECPIPE_UCX_IDLE_POLL_MS", "1")) / 1e3
            _progress = _Progress(blocking.worker, loop, blocking, spin, idle)
            ac.ProgressTasks[loop] = _progress
    return ucxx


def gpu_direct() -> bool:
    """Whether UCX is configured to move CUDA memory itself (see the module docstring)."""
    tls = os.environ.get("UCX_TLS", "")
    if tls.startswith("^"):
        return False  # an exclusion list: cannot tell, stage through host memory
    return any(t.strip() == "all" or t.strip().startswith("cuda") for t in tls.split(","))


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
        self._eps: dict[str, tuple[object, object]] = {}  # address -> (endpoint, FrameMac)
        self._locks: dict[str, asyncio.Lock] = {}
        self._handlers: set[asyncio.Task] = set()
        self._peers: set = set()  # endpoints that connected to our listener

    @property
    def host_payloads(self) -> bool:
        return self.auth is not None or not gpu_direct()

    async def start(self, port: int = 0) -> str:
        ucxx = _ucxx()

        async def handler(ep) -> None:
            task = asyncio.current_task()
            if task is not None:
                self._handlers.add(task)
            if len(self._peers) >= self.max_connections:
                rlog.warning(
                    "ucx-conns", "ucx: refusing an endpoint: %d open (the most)", len(self._peers)
                )
                with contextlib.suppress(Exception):
                    await ep.close()
                return
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
        mac = None
        if self.auth is not None:
            challenge = self.auth.challenge()
            mac = self.auth.session(challenge)
            try:
                _kick()
                await ep.send(np.frombuffer(challenge, dtype=np.uint8))
            except Exception:
                return
        while True:
            try:
                if _progress is not None:
                    # Post a receive only once a message is there: ucxx waits for a
                    # request by yielding to the loop in a spin, so an idle posted
                    # receive would cost a CPU.
                    while not ep.tag_probe().matched:
                        if ep.closed:
                            raise ConnectionError("peer closed")
                        await _progress.activity()
                _kick()
                await ep.recv(pre)
                hlen, plen = int(pre[0]), int(pre[1])
                if hlen > MAX_HEADER_BYTES or plen > self.max_payload_bytes:
                    raise FrameError(f"frame too large: header {hlen} bytes, payload {plen} bytes")
                hbuf = np.empty(hlen, dtype=np.uint8)
                if hlen:
                    _kick()
                    await ep.recv(hbuf)
                hbytes = hbuf.tobytes()
                header = parse_header(hbytes, plen)
                keep = self._admitted(header)
                buf = None
                if plen:  # a UCX message is received whole: dropped frames too (bounded)
                    buf = (
                        np.empty(plen, dtype=np.uint8)
                        if not keep or self.device == "cpu" or self.host_payloads
                        else torch.empty(plen, dtype=torch.uint8, device=self.device)
                    )
                    _kick()
                    await ep.recv(buf)
                if mac is not None:
                    tags = np.empty(TAG_BYTES, dtype=np.uint8)
                    _kick()
                    await ep.recv(tags)
                    if keep:
                        mac.verify(hbytes, buf, tags.tobytes())
                    else:
                        mac.skip()
                if not keep:
                    continue
                payload = tensor_from_bytes(header, buf)
            except (FrameError, FrameAuthError) as e:
                rlog.warning("ucx-drop", "ucx: dropping an endpoint: %s", e)
                break
            except Exception:  # the peer closed or died: ucxx raises its own errors
                break
            self._deliver(Frame(header, payload), keep)
        with contextlib.suppress(Exception):
            await ep.close()

    async def _endpoint(self, address: str):
        """(endpoint, FrameMac or None) to `address`, reconnecting if the peer closed it."""
        conn = self._eps.get(address)
        if conn is not None and not conn[0].closed:
            return conn
        self._eps.pop(address, None)
        addr = self._check_scheme(address)
        ucxx = _ucxx()
        try:
            ep = await ucxx.create_endpoint(addr.host, addr.port)
        except Exception as e:
            raise TransportError(f"cannot connect to {address}: {e}") from None
        mac = None
        if self.auth is not None:
            challenge = np.empty(CHALLENGE_BYTES, dtype=np.uint8)
            try:
                _kick()
                await asyncio.wait_for(ep.recv(challenge), 10.0)
            except Exception as e:
                with contextlib.suppress(Exception):
                    await ep.close()
                raise TransportError(
                    f"{address} sent no data-plane challenge (not a --secure peer?): {e!r}"
                ) from None
            mac = self.auth.session(challenge.tobytes())
        self._eps[address] = (ep, mac)
        return ep, mac

    async def send_frame(
        self, address: str, header: pb.FrameHeader, payload: Tensor | None = None
    ) -> None:
        if payload is None or payload.numel() == 0:
            buf = None
        elif payload.device.type == "cpu" or self.host_payloads:
            buf = payload_bytes(payload.cpu())  # stages copy device outputs before this
        else:  # CUDA buffers go as they are (UCX_TLS names a CUDA transport)
            buf = payload.reshape(-1).view(torch.uint8)
        hb = np.frombuffer(header.SerializeToString(), dtype=np.uint8)
        pre = np.array([hb.nbytes, 0 if buf is None else buf.nbytes], dtype=np.uint64)
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            for attempt in (0, 1):  # a fresh endpoint once if the cached one broke
                ep, mac = await self._endpoint(address)
                try:
                    _kick()
                    await ep.send(pre)
                    if hb.nbytes:
                        _kick()
                        await ep.send(hb)
                    if buf is not None:
                        _kick()
                        await ep.send(buf)
                    if mac is not None:
                        _kick()
                        await ep.send(np.frombuffer(mac.tag(hb.tobytes(), buf), dtype=np.uint8))
                    return
                except Exception as e:
                    self._eps.pop(address, None)
                    with contextlib.suppress(Exception):
                        await ep.close()
                    if attempt:
                        raise TransportError(f"sending to {address} failed: {e}") from None

    async def close(self) -> None:
        for ep in [*(c[0] for c in self._eps.values()), *self._peers]:
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
