"""The data-plane interface shared by the UCX and TCP transports.

A transport listens at one address and sends frames to any address: the next hop of each
request is named in the request's route
(docs/architecture.md, "6. Control plane and data plane"), not fixed per process.
Received frames are handed to a callback in the event loop; `Inbox` sorts them by
request, into a queue or an owner's own sink.

What a receiver reads is bounded before it is allocated (docs/architecture.md,
"9. Security"): a preamble announcing more than `max_payload_bytes` closes the
connection, and once the header is read the owner's `admit` decides whether the frame
is wanted (a request it holds, rows and shape it can take); unwanted frames are read
past without being kept. With `auth` (the `--secure` data plane, `auth.py`) every frame
is authenticated (its header before the header has any effect), and one that is not
closes the connection.

No peer can hold a receiver or a sender (issue 22, N3): a frame must be complete within
`frame_seconds` of its first byte, however slowly it drips in; a new connection must
begin its first frame within `handshake_seconds`; a connection with no frame for
`idle_seconds` is closed; and half-open connections (no complete frame yet) are capped
per peer address (`admission.py`), so one peer cannot take the slots the deployment's
own connections need. A receiver that accepts a connection answers at once with a
16-byte hello (the `--secure` challenge; random bytes otherwise), and a sender waits
for it at most `handshake_seconds`: a receiver that refused or cannot accept the
connection is a TransportError at once, not a frame lost in a socket buffer. A frame
that the peer does not take within `frame_seconds` is a TransportError too. The stage
then fails the requests of that hop UNAVAILABLE and tells the router, which replays
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from specpipe.common.spec.messages import Activation
from specpipe.v1 import dataplane_pb2 as pb
from torch import Tensor

from ..ratelog import RateLimitedLog
from . import batch
from .auth import FrameAuth
from .codec import MAX_PAYLOAD_BYTES, Frame, encode, error_header, frame_bytes, received_bytes
from .device_memory import HOST_ONLY, DeviceMemory

FrameHandler = Callable[[Frame], None]
FrameAdmit = Callable[[pb.FrameHeader], bool]
# What a receiver decided about a frame before reading its payload: keep it or not, or
# for a batch frame, which of its parts.
Admission = bool | list[bool]

log = logging.getLogger(__name__)
rlog = RateLimitedLog(log)

# The largest payload a receiver reads at all; owners admit less per frame (`admit`).
DEFAULT_MAX_PAYLOAD_BYTES = MAX_PAYLOAD_BYTES
# Inbound connections held at once (peers are the deployment's few services), and of
# those, connections that have not yet delivered a complete frame, per peer address (a
# deployment's own are half-open for the milliseconds their first frame takes; a local
# deployment's services all share 127.0.0.1, so a burst of them must fit).
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_HALF_OPEN_PER_PEER = 32
# Deadlines (see the module docstring).
FRAME_SECONDS = 30.0  # a frame's bytes, from its first byte (or a send, from its start)
HANDSHAKE_SECONDS = 10.0  # a new connection: the hello, and the first frame's first byte
IDLE_SECONDS = 600.0  # no frame at all: the sender reconnects when it has one


class TransportError(ConnectionError):
    """A frame could not be delivered (peer down, connection refused or reset)."""


@dataclass(frozen=True)
class Address:
    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Address:
        scheme, sep, rest = text.partition("://")
        host, colon, port = rest.rpartition(":")
        if not sep or not colon or not host or not port.isdigit():
            raise ValueError(f"bad data-plane address {text!r} (expected SCHEME://HOST:PORT)")
        return cls(scheme, host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


class Transport(ABC):
    """Listens for frames at `address`; sends frames to other transports of its scheme."""

    scheme: str

    def __init__(
        self,
        on_frame: FrameHandler,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        device: str = "cpu",
        *,
        auth: FrameAuth | None = None,
        admit: FrameAdmit | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_half_open_per_peer: int = DEFAULT_MAX_HALF_OPEN_PER_PEER,
        frame_seconds: float = FRAME_SECONDS,
        handshake_seconds: float = HANDSHAKE_SECONDS,
        idle_seconds: float = IDLE_SECONDS,
    ) -> None:
        self.on_frame = on_frame
        # Around the delivery of the frames one read brought (its owner's to set; TCP):
        # a compute thread's wake then comes once, at its end (`ThreadInbox.gathering`).
        self.gather: contextlib.AbstractContextManager = contextlib.nullcontext()
        self.auth = auth  # None: plaintext frames (no --secure)
        self.admit = admit  # None: every frame within max_payload_bytes
        self.max_payload_bytes = max_payload_bytes
        self.max_connections = max_connections
        self.max_half_open_per_peer = max_half_open_per_peer
        self.frame_seconds, self.handshake_seconds = frame_seconds, handshake_seconds
        self.idle_seconds = idle_seconds
        self.check_every = 1.0  # how often a receiver checks its connections' deadlines
        self.bind_host = bind_host
        self.advertise_host = advertise_host or (
            "127.0.0.1" if bind_host in ("0.0.0.0", "::", "") else bind_host
        )
        # Where received payloads are placed: host memory unless the transport moves
        # device memory itself (UCX with a CUDA transport); compute moves them on.
        self.device = device
        self.port = 0
        # Frames on the wire and the per-request frames they carried (batches carry
        # several); frames received (a batch counts once).
        self.frames_sent = self.parts_sent = self.frames_received = 0
        # Data-plane bytes of frames sent (`send_many`) and received, as framed.
        self.bytes_sent = self.bytes_received = 0
        self._counting = threading.Lock()  # frames are sent from other threads too (`send_now`)

    @property
    def device_memory(self) -> DeviceMemory:
        """Whether this transport carries payloads on its `device` as they are
        (`device_memory.py`: TCP never does; UCX when it can move CUDA memory)."""
        return HOST_ONLY

    @property
    def host_payloads(self) -> bool:
        """Whether payloads must be in host memory to be sent (senders copy device
        tensors first); received payloads are then in host memory too."""
        return not self.device_memory.carried

    def staged(self, payload: Tensor) -> Tensor:
        """`payload` where this transport reads it from: as it is when it is in host
        memory or on a device this transport carries, else a host copy (a stage makes
        that copy on its compute thread already, `compute_round.for_wire`, so the event
        loop never waits for the device here; this is for callers that did not)."""
        if payload.device.type == "cpu":
            return payload
        if not self.host_payloads and payload.device.type == torch.device(self.device).type:
            return payload
        return payload.cpu()

    def _admitted(self, header: pb.FrameHeader) -> Admission:
        """Whether the owner wants this frame (checked before its payload is allocated);
        for a batch frame, which of its parts (each judged on its own), or False for
        none. Pass the answer back to `_deliver`. Raises FrameError for a batch whose
        header contradicts itself (the connection is dropped)."""
        if header.kind == pb.PAYLOAD_KIND_BATCH:
            batch.check(header)
            keep = [self._admit_one(p) for p in header.parts]
            return keep if any(keep) else False
        return self._admit_one(header)

    def _admit_one(self, header: pb.FrameHeader) -> bool:
        if self.admit is None:
            return True
        try:
            return bool(self.admit(header))
        except Exception as e:
            rlog.warning(
                "admit", "%s: cannot judge a frame: %s: %s", self.scheme, type(e).__name__, e
            )
            return False

    def _deliver(self, frame: Frame, keep: Admission = True) -> None:
        """Hand a frame (or the admitted parts of a batch) to the owner; its failure
        never breaks the connection."""
        self.frames_received += 1
        self.bytes_received += received_bytes(frame)
        if frame.kind != pb.PAYLOAD_KIND_BATCH:
            self._deliver_one(frame)
            return
        parts = batch.split(frame)
        wanted = keep if isinstance(keep, list) else [bool(keep)] * len(parts)
        for part, ok in zip(parts, wanted, strict=True):
            if ok:
                self._deliver_one(part)

    def _deliver_one(self, frame: Frame) -> None:
        try:
            self.on_frame(frame)
        except Exception as e:
            # Request ids are capabilities (docs/architecture.md, "9. Security"): DEBUG only.
            rlog.error("deliver", "%s: handling a frame failed: %s: %s",
                       self.scheme, type(e).__name__, e)  # fmt: skip
            log.debug("%s: the frame that failed was of %s", self.scheme, frame.request_id)

    @property
    def address(self) -> str:
        return f"{self.scheme}://{self.advertise_host}:{self.port}"

    @abstractmethod
    async def start(self, port: int = 0) -> str:
        """Start listening (port 0: any free port); returns the advertised address."""

    @abstractmethod
    async def send_frame(
        self, address: str, header: pb.FrameHeader, payload: Tensor | None = None
    ) -> None:
        """Deliver one frame; frames to one address arrive in the order they were sent."""

    def post_frame(
        self, address: str, header: pb.FrameHeader, payload: Tensor | None = None
    ) -> bool:
        """Send a small frame at once without waiting, where the transport can do that
        in order; False (nothing sent): `send_frame` it. This one never can."""
        return False

    def post_bytes(self, address: str, header: pb.FrameHeader, data: bytes) -> bool:
        """`post_frame` of a frame whose payload is `data` as it is (a control frame's
        message, `control_frames.bytes_header`): no tensor made. False (nothing sent):
        send it as a tensor (`control_frames.bytes_frame`). This one never can."""
        return False

    @abstractmethod
    async def close(self) -> None:
        """Stop listening and close every connection."""

    async def send(
        self, address: str, act: Activation, seq: int, after_prune: int = 0, sender: str = ""
    ) -> None:
        header, payload = encode(act, seq, after_prune, sender)
        await self.send_frame(address, header, payload)

    async def send_many(self, address: str, parts: list[batch.Part], sender: str = "") -> None:
        """Frames of several requests to one address, as few batch frames as they fit
        (`batch.batches`); in order, like `send_frame` calls one after another."""
        for (header, payload), n in batch.frames(parts, sender):
            self._count(header, payload, n)  # before: the answer may be read before we resume
            try:
                await self.send_frame(address, header, payload)
            except BaseException:
                self._count(header, payload, n, -1)
                raise

    def send_now(self, address: str, parts: list[batch.Part], sender: str = "") -> bool:
        """From any thread: `parts` sent as `send_many` would, at once and without the
        event loop, where the transport can do that in order; False (nothing sent):
        `send_many` them. This one never can."""
        return False

    def _count(
        self, header: pb.FrameHeader, payload: Tensor | None, parts: int, sign: int = 1
    ) -> None:
        """A frame sent, of `parts` requests' frames (`sign` -1: one counted that was not)."""
        self._counted(sign, sign * parts, sign * frame_bytes(header, payload))

    def _counted(self, frames: int, parts: int, nbytes: int) -> None:
        """`frames` frames sent, of `parts` requests' frames and `nbytes` bytes as
        `frame_bytes` counts them (negative: ones counted that were not sent)."""
        with self._counting:
            self.bytes_sent += nbytes
            self.frames_sent += frames
            self.parts_sent += parts

    def _check_scheme(self, address: str) -> Address:
        addr = Address.parse(address)
        if addr.scheme != self.scheme:
            raise TransportError(
                f"{address}: this deployment's transport is {self.scheme}, not {addr.scheme}"
            )
        return addr


