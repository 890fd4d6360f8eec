"""Several requests' frames to one next hop as one frame (SpecPipe-DB).

A stage's compute round produces outputs for every request it batched; those that go
to the same next hop leave as one `PAYLOAD_KIND_BATCH` frame: the parts' headers in
`parts`, their payloads concatenated along rows. One frame per hop per step instead of
one per request: one preamble, one syscall (or UCX message) and one authentication tag.

The receiver splits a batch back into the frames it carries before its owner sees
them, so owners (stages, the router's inbox) only ever handle per-request frames, and
`admit` judges every part on its own. A batch is bounded like any frame: at most
`MAX_PARTS` parts and `MAX_ROWS` rows (no more than one request's largest activation,
so a receiver's `max_payload_bytes` holds) and `MAX_BATCH_BYTES`. A batch of device
payloads is concatenated on the device and waited for before the transport reads it
(`settled`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from specpipe.common.runtime.validation import MAX_ROWS
from specpipe.v1 import dataplane_pb2 as pb
from torch import Tensor

from .codec import DTYPE_NAMES, Frame, FrameError, Kind, as_sent, payload_nbytes

MAX_PARTS = 64
MAX_BATCH_BYTES = 64 << 20

Part = tuple[pb.FrameHeader, Tensor | None]


def _rows(header: pb.FrameHeader) -> int:
    """Rows a part's payload takes in the batch's payload (0 without one)."""
    return int(header.shape[0]) if header.dtype and header.shape else 0


def _layout(payload: Tensor | None) -> tuple[str, tuple[int, ...]] | None:
    return None if payload is None else (DTYPE_NAMES[payload.dtype], tuple(payload.shape[1:]))


def batches(parts: list[Part]) -> Iterator[list[Part]]:
    """`parts` in order, grouped into runs that fit one batch frame: one payload layout
    (dtype and row shape), at most MAX_PARTS parts, MAX_ROWS rows and MAX_BATCH_BYTES."""
    group: list[Part] = []
    layout, rows, nbytes = None, 0, 0
    for header, payload in parts:
        this = _layout(payload)
        r = 0 if payload is None else int(payload.shape[0])
        b = 0 if payload is None else payload.numel() * payload.element_size()
        fits = (
            len(group) < MAX_PARTS
            and rows + r <= MAX_ROWS
            and nbytes + b <= MAX_BATCH_BYTES
            and (this is None or layout is None or this == layout)
        )
        if group and not fits:
            yield group
            group, layout, rows, nbytes = [], None, 0, 0
        group.append((header, payload))
        layout = layout or this
        rows, nbytes = rows + r, nbytes + b
    if group:
        yield group


def frames(parts: list[Part], sender: str = "") -> Iterator[tuple[Part, int]]:
    """The frames `parts` go in, in order (`batches`: a run of one alone, longer runs
    `pack`ed), each with the number of parts it holds."""
    if len(parts) == 1:  # one request's frame (every step at one client): as it is
        yield parts[0], 1
        return
    for group in batches(parts):
        yield (group[0] if len(group) == 1 else pack(group, sender)), len(group)


def pack(parts: list[Part], sender: str = "") -> Part:
    """One batch frame of `parts` (a run from `batches`)."""
    outer = pb.FrameHeader(kind=Kind.PAYLOAD_KIND_BATCH, sender=sender)
    outer.parts.extend(h for h, _ in parts)
    payloads = [p for _, p in parts if p is not None and p.numel()]
    if not payloads:
        return outer, None
    with settled(payloads[0].device):
        payloads = [as_sent(p) for p in payloads]
        payload = payloads[0] if len(payloads) == 1 else torch.cat(payloads)
    outer.dtype = DTYPE_NAMES[payload.dtype]
    outer.shape.extend(payload.shape)
    return outer, payload


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def settled(device: torch.device) -> Iterator[None]:
    """The device work the block launches has finished when it exits.

    A transport may read a device payload's memory itself: UCX with a CUDA transport
    copies it on a stream of its own, which waits for none of ours, so a payload that a
    kernel makes (a batch's concatenation, on the event loop) must be complete before it
    is handed over. The block's kernels run on a side stream and only they are waited
    for: the compute stream may already run the next round's forward. Their inputs are
    complete already (the stage synchronizes its outputs on the compute thread,
    `compute_round.for_wire`). On the CPU there is nothing to wait for."""
    if device.type != "cuda":
        yield
        return
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        yield
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()


def check(header: pb.FrameHeader) -> None:
    """A batch header is consistent (before its payload is read): FrameError if not."""
    parts = header.parts
    if not 0 < len(parts) <= MAX_PARTS:
        raise FrameError(f"a batch frame of {len(parts)} parts; at most {MAX_PARTS}")
    rows = 0
    for p in parts:
        if p.kind == Kind.PAYLOAD_KIND_BATCH or p.parts:
            raise FrameError("a batch frame inside a batch frame")
        if p.dtype:
            if p.dtype != header.dtype or list(p.shape[1:]) != list(header.shape[1:]):
                raise FrameError(
                    f"a part of {p.dtype} {list(p.shape)} in a batch of "
                    f"{header.dtype} {list(header.shape)}"
                )
            payload_nbytes(p)  # negative dimensions
            rows += _rows(p)
        elif p.shape:
            raise FrameError("a part with a shape but no dtype")
    total = int(header.shape[0]) if header.dtype and header.shape else 0
    if rows != total:
        raise FrameError(f"the parts of a batch hold {rows} rows, its payload {total}")


def split(frame: Frame) -> list[Frame]:
    """The frames a (checked) batch frame carries; their payloads are views of its own."""
    out, start = [], 0
    for p in frame.header.parts:
        n = _rows(p)
        payload = None
        if p.dtype:
            assert frame.payload is not None
            payload = frame.payload[start : start + n].reshape(tuple(p.shape))
        out.append(Frame(p, payload))
        start += n
    return out
