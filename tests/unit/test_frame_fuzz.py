"""Fuzzing the data-plane frame codec and the TCP frame reader (hypothesis): arbitrary
headers, mutated and truncated byte streams, with and without frame tags. Nothing may
escape but the codec's own FrameError / InvalidInput: a payload of another size than its
header announces is refused, the reader closes a connection on garbage and otherwise
delivers only frames whose payload matches their header, and with tags no header that
was changed on the way reaches the owner's `admit`."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from specpipe.common.runtime.errors import InvalidInput
from specpipe.common.runtime.validation import Limits, check_input
from specpipe.common.spec.messages import Activation
from specpipe.services.transport.auth import FrameAuth
from specpipe.services.transport.codec import (
    DTYPES,
    Frame,
    FrameError,
    decode,
    encode,
    parse_header,
    payload_bytes,
    tensor_from_bytes,
)
from specpipe.services.transport.tcp import TcpTransport, _FrameReader
from specpipe.v1 import dataplane_pb2 as pb

LIMITS = Limits(vocab_size=97, hidden_size=4, max_positions=256, dtype=torch.float32)
big = st.integers(-(2**63), 2**63 - 1)
small = st.integers(-3, 300)

headers = st.builds(
    pb.FrameHeader,
    request_id=st.text(max_size=8),
    seq=st.integers(0, 2**64 - 1),
    after_prune=st.integers(0, 2**64 - 1),
    rows=st.builds(
        pb.Rows,
        positions=st.lists(st.one_of(small, big), max_size=6),
        committed=st.booleans(),
        node_ids=st.lists(st.one_of(small, big), max_size=6),
        parent_ids=st.lists(st.one_of(small, big), max_size=6),
    ),
    kind=st.integers(0, 7),
    dtype=st.one_of(st.sampled_from([*DTYPES, ""]), st.text(max_size=6)),
    shape=st.lists(st.one_of(st.integers(-2, 6), big), max_size=4),
    error=st.text(max_size=8),
)


@settings(max_examples=300, deadline=None)
@given(header=headers, extra=st.integers(-3, 3), data=st.data())
def test_arbitrary_headers_decode_or_fail_cleanly(header, extra, data) -> None:
    try:
        n = _nbytes(header)
    except FrameError:
        return
    plen = max(0, n + extra) if n < 1 << 16 else 0
    raw = data.draw(st.binary(min_size=plen, max_size=plen))
    if plen != n:  # a payload of another size than announced never gets further
        with pytest.raises(FrameError, match="header announces"):
            parse_header(header.SerializeToString(), plen)
        return
    try:
        parsed = parse_header(header.SerializeToString(), plen)
        payload = tensor_from_bytes(
            parsed, np.frombuffer(raw, dtype=np.uint8).copy() if plen else None
        )
        act = decode(Frame(parsed, payload))
        check_input(act, LIMITS, first=parsed.kind == pb.PAYLOAD_KIND_TOKENS)
    except (FrameError, InvalidInput):
        pass


def _nbytes(header) -> int:
    from specpipe.services.transport.codec import payload_nbytes

    return payload_nbytes(header)


class _FakeTransport:
    """What a _FrameReader writes to and closes."""

    def __init__(self) -> None:
        self.closed, self.written = False, b""

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name):
        return None


def _owner(auth=None) -> tuple[TcpTransport, list[Frame], list[bytes]]:
    """A receiver, the frames it delivers and the headers its `admit` was shown."""
    got: list[Frame] = []
    admitted: list[bytes] = []
    owner = TcpTransport(got.append, auth=auth, max_payload_bytes=1 << 20,
                         admit=lambda h: admitted.append(h.SerializeToString()) or True)  # fmt: skip
    owner.check_every = 0  # no timers: no event loop here
    return owner, got, admitted


def _header_bytes(rows: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    act = Activation("r", torch.arange(rows), node_ids=torch.arange(rows),
                     parent_ids=torch.full((rows,), -1), hidden=torch.randn(rows, 4, generator=g))  # fmt: skip
    return encode(act, seed)[0].SerializeToString()


def _frame_bytes(rows: int, seed: int, mac=None) -> bytes:
    g = torch.Generator().manual_seed(seed)
    act = Activation("r", torch.arange(rows), node_ids=torch.arange(rows),
                     parent_ids=torch.full((rows,), -1), hidden=torch.randn(rows, 4, generator=g))  # fmt: skip
    header, payload = encode(act, seed)
    hb = header.SerializeToString()
    data = payload_bytes(payload)
    body = b"" if data is None else data.tobytes()
    if mac is None:
        return struct.pack("<IQ", len(hb), len(body)) + hb + body
    htag = mac.header_tag(hb)  # right after the header, checked before it has any effect
    return struct.pack("<IQ", len(hb), len(body)) + hb + htag + body + mac.payload_tag(data)


def _feed(reader: _FrameReader, stream: bytes, cuts: list[int]) -> None:
    """Deliver `stream` to the reader in pieces, as the event loop would."""
    pos = 0
    bounds = sorted({min(c, len(stream)) for c in cuts} | {len(stream)})
    for end in bounds:
        while pos < end and not reader._transport.closed:
            buf = reader.get_buffer(-1)
            n = min(len(buf), end - pos)
            if n == 0:
                break
            buf[:n] = stream[pos : pos + n]
            pos += n
            reader.buffer_updated(n)


mutations = st.lists(
    st.tuples(st.sampled_from(["flip", "cut", "insert"]), st.integers(0, 10_000), st.binary(max_size=12)),
    max_size=3,
)  # fmt: skip


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    muts=mutations,
    cuts=st.lists(st.integers(0, 10_000), max_size=8),
    secure=st.booleans(),
)
def test_mutated_streams_never_crash_the_reader(rows, muts, cuts, secure) -> None:
    auth = FrameAuth(b"s" * 32) if secure else None
    owner, got, admitted = _owner(auth)
    reader = _FrameReader(owner)
    fake = _FakeTransport()
    reader.connection_made(fake)
    mac = auth.session(fake.written) if auth else None
    clean = [_frame_bytes(n, i, mac) for i, n in enumerate(rows)]
    stream = bytearray(b"".join(clean))
    for op, at, blob in muts:
        at = at % (len(stream) + 1)
        if op == "flip" and stream:
            stream[at % len(stream)] ^= 1 + (blob[0] if blob else 0) % 255
        elif op == "cut":
            del stream[at : at + 1 + len(blob)]
        else:
            stream[at:at] = blob
    _feed(reader, bytes(stream), cuts)
    # Whatever arrived is consistent: its payload is what its header announces.
    for f in got:
        try:
            act = decode(f)
        except FrameError:
            continue
        if act.hidden is not None:
            assert act.hidden.shape[0] == len(act)
    if not muts:  # the clean stream arrives whole
        assert len(got) == len(rows) and not fake.closed
    elif secure:  # with tags, only frames before the first changed byte can arrive
        changed = next((i for i, (a, b) in enumerate(zip(stream, b"".join(clean), strict=False)) if a != b),
                       min(len(stream), len(b"".join(clean))))  # fmt: skip
        whole = np.cumsum([len(c) for c in clean])
        assert len(got) <= int((whole <= changed).sum())
        # No header changed on the way reached `admit`: those it saw are the clean ones.
        assert admitted == [_header_bytes(n, i) for i, n in enumerate(rows)][: len(admitted)]


@pytest.mark.parametrize("secure", [False, True])
def test_small_and_large_frames_in_any_reads_arrive_whole_or_are_read_past(secure) -> None:
    """Frames of a few rows share reads (the staging buffer), a payload larger than it is
    read straight into its own buffer, and a refused frame, small or large, is read past:
    whatever the read boundaries, the admitted frames arrive intact and in order."""
    auth = FrameAuth(b"s" * 32) if secure else None
    got: list[Frame] = []
    owner = TcpTransport(got.append, auth=auth, max_payload_bytes=1 << 24,
                         admit=lambda h: h.seq % 3 != 1)  # fmt: skip
    owner.check_every = 0
    reader = _FrameReader(owner)
    fake = _FakeTransport()
    reader.connection_made(fake)
    mac = auth.session(fake.written) if auth else None
    rows = [2, 5000, 3, 9000, 6000, 1, 0, 7000, 2]  # 5000+ rows of width 4: > 64 KiB
    stream = b"".join(_frame_bytes(n, i, mac) for i, n in enumerate(rows))
    rng = np.random.default_rng(5)
    _feed(reader, stream, rng.integers(0, len(stream), 12).tolist())
    kept = [(i, n) for i, n in enumerate(rows) if i % 3 != 1]
    assert not fake.closed and [f.header.seq for f in got] == [i for i, _ in kept]
    for f, (i, n) in zip(got, kept, strict=True):
        want = torch.randn(n, 4, generator=torch.Generator().manual_seed(i))  # as sent
        hidden = decode(f).hidden
        assert (hidden is None and n == 0) or torch.equal(hidden, want)
