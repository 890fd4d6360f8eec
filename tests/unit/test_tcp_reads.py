"""The TCP receiver reads the same frames whatever the reads' boundaries: a frame that
lies whole in one read is taken from it in one pass (`_FrameReader._whole`), one cut
anywhere is read part by part, and both check the secure tags the same way."""

from __future__ import annotations

import asyncio

import pytest
import torch
from specpipe.common.spec.messages import Activation
from specpipe.services.transport import Inbox, tcp
from specpipe.services.transport.auth import FrameAuth
from specpipe.services.transport.codec import decode, encode, payload_bytes
from specpipe.services.transport.control_frames import CONTROL, bytes_frame, message_of
from specpipe.v1 import stage_pb2

CHALLENGE = b"c" * 16


class _Socket:
    def get_extra_info(self, key):
        return None

    def write(self, data) -> None:
        pass

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False


def _stream(auth: FrameAuth | None) -> tuple[bytes, list]:
    """Bytes of a run of frames (activations, control messages, a frame of a request
    nobody holds, an empty one) and what each kept frame carries."""
    mac = auth.session(CHALLENGE) if auth is not None else None
    g = torch.Generator().manual_seed(0)
    out, want = [], []
    for i, (rid, n) in enumerate([("a", 3), ("gone", 2), ("a", 0), ("a", 1)]):
        act = Activation(rid, positions=torch.arange(n), node_ids=torch.arange(n),
                         parent_ids=torch.arange(n) - 1, hidden=torch.randn(n, 8, generator=g))  # fmt: skip
        header, payload = encode(act, seq=i)
        out += tcp._frame_writes(mac, header.SerializeToString(), payload_bytes(payload))
        if rid == "a":
            want.append(("act", i, act.hidden))
    msg = stage_pb2.StageControl(releases=[{"request_id": "x"}])
    header, payload = bytes_frame(CONTROL, "a", msg.SerializeToString(), "router")
    out += tcp._frame_writes(mac, header.SerializeToString(), payload_bytes(payload))
    want.append(("msg", msg, None))
    return b"".join(bytes(b) for b in out), want


def _read(data: bytes, cuts: list[int], auth: FrameAuth | None, monkeypatch) -> list:
    got: list = []
    inbox = Inbox()
    inbox.route("a", got.append)

    async def main() -> None:
        t = tcp.TcpTransport(inbox, auth=auth, admit=inbox.admit)
        t.check_every = 0
        monkeypatch.setattr(FrameAuth, "challenge", staticmethod(lambda: CHALLENGE))
        r = tcp._FrameReader(t)
        r.connection_made(_Socket())  # type: ignore[arg-type]
        at = 0
        for end in [*cuts, len(data)]:
            while at < end:
                buf = r.get_buffer(-1)
                n = min(len(buf), end - at)
                buf[:n] = data[at : at + n]
                r.buffer_updated(n)
                at += n

    asyncio.run(main())
    return got


def _check(got: list, want: list) -> None:
    assert len(got) == len(want)
    for frame, (kind, a, b) in zip(got, want, strict=True):
        if kind == "msg":
            assert message_of(frame, stage_pb2.StageControl) == a
            continue
        assert frame.header.seq == a
        hidden = decode(frame).hidden
        assert hidden is not None and torch.equal(hidden, b)


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secure"])
def test_frames_read_the_same_whatever_the_reads(secure: bool, monkeypatch) -> None:
    auth = FrameAuth(b"k" * 32) if secure else None
    data, want = _stream(auth)
    _check(_read(data, [], auth, monkeypatch), want)  # every frame whole in one read
    for cut in range(1, len(data), 7):  # one cut anywhere
        _check(_read(data, [cut], auth, monkeypatch), want)
    _check(_read(data, list(range(1, len(data))), auth, monkeypatch), want)  # byte by byte


def test_a_forged_frame_read_whole_closes_the_connection(monkeypatch) -> None:
    auth = FrameAuth(b"k" * 32)
    data, _ = _stream(auth)
    forged = bytearray(data)
    forged[20] ^= 1  # in the first frame's header
    assert _read(bytes(forged), [], auth, monkeypatch) == []
