"""Frames: header + raw tensor bytes round-trip every payload kind and dtype; corrupt
or inconsistent frames are rejected, never executed (no pickle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from specpipe.common.spec.messages import Activation, Prune
from specpipe.services.control import prune_from_proto, prune_to_proto, token_activation
from specpipe.services.transport import Address, Frame, FrameError, decode, encode
from specpipe.services.transport.codec import (
    PREAMBLE,
    Kind,
    parse_header,
    parse_preamble,
    payload_bytes,
    tensor_from_bytes,
)
from specpipe.v1 import dataplane_pb2 as pb


def _roundtrip(act: Activation, seq: int = 3, after: int = 2) -> tuple[Frame, Activation]:
    header, payload = encode(act, seq, after, "stage x")
    raw = payload_bytes(payload)
    hb = header.SerializeToString()  # as the TCP transport frames it (without a tag)
    wire = PREAMBLE.pack(len(hb), 0 if raw is None else raw.nbytes) + hb
    hlen, plen = parse_preamble(wire[:12])
    parsed = parse_header(wire[12 : 12 + hlen], plen)
    buf = None if raw is None else np.frombuffer(raw.tobytes(), dtype=np.uint8).copy()
    frame = Frame(parsed, tensor_from_bytes(parsed, buf))
    return frame, decode(frame)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hidden_states_roundtrip(dtype: torch.dtype) -> None:
    act = Activation(
        "req-1",
        positions=torch.tensor([7, 8, 8]),
        node_ids=torch.tensor([10, 11, 12]),
        parent_ids=torch.tensor([-1, 10, 10]),
        hidden=torch.randn(3, 40).to(dtype),
    )
    frame, back = _roundtrip(act)
    assert (
        frame.header.seq == 3 and frame.header.after_prune == 2 and frame.header.sender == "stage x"
    )
    assert frame.kind == Kind.PAYLOAD_KIND_HIDDEN
    assert back.hidden.dtype == dtype and torch.equal(back.hidden, act.hidden)
    for name in ("positions", "node_ids", "parent_ids"):
        assert torch.equal(getattr(back, name), getattr(act, name))
    assert not back.committed


def test_tokens_committed_and_empty_roundtrip() -> None:
    chunk = Activation("r", torch.arange(5), committed=True, tokens=torch.arange(5) * 3)
    back = _roundtrip(chunk)[1]
    assert back.committed and torch.equal(back.tokens, chunk.tokens) and back.node_ids.numel() == 0
    empty = Activation("r", torch.empty(0, dtype=torch.int64))
    frame, back = _roundtrip(empty)
    assert frame.kind == Kind.PAYLOAD_KIND_EMPTY and len(back) == 0 and frame.payload is None


def test_payload_is_a_view_not_a_copy() -> None:
    hidden = torch.randn(4, 16)
    view = payload_bytes(hidden)
    view[0] = 0
    assert hidden.view(torch.uint8).reshape(-1)[0] == 0  # same memory: nothing copied


def test_inconsistent_frames_are_rejected() -> None:
    act = Activation("r", torch.arange(2), node_ids=torch.arange(2), parent_ids=torch.tensor([-1, 0]),
                     hidden=torch.randn(2, 8))  # fmt: skip
    header, _ = encode(act, 0)
    with pytest.raises(FrameError, match="announces"):
        parse_header(header.SerializeToString(), 17)
    with pytest.raises(FrameError, match="corrupt"):
        parse_header(b"\xff\xff\xff garbage", 0)
    header.dtype = "complex128"
    with pytest.raises(FrameError, match="unknown payload dtype"):
        tensor_from_bytes(header, np.zeros(64, dtype=np.uint8))
    header, _ = encode(act, 0)
    header.shape[:] = [3, 8]  # three rows announced, two positions listed
    buf = np.zeros(3 * 8 * 4, dtype=np.uint8)
    with pytest.raises(FrameError, match="rows"):
        decode(Frame(header, tensor_from_bytes(header, buf)))
    with pytest.raises(FrameError, match="too large"):
        parse_preamble((2**31).to_bytes(4, "little") + (0).to_bytes(8, "little"))


def test_an_empty_payload_with_a_huge_shape_is_refused() -> None:
    """No payload bytes, but dimensions whose strides overflow (found by the frame fuzz
    test): a FrameError, not torch's RuntimeError."""
    header = pb.FrameHeader(dtype="float64", shape=[0, 3, 3_074_457_345_618_258_603])
    with pytest.raises(FrameError, match="spans more than"):
        tensor_from_bytes(header, None)
    empty = pb.FrameHeader(dtype="float32", shape=[0, 151_936])  # an empty logits row set
    assert tensor_from_bytes(empty, None).shape == (0, 151_936)


def test_prune_signal_roundtrip_and_token_rows() -> None:
    prune = Prune(torch.tensor([4]), torch.tensor([6, 9]), horizon=12)
    back = prune_from_proto(prune_to_proto(prune, seq=5))
    assert torch.equal(back.commit_ids, prune.commit_ids) and torch.equal(
        back.keep_ids, prune.keep_ids
    )
    assert back.horizon == 12
    act = Activation(
        "r", torch.tensor([3, 4]), node_ids=torch.tensor([1, 2]), parent_ids=torch.tensor([-1, 1])
    )
    header, _ = encode(act, 0)
    layer = token_activation("r", header.rows, [5, 6])
    assert layer.tokens.tolist() == [5, 6]
    with pytest.raises(FrameError, match="token ids"):
        token_activation("r", header.rows, [5])


def test_address_parsing() -> None:
    a = Address.parse("ucx://10.0.0.5:41000")
    assert (a.scheme, a.host, a.port) == ("ucx", "10.0.0.5", 41000) and str(
        a
    ) == "ucx://10.0.0.5:41000"
    assert Address.parse("tcp://[::1]:7").host == "::1"
    for bad in ("10.0.0.5:41000", "tcp://host", "tcp://:80", "tcp://h:port"):
        with pytest.raises(ValueError):
            Address.parse(bad)
