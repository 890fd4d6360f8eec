"""Hidden-state data plane between stages: UCX, or plain TCP where UCX is missing."""

from __future__ import annotations

from .base import Address, FrameHandler, Inbox, Transport, TransportError
from .codec import Frame, FrameError, decode, encode

TRANSPORTS = ("ucx", "tcp")


def make_transport(kind: str, on_frame: FrameHandler, **kwargs) -> Transport:
    """The transport of a deployment: "ucx" (default where ucxx imports) or "tcp"."""
    if kind == "ucx":
        from .ucx import UcxTransport

        return UcxTransport(on_frame, **kwargs)
    if kind == "tcp":
        from .tcp import TcpTransport

        return TcpTransport(on_frame, **kwargs)
    raise ValueError(f"unknown transport {kind!r} (choose from {TRANSPORTS})")


__all__ = [
    "TRANSPORTS",
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
