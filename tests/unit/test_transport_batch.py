"""Several requests' frames to one hop travel as one batch frame (SpecPipe-DB) and
arrive as the per-request frames they were, each admitted on its own."""

from __future__ import annotations

import asyncio

import pytest
import torch
from specpipe.common.runtime.validation import MAX_ROWS
from specpipe.services.transport import (
    FrameError,
    Inbox,
    decode,
    encode,
    make_transport,
)
from specpipe.services.transport import batch as B
from specpipe.services.transport.codec import Frame, empty_header, error_header
from specpipe.v1 import dataplane_pb2 as pb

from .test_transport_loopback import KINDS, _act


def _parts(spec: list[tuple[str, int]], width: int = 1536) -> list[B.Part]:
    out = []
    for i, (rid, n) in enumerate(spec):
        if n < 0:
            out.append((empty_header(rid, i), None))
        else:
            act = _act(rid, n, i)
            act.hidden = act.hidden[:, :width]
            out.append(encode(act, seq=i, after_prune=i))
    return out


def test_pack_and_split_give_back_every_part() -> None:
    parts = _parts([("a", 3), ("b", 1), ("a", -1), ("c", 0), ("b", 5)])
    header, payload = B.pack(parts, "stage 1")
    assert header.kind == pb.PAYLOAD_KIND_BATCH and len(header.parts) == 5
    assert list(header.shape) == [9, 1536]
    B.check(header)
    got = B.split(Frame(header, payload))
    for (h, p), f in zip(parts, got, strict=True):
        assert f.header == h
        if p is None:
            assert f.payload is None
        else:
            assert torch.equal(f.payload, p)


def test_runs_keep_one_layout_and_the_bounds() -> None:
    mixed = _parts([("a", 2), ("b", 2)], width=8) + _parts([("c", 2)], width=16)
    assert [len(g) for g in B.batches(mixed)] == [2, 1]  # another row width: a new frame
    many = _parts([(f"r{i}", 1) for i in range(B.MAX_PARTS + 3)], width=8)
    assert [len(g) for g in B.batches(many)] == [B.MAX_PARTS, 3]
    big = MAX_ROWS // 2 + 1  # two of these exceed the rows one frame may carry
    assert [len(g) for g in B.batches(_parts([("a", big), ("b", big)], width=4))] == [1, 1]
    # Order is kept: the parts of all runs, concatenated, are the input.
    assert [h for g in B.batches(mixed) for h, _ in g] == [h for h, _ in mixed]


@pytest.mark.parametrize(
    "spoil, why",
    [
        (lambda h: h.parts[0].shape.__setitem__(0, 4), "hold"),
        (lambda h: setattr(h.parts[1], "dtype", "float64"), "in a batch of"),
        (lambda h: h.parts[0].parts.add(), "inside a batch"),
        (lambda h: h.parts.extend([pb.FrameHeader()] * B.MAX_PARTS), "at most"),
        (lambda h: h.ClearField("parts"), "0 parts"),
    ],
)
def test_inconsistent_batch_headers_are_refused(spoil, why) -> None:
    header, _ = B.pack(_parts([("a", 3), ("b", 1)]))
    spoil(header)
    with pytest.raises(FrameError, match=why):
        B.check(header)


@pytest.mark.parametrize("kind", KINDS)
def test_one_frame_per_hop_each_part_admitted_alone(kind: str) -> None:
    """Four requests' outputs for one hop: one frame on the wire; the inbox gets each
    request's frame (intact, in order); a part of an unknown request is dropped alone
    and an oversized part fails only its own request."""

    async def main() -> None:
        inbox = Inbox()
        qa, qb, qc = inbox.open("a"), inbox.open("b", max_rows=2), inbox.open("c")
        rx = make_transport(kind, inbox, admit=inbox.admit)
        tx = make_transport(kind, lambda f: None)
        addr = await rx.start()
        await tx.start()
        try:
            parts = _parts([("a", 3), ("gone", 2), ("b", 5), ("c", -1), ("a", 1)])
            parts.append((error_header("c", "failed upstream"), None))
            await tx.send_many(addr, parts, "stage 1")
            assert (tx.frames_sent, tx.parts_sent) == (1, 6)
            a0, a1 = [await asyncio.wait_for(qa.get(), 10) for _ in range(2)]
            assert torch.equal(decode(a0).hidden, parts[0][1]) and a0.header.seq == 0
            assert torch.equal(decode(a1).hidden, parts[4][1]) and a1.header.seq == 4
            b = await asyncio.wait_for(qb.get(), 10)  # 5 rows where 2 are allowed
            assert b.kind == pb.PAYLOAD_KIND_ERROR and "at most 2" in b.header.error
            c0, c1 = [await asyncio.wait_for(qc.get(), 10) for _ in range(2)]
            assert c0.kind == pb.PAYLOAD_KIND_EMPTY and c1.header.error == "failed upstream"
            assert inbox.dropped == 1 and rx.frames_received == 1
        finally:
            await tx.close()
            await rx.close()

    asyncio.run(main())


