"""A protobuf message as a data-plane frame (services/transport/control_frames.py): it
comes back as it went, a receiver reads no more than its limit, and bytes that are not
the message are a FrameError (the stage drops the frame), never a crash."""

from __future__ import annotations

import pytest
import torch
from specpipe.services.transport import FrameError
from specpipe.services.transport.codec import Frame
from specpipe.services.transport.control_frames import (
    CONTROL,
    admitted,
    message_frame,
    message_of,
)
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import stage_pb2


def test_a_message_round_trips_and_is_bounded() -> None:
    msg = stage_pb2.StageControl(
        feeds=[stage_pb2.FeedRequest(request_id="r", seq=2, token_ids=[1, 2, 3])],
        prunes=[pb.PruneRequest(request_id="r", prune=pb.PruneSignal(seq=1))],
    )
    header, payload = message_frame(CONTROL, "control:x", msg, "router", "tcp://127.0.0.1:9")
    assert header.request_id == "control:x" and header.reply_to == "tcp://127.0.0.1:9"
    assert payload is not None and list(header.shape) == [msg.ByteSize()]
    assert message_of(Frame(header, payload), stage_pb2.StageControl) == msg
    assert admitted(header, msg.ByteSize()) and not admitted(header, msg.ByteSize() - 1)
    header.dtype = "float32"
    assert not admitted(header, 1 << 20)  # a control frame carries bytes only


def test_an_empty_message_has_no_payload() -> None:
    header, payload = message_frame(CONTROL, "t", stage_pb2.StageControlReply())
    assert payload is None and not header.dtype and admitted(header, 0)
    assert message_of(Frame(header, None), stage_pb2.StageControlReply) == (
        stage_pb2.StageControlReply()
    )


def test_bytes_that_are_not_the_message_are_a_frame_error() -> None:
    header = pb.FrameHeader(request_id="t", kind=CONTROL, dtype="uint8", shape=[3])
    with pytest.raises(FrameError, match="not a StageControl"):
        message_of(Frame(header, torch.tensor([0xFF, 0xFF, 0xFF], dtype=torch.uint8)),
                   stage_pb2.StageControl)  # fmt: skip
