"""The data-plane interface shared by the UCX and TCP transports.

A transport listens at one address and sends frames to any address: the next hop of each
request is named in the request's route
(docs/architecture.md, "6. Control plane and data plane"), not fixed per process.
Received frames are handed to a callback in the event loop; `Inbox` turns them into one
asyncio queue per request.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from specpipe.common.spec.messages import Activation
from specpipe.v1 import dataplane_pb2 as pb
from torch import Tensor

from .codec import Frame, encode

FrameHandler = Callable[[Frame], None]


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
    ) -> None:
        self.on_frame = on_frame
        self.bind_host = bind_host
        self.advertise_host = advertise_host or (
            "127.0.0.1" if bind_host in ("0.0.0.0", "::", "") else bind_host
        )
        # Where received payloads are placed: host memory unless the transport moves
        # device memory itself (UCX with a CUDA transport); compute moves them on.
        self.device = device
        self.port = 0

    @property
    def host_payloads(self) -> bool:
        """Whether payloads must be in host memory to be sent (senders copy device
        tensors first); received payloads are then in host memory too."""
        return True

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

    @abstractmethod
    async def close(self) -> None:
        """Stop listening and close every connection."""

    async def send(
        self, address: str, act: Activation, seq: int, after_prune: int = 0, sender: str = ""
    ) -> None:
        header, payload = encode(act, seq, after_prune, sender)
        await self.send_frame(address, header, payload)

    def _check_scheme(self, address: str) -> Address:
        addr = Address.parse(address)
        if addr.scheme != self.scheme:
            raise TransportError(
                f"{address}: this deployment's transport is {self.scheme}, not {addr.scheme}"
            )
        return addr


class Inbox:
    """Received frames sorted into one queue per request (frames of unknown requests
    are dropped: they belong to requests that were already released)."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[Frame]] = {}
        self.dropped = 0

    def open(self, request_id: str) -> asyncio.Queue[Frame]:
        q: asyncio.Queue[Frame] = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def __call__(self, frame: Frame) -> None:
        q = self._queues.get(frame.request_id)
        if q is None:
            self.dropped += 1
        else:
            q.put_nowait(frame)