def test_a_batch_that_contradicts_itself_closes_the_connection() -> None:
    """Over TCP (the check itself, `batch.check`, is the same for UCX; when a UCX sender
    notices the dropped endpoint depends on ucxx's timing)."""
    kind = "tcp"

    async def main() -> None:
        got: list[Frame] = []
        rx = make_transport(kind, got.append)
        tx = make_transport(kind, lambda f: None)
        addr = await rx.start()
        await tx.start()
        try:
            header, payload = B.pack(_parts([("a", 3), ("b", 1)]))
            header.parts[1].dtype = "float64"  # not the batch's dtype
            await tx.send_frame(addr, header, payload)
            await asyncio.sleep(0.3)
            assert got == []
            # The receiver still serves: the sender's next frame, on a fresh connection,
            # arrives.
            await tx.send_many(addr, _parts([("a", 2)]))
            for _ in range(100):
                if got:
                    break
                await asyncio.sleep(0.05)
            assert [f.request_id for f in got] == ["a"]
        finally:
            await tx.close()
            await rx.close()

    asyncio.run(main())


class _FakeCuda:
    """torch.cuda's streams and events as a log of what is asked of them."""

    def __init__(self, monkeypatch) -> None:
        import contextlib

        self.log: list[str] = []
        log = self.log

        class Stream:
            def __init__(self, device) -> None:
                log.append(f"new stream {device}")

        class Event:
            def record(self, stream) -> None:
                log.append(f"record on {type(stream).__name__}")

            def synchronize(self) -> None:
                log.append("wait for the event")

        @contextlib.contextmanager
        def stream(s):
            log.append("enter side stream")
            yield
            log.append("leave side stream")

        for name, value in (("Stream", Stream), ("Event", Event), ("stream", stream)):
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.append("device sync"))
        monkeypatch.setattr(B, "_side_streams", {})


def test_device_work_for_the_transport_is_finished_before_it_is_handed_over(
    monkeypatch,
) -> None:
    """UCX copies a device payload on its own stream: what the event loop launches to
    make a payload runs on a side stream whose event is waited for before `settled`
    returns, and only that event (never the whole device, which may be running the
    next forward). The side stream is made once per device."""
    cuda = _FakeCuda(monkeypatch)
    dev = torch.device("cuda", 0)
    for _ in range(2):
        with B.settled(dev):
            cuda.log.append("concatenate")
    once = ["enter side stream", "concatenate", "leave side stream"]
    once += ["record on Stream", "wait for the event"]
    assert cuda.log == [f"new stream {dev}", *once, *once]


def test_host_payloads_touch_no_device(monkeypatch) -> None:
    cuda = _FakeCuda(monkeypatch)
    with B.settled(torch.device("cpu")):
        pass
    B.pack(_parts([("a", 3), ("b", 1)]))
    assert cuda.log == []


def test_a_batch_is_concatenated_inside_settled(monkeypatch) -> None:
    """`pack` makes its payload (copies and concatenation) inside `settled`, for the
    payloads' device."""
    import contextlib

    log: list[str] = []
    cat = torch.cat

    @contextlib.contextmanager
    def settled(device):
        log.append(f"settle {device}")
        yield
        log.append("settled")

    monkeypatch.setattr(B, "settled", settled)
    monkeypatch.setattr(torch, "cat", lambda xs: log.append("cat") or cat(xs))
    _, payload = B.pack(_parts([("a", 3), ("b", 1)]))
    assert log == ["settle cpu", "cat", "settled"]
    assert payload.shape[0] == 4
