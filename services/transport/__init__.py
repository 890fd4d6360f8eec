"""Hidden-state data plane between stages: UCX, or plain TCP where UCX is missing."""

from __future__ import annotations

from .base import Address, FrameHandler, Inbox, Transport, TransportError
from .codec import Frame, FrameError, decode, encode

TRANSPORTS = ("ucx", "tcp")  # every data plane: UCX where ucxx imports, TCP anywhere
UCX, TCP = TRANSPORTS


def make_transport(kind: str, on_frame: FrameHandler, **kwargs) -> Transport:
    """The transport of a deployment: "ucx" (default where ucxx imports) or "tcp"."""
    if kind == UCX:
        from .ucx import UcxTransport

        return UcxTransport(on_frame, **kwargs)
    if kind == TCP:
        from .tcp import TcpTransport

        return TcpTransport(on_frame, **kwargs)
    raise ValueError(f"unknown transport {kind!r} (choose from {TRANSPORTS})")


__all__ = [
    "TCP",
    "TRANSPORTS",
    "UCX",
    "Address",
    "Frame",
    "FrameError",
    "FrameHandler",
    "Inbox",
    "Transport",
    "TransportError",
    "decode",
    "encode",
    "make_transport",
]