class Inbox:
    """Received frames sorted by request, each request's handed to its owner (frames of
    unknown requests are dropped: they belong to requests that were already released).
    An owner either takes a queue of its frames (`open`) or has them delivered to its
    own sink (`route`: the router's drivers put them beside their other events). As a
    transport's `admit`, it takes frames only of open requests, with at most their
    `max_rows` rows."""

    def __init__(self) -> None:
        self._sinks: dict[str, FrameHandler] = {}
        self._max_rows: dict[str, int] = {}
        self.dropped = 0

    def open(self, request_id: str, max_rows: int | None = None) -> asyncio.Queue[Frame]:
        q: asyncio.Queue[Frame] = asyncio.Queue()
        self.route(request_id, q.put_nowait, max_rows)
        return q

    def route(self, request_id: str, deliver: FrameHandler, max_rows: int | None = None) -> None:
        """Hand `request_id`'s frames to `deliver`, in arrival order."""
        self._sinks[request_id] = deliver
        if max_rows is not None:
            self._max_rows[request_id] = max_rows

    def close(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._max_rows.pop(request_id, None)

    def admit(self, header: pb.FrameHeader) -> bool:
        if header.request_id not in self._sinks:
            self.dropped += 1
            return False
        limit = self._max_rows.get(header.request_id)
        rows = len(header.rows.positions)
        if limit is None or rows <= limit:
            return True
        # A bug upstream, not a frame to wait for: fail the request now.
        why = f"a frame of {rows} rows from {header.sender}; this request has at most {limit}"
        self._sinks[header.request_id](Frame(error_header(header.request_id, why, header.sender)))
        return False

    def __call__(self, frame: Frame) -> None:
        deliver = self._sinks.get(frame.request_id)
        if deliver is None:
            self.dropped += 1
        else:
            deliver(frame)
