"""Primary data plane: frames over UCX (`ucxx`), which uses RDMA/NVLink where present
and TCP otherwise (docs/architecture.md, "6. Control plane and data plane").

A frame is three tagged messages on one endpoint: a 16-byte preamble (header and
payload lengths), the protobuf header, then the payload sent straight from the
tensor's memory (a numpy view on CPU). Messages of one endpoint are matched in order,
so frames to one address arrive in the order they were sent.

Device memory (docs/architecture.md, "6. Control plane and data plane", "Device memory
on the data plane"): a transport on a GPU sends its payloads as CUDA buffers, and
receives into a buffer on its GPU, when UCX can move CUDA memory itself (the one
decision is `device_memory.py`'s, from the UCX_TLS this process's UCX runs with,
`current_tls`); otherwise they are staged through host memory, as over TCP. A
transport on a GPU starts UCX with `UCX_TLS=tcp,cuda_copy,cuda_ipc` unless the
environment says otherwise (on the CPU: `tcp`); UCX reads it once per process.

Bounds, deadlines and authentication as over TCP (`base.py`, `admission.py`,
`auth.py`): the listener answers each new endpoint with a 16-byte hello (the challenge
with `--secure`), which the sender waits for at most `handshake_seconds`; an endpoint
must send its first preamble within `handshake_seconds` and the rest of every frame
within `frame_seconds` of its preamble, and is closed after `idle_seconds` without a
frame. Half-open endpoints (no complete frame yet) are capped like TCP connections, but
all together: ucxx does not tell a listener its peer's address, so every peer counts as
one (the oldest half-open endpoint makes way for a new one). The preamble's lengths are
checked before anything is allocated; with `--secure` the header message carries the
header's tag, checked before the header has any effect, and a fourth message the
payload's tag (payloads then always go through host memory, where the tags are
computed); frames the owner does not admit are received into a buffer of at most
`max_payload_bytes` and dropped. A sender whose endpoint broke reconnects and retries the
frame once; one whose frame is not taken within `frame_seconds` gets a TransportError.
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

from .admission import ConnectionSlots
from .auth import CHALLENGE_BYTES, HEADER_TAG_BYTES, PAYLOAD_TAG_BYTES, FrameAuth, FrameAuthError
from .base import Transport, TransportError, rlog
from .codec import (
    MAX_HEADER_BYTES,
    Frame,
    FrameError,
    parse_header,
    payload_bytes,
    tensor_from_bytes,
)
from .device_memory import DeviceMemory, default_tls, ucx_device_memory

log = logging.getLogger(__name__)

# Defaults measured on loopback TCP (docs/architecture.md, "6. Control plane and data
# plane"); an operator's environment wins.
UCX_DEFAULTS = {
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}
# UCX reads its environment when its context is made (`_ucxx`): set the defaults first.
for _k, _v in UCX_DEFAULTS.items():
    os.environ.setdefault(_k, _v)

_initialized = False
_tls: str | None = None  # the UCX_TLS this process's UCX was started with
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


def _ucxx(device: str = "cpu"):
    """Import and initialize ucxx once per process (with the UCX_TLS default of the
    first transport's `device`); progress it from the running event loop with
    `_Progress` (installed again for each new loop: tests run several)."""
    global _initialized, _progress, _tls
    import ucxx

    mode = os.environ.get("SPECPIPE_UCX_PROGRESS", "event")
    if not _initialized:
        _tls = os.environ.setdefault("UCX_TLS", default_tls(device))
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


def current_tls(device: str) -> str:
    """The UCX_TLS this process's UCX runs with, or (not started yet) will start with
    for a transport on `device`: UCX reads it once per process."""
    if _initialized and _tls is not None:
        return _tls
    return os.environ.get("UCX_TLS") or default_tls(device)


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
        self._serving: dict[object, asyncio.Task] = {}  # endpoints that connected to us
        self._slots: ConnectionSlots = ConnectionSlots(
            self.max_connections, self.max_half_open_per_peer
        )

    @property
    def _peers(self) -> list:
        """Endpoints that connected to our listener."""
        return list(self._serving)

    @property
    def device_memory(self) -> DeviceMemory:
        return ucx_device_memory(self.device, self.auth is not None, current_tls(self.device))

    async def start(self, port: int = 0) -> str:
        ucxx = _ucxx(self.device)
        memory = self.device_memory
        gpu = torch.device(self.device)
        if memory.carried and gpu.index is not None:
            # UCX's CUDA transports copy in the context current on the thread that
            # progresses them: this one (the event loop's), on this transport's GPU
            # (plain "cuda" is the current one already).
            torch.cuda.set_device(gpu)
        log.info("ucx data plane on %s: %s", self.device, memory.why)

        async def handler(ep) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._slots.max_connections = self.max_connections
            self._slots.max_half_open_per_peer = self.max_half_open_per_peer
            victims = self._slots.open(ep, "")  # ucxx does not tell the peer's address
            if victims is None:
                rlog.warning(
                    "ucx-conns", "ucx: refusing an endpoint: %d open (the most)", len(self._slots)
                )
                with contextlib.suppress(Exception):
                    await ep.close()
                return
            for v in victims:
                rlog.warning("ucx-close", "ucx: closing an endpoint with no complete frame "
                             "yet: a newer one needs its slot")  # fmt: skip
                victim = self._serving.get(v)
                if victim is not None:
                    victim.cancel()
            self._serving[ep] = task
            self._handlers.add(task)
            try:
                await self._serve(ep)
            finally:
                self._slots.closed(ep)
                self._serving.pop(ep, None)
                self._handlers.discard(task)

        self._listener = ucxx.create_listener(handler, port=port)
        self.port = self._listener.port
        return self.address

    async def _serve(self, ep) -> None:
        """Receive frames from one peer until it goes away or breaks a deadline."""
        loop = asyncio.get_running_loop()
        hello = FrameAuth.challenge()  # "accepted" (the challenge with --secure)
        mac = self.auth.session(hello) if self.auth is not None else None
        pre = np.empty(2, dtype=np.uint64)
        frames, opened = 0, loop.time()
        last = opened
        try:
            try:
                _kick()
                async with asyncio.timeout(self.handshake_seconds):
                    await ep.send(np.frombuffer(hello, dtype=np.uint8))
            except Exception:
                return
            while True:
                if frames == 0:
                    until, what = opened + self.handshake_seconds, "no frame after connecting"
                else:
                    until, what = last + self.idle_seconds, "idle"
                try:
                    async with asyncio.timeout_at(until):
                        await self._next_message(ep)
                        _kick()
                        await ep.recv(pre)
                except TimeoutError:
                    rlog.warning("ucx-close", "ucx: closing an endpoint: %s for %.0f s",
                                 what, loop.time() - last)  # fmt: skip
                    return
                try:
                    async with asyncio.timeout(self.frame_seconds):
                        frame, keep = await self._rest_of_frame(ep, pre, mac)
                except TimeoutError:
                    rlog.warning("ucx-close", "ucx: closing an endpoint: a frame not complete "
                                 "%g s after its preamble", self.frame_seconds)  # fmt: skip
                    return
                except (FrameError, FrameAuthError) as e:
                    rlog.warning("ucx-drop", "ucx: dropping an endpoint: %s", e)
                    return
                if frames == 0:
                    self._slots.established(ep)
                frames += 1
                last = loop.time()
                if keep:
                    self._deliver(frame, keep)
        except asyncio.CancelledError:
            raise
        except Exception:  # the peer closed or died: ucxx raises its own errors
            return
        finally:
            with contextlib.suppress(Exception):
                await ep.close()

    async def _next_message(self, ep) -> None:
        """Until a message is there to receive."""
        if _progress is None:
            return
        # Post a receive only once a message is there: ucxx waits for a request by
        # yielding to the loop in a spin, so an idle posted receive would cost a CPU.
        while not ep.tag_probe().matched:
            if ep.closed:
                raise ConnectionError("peer closed")
            await _progress.activity()

    async def _rest_of_frame(self, ep, pre: np.ndarray, mac):
        """The header, payload and tags after a preamble: (frame, admission); the
        header's tag is checked before the header has any effect."""
        hlen, plen = int(pre[0]), int(pre[1])
        if hlen > MAX_HEADER_BYTES or plen > self.max_payload_bytes:
            raise FrameError(f"frame too large: header {hlen} bytes, payload {plen} bytes")
        tag = HEADER_TAG_BYTES if mac is not None else 0
        hbuf = np.empty(hlen + tag, dtype=np.uint8)
        if hlen + tag:
            _kick()
            await ep.recv(hbuf)
        raw = hbuf.tobytes()
        hbytes = raw[:hlen]
        if mac is not None:
            mac.check_header(hbytes, raw[hlen:])
        header = parse_header(hbytes, plen)
        keep = self._admitted(header)
        buf = None
        if plen:  # a UCX message is received whole: dropped frames too (bounded)
            buf = self._receive_buffer(plen, bool(keep))
            _kick()
            await ep.recv(buf)
        if mac is not None:
            tags = np.empty(PAYLOAD_TAG_BYTES, dtype=np.uint8)
            _kick()
            await ep.recv(tags)
            if keep:
                mac.check_payload(buf, tags.tobytes())
            else:
                mac.skip_payload()
        payload = tensor_from_bytes(header, buf) if keep else None
        return Frame(header, payload), keep

    def _receive_buffer(self, nbytes: int, keep: bool) -> np.ndarray | Tensor:
        """Where a payload is received: on this transport's device when it carries
        device memory (a kept frame), else in host memory."""
        if keep and not self.host_payloads:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return np.empty(nbytes, dtype=np.uint8)

    async def _endpoint(self, address: str):
        """(endpoint, FrameMac or None, fresh) to `address`, reconnecting if the peer
        closed it; the receiver's hello is waited for at most `handshake_seconds`."""
        conn = self._eps.get(address)
        if conn is not None and not conn[0].closed:
            return (*conn, False)
        self._eps.pop(address, None)
        addr = self._check_scheme(address)
        ucxx = _ucxx(self.device)
        try:
            ep = await asyncio.wait_for(
                ucxx.create_endpoint(addr.host, addr.port), self.handshake_seconds
            )
        except Exception as e:
            raise TransportError(f"cannot connect to {address}: {e!r}") from None
        hello = np.empty(CHALLENGE_BYTES, dtype=np.uint8)
        try:
            _kick()
            await asyncio.wait_for(ep.recv(hello), self.handshake_seconds)
        except Exception as e:
            with contextlib.suppress(Exception):
                await ep.close()
            raise TransportError(
                f"{address} did not accept the endpoint within {self.handshake_seconds:g} s "
                f"(refused for want of slots, or not a data-plane port): {e!r}"
            ) from None
        mac = self.auth.session(hello.tobytes()) if self.auth is not None else None
        self._eps[address] = (ep, mac)
        return ep, mac, True

    async def send_frame(
        self, address: str, header: pb.FrameHeader, payload: Tensor | None = None
    ) -> None:
        if payload is None or payload.numel() == 0:
            buf = None
        elif (payload := self.staged(payload)).device.type == "cpu":
            buf = payload_bytes(payload)
        else:  # device memory goes as it is: UCX reads it (`device_memory`)
            buf = payload.reshape(-1).view(torch.uint8)
        hbytes = header.SerializeToString()
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            while True:  # once more on a fresh endpoint if a cached one broke
                ep, mac, fresh = await self._endpoint(address)
                try:
                    async with asyncio.timeout(self.frame_seconds):
                        await self._send_parts(ep, mac, hbytes, buf)
                    return
                except Exception as e:
                    self._eps.pop(address, None)
                    with contextlib.suppress(Exception):
                        await ep.close()
                    if isinstance(e, TimeoutError):
                        raise TransportError(
                            f"{address} did not take a frame within {self.frame_seconds:g} s"
                        ) from None
                    if fresh:
                        raise TransportError(f"sending to {address} failed: {e}") from None

    @staticmethod
    async def _send_parts(ep, mac, hbytes: bytes, buf) -> None:
        """Preamble, header [+ its tag], payload, [payload tag]: one message each."""
        head = hbytes + (mac.header_tag(hbytes) if mac is not None else b"")
        pre = np.array([len(hbytes), 0 if buf is None else buf.nbytes], dtype=np.uint64)
        _kick()
        await ep.send(pre)
        if head:
            _kick()
            await ep.send(np.frombuffer(head, dtype=np.uint8))
        if buf is not None:
            _kick()
            await ep.send(buf)
        if mac is not None:
            _kick()
            await ep.send(np.frombuffer(mac.payload_tag(buf), dtype=np.uint8))

    async def close(self) -> None:
        for ep in [*(c[0] for c in self._eps.values()), *self._serving]:
            with contextlib.suppress(Exception):
                await ep.close()
        self._eps.clear()
        handlers = list(self._handlers)
        for t in handlers:
            t.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        self._serving.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
