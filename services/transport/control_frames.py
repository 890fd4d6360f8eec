"""Control messages as data-plane frames (docs/architecture.md, "6. Control plane and
data plane"): a router's feeds and prunes for a stage (`StageControl`) and the stage's
answer (`StageControlReply`), or its calls to the draft (`DraftControl`) and the draft's
answers (`DraftControlReply`), ride the data plane, a protobuf message's bytes as a
uint8 payload. A step's control to 4 stages, one frame each, costs about half the CPU of
its messages on gRPC streams, both ends together (`benchmarks/bench_host.py --wire`).

The frame's `request_id` is the router's token for the stream the message belongs to
(the stage echoes it, so the router's `Inbox` hands the answer to that stream), and
`reply_to` the router's data-plane address, which the receiver answers only where it is
one of its peers (`read_control`). The frames are authenticated like every other
(`--secure`), and a receiver reads no more of one than its `limit` (`admitted`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from google.protobuf.message import DecodeError, Message
from specpipe.common.runtime.errors import InvalidInput
from specpipe.v1 import dataplane_pb2 as pb

from ..control import FrameError
from ..ratelog import RateLimitedLog
from .background_sends import BackgroundSends
from .codec import Frame, Kind

rlog = RateLimitedLog(logging.getLogger(__name__))

CONTROL = Kind.PAYLOAD_KIND_CONTROL
CONTROL_REPLY = Kind.PAYLOAD_KIND_CONTROL_REPLY


def message_frame(
    kind: int, token: str, msg: Message, sender: str = "", reply_to: str = ""
) -> tuple[pb.FrameHeader, torch.Tensor | None]:
    """Header and payload of a frame carrying `msg` (an empty message: no payload)."""
    return bytes_frame(kind, token, msg.SerializeToString(), sender, reply_to)


def bytes_frame(
    kind: int, token: str, data: bytes, sender: str = "", reply_to: str = ""
) -> tuple[pb.FrameHeader, torch.Tensor | None]:
    """`message_frame` of a message already serialized (`data`)."""
    header = bytes_header(kind, token, len(data), sender, reply_to)
    if not data:
        return header, None
    return header, torch.frombuffer(bytearray(data), dtype=torch.uint8)


def bytes_header(
    kind: int, token: str, nbytes: int, sender: str = "", reply_to: str = ""
) -> pb.FrameHeader:
    """The header of a frame carrying a message of `nbytes` bytes (a transport's
    `post_bytes` sends it with the bytes as they are: no tensor)."""
    header = pb.FrameHeader(request_id=token, kind=kind, sender=sender, reply_to=reply_to)
    if nbytes:
        header.dtype, header.shape[:] = "uint8", [nbytes]
    return header


def admitted(header: pb.FrameHeader, limit: int) -> bool:
    """Whether a message frame's payload is worth reading: bytes, at most `limit`."""
    if not header.dtype:
        return True
    return header.dtype == "uint8" and len(header.shape) == 1 and 0 <= header.shape[0] <= limit


def message_of(frame: Frame, cls: type[Message]) -> Message:
    """The message a frame carries. Raises FrameError for one that is not a `cls`."""
    msg = cls()
    data = frame.raw  # the bytes as received: no tensor made
    if data is None:
        if frame.payload is None:
            return msg
        data = frame.payload.numpy()
    try:
        msg.ParseFromString(memoryview(data))
    except DecodeError as e:
        raise FrameError(f"a control frame that is not a {cls.__name__}: {e}") from None
    return msg


def read_control(
    frame: Frame, cls: type[Message], check_hop: Callable[[str], None], who: str
) -> Message | None:
    """The control message a replica received (a `cls`), if its reply address passes
    `check_hop` (one of the replica's peers: nobody makes a replica send its answers
    elsewhere); None, logged, for a bad one."""
    h = frame.header
    try:
        msg = message_of(frame, cls)
        check_hop(h.reply_to)
    except (FrameError, InvalidInput) as e:
        rlog.warning("bad-control", "%s: bad control frame from %s: %s", who, h.sender, e)
        return None
    return msg


def reply_frame(
    request: pb.FrameHeader, reply: Message, who: str
) -> tuple[pb.FrameHeader, torch.Tensor | None]:
    """The frame answering the control frame `request` (read by `read_control`) with
    `reply`, named by its token; it goes to `request.reply_to`."""
    return message_frame(CONTROL_REPLY, request.request_id, reply, who)


def answer(sends: BackgroundSends, request: pb.FrameHeader, reply: Message, who: str) -> None:
    """Send `reply` to the control frame `request` back to its sender's address."""
    header, payload = reply_frame(request, reply, who)
    sends.send(request.reply_to, header, payload, "answer a control frame", who)
