"""Activation <-> data-plane frame: a small protobuf header plus the raw tensor bytes.

A frame is what one stage hands the next hop for one request: the rows' metadata (node
ids, parents, positions, the request's ordering numbers) in a `FrameHeader`, and the
hidden states (or token ids) as the bytes of one C-contiguous tensor. Never pickle: the
receiver rebuilds the tensor from dtype and shape without executing anything. The rows
are converted as on the control plane (`services/control.py`).
"""

from __future__ import annotations

import struct

import numpy as np
import torch
from specpipe.common.spec.messages import Activation
from specpipe.v1 import dataplane_pb2 as pb
from torch import Tensor

from ..control import FrameError, activation_from_rows, rows_to_proto

# Preamble on stream transports: header length (u32) and payload length (u64).
PREAMBLE = struct.Struct("<IQ")
# The most a receiver reads of one frame (docs/architecture.md, "9. Security"): a header
# lists at most validation.MAX_ROWS rows (a few hundred KB); payloads are bounded again
# per frame by the receiver (`Transport.admit`, `max_payload_bytes`).
MAX_HEADER_BYTES = 4 << 20
MAX_PAYLOAD_BYTES = 1 << 30

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,  # exactness deployments (tests): no rounding noise between shapes
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "uint8": torch.uint8,  # a protobuf message's bytes (control frames, `control_frames.py`)
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

Kind = pb.PayloadKind


class Frame:
    """One data-plane message: the decoded header and the payload tensor (or None).

    A receiver may give the payload's bytes as received instead (`raw`, checked
    against the header already): the tensor is made from them when `payload` is first
    read, so a frame whose owner reads only its bytes (a control frame's message,
    `control_frames.message_of`) costs no tensor (issue 34: a cold torch call costs
    tens of microseconds)."""

    __slots__ = ("_payload", "header", "raw")

    def __init__(
        self,
        header: pb.FrameHeader,
        payload: Tensor | None = None,
        raw: np.ndarray | None = None,
    ) -> None:
        self.header = header
        self._payload = payload
        self.raw = raw  # the payload's bytes (uint8), when `payload` is not made yet

    @property
    def payload(self) -> Tensor | None:
        if self._payload is None and self.raw is not None:
            self._payload = tensor_from_bytes(self.header, self.raw)
        return self._payload

    @payload.setter
    def payload(self, value: Tensor | None) -> None:
        self._payload, self.raw = value, None

    def __repr__(self) -> str:
        return f"Frame(kind={self.kind}, request_id={self.request_id!r})"

    @property
    def request_id(self) -> str:
        return self.header.request_id

    @property
    def kind(self) -> int:
        return self.header.kind


def encode(
    act: Activation, seq: int, after_prune: int = 0, sender: str = ""
) -> tuple[pb.FrameHeader, Tensor | None]:
    """Header and payload tensor of an activation (hidden states or token ids)."""
    if act.hidden is not None:
        kind, payload = Kind.PAYLOAD_KIND_HIDDEN, act.hidden
    elif act.tokens is not None:
        kind, payload = Kind.PAYLOAD_KIND_TOKENS, act.tokens
    else:
        kind, payload = Kind.PAYLOAD_KIND_EMPTY, None
    header = pb.FrameHeader(
        request_id=act.request_id,
        seq=seq,
        after_prune=after_prune,
        rows=rows_to_proto(act),
        kind=kind,
        sender=sender,
    )
    if payload is not None:
        payload = as_sent(payload)
        try:
            header.dtype = DTYPE_NAMES[payload.dtype]
        except KeyError:
            raise FrameError(f"cannot send tensors of dtype {payload.dtype}") from None
        header.shape.extend(payload.shape)
    return header, payload


def as_sent(payload: Tensor) -> Tensor:
    """A payload as a frame carries it: C-contiguous, out of any autograd graph; the
    tensor itself where it is both already (no new view, no copy: a transport that
    carries device memory gets exactly what the stage computed)."""
    if payload.requires_grad:
        payload = payload.detach()
    return payload.contiguous()


def empty_header(request_id: str, seq: int, sender: str = "") -> pb.FrameHeader:
    """Marks that activation `seq` had no rows left after pruning (keeps the order)."""
    return pb.FrameHeader(
        request_id=request_id, seq=seq, kind=Kind.PAYLOAD_KIND_EMPTY, sender=sender
    )


def error_header(request_id: str, message: str, sender: str = "") -> pb.FrameHeader:
    return pb.FrameHeader(
        request_id=request_id, kind=Kind.PAYLOAD_KIND_ERROR, error=message, sender=sender
    )


def payload_bytes(payload: Tensor | None) -> np.ndarray | None:
    """A uint8 numpy view of the payload's bytes (no copy for CPU tensors). A contiguous
    host tensor of a dtype numpy has is viewed through numpy: one torch call, where
    torch's own views cost three (issue 34: about 12 us a frame, cold twice that)."""
    if payload is None or payload.numel() == 0:
        return None
    if payload.dtype in _NUMPY_DTYPES and payload.dim() and payload.is_contiguous():
        try:
            return payload.numpy().view(np.uint8).reshape(-1)
        except RuntimeError:  # a tensor that needs its grad, or not on the host
            pass
    return payload.reshape(-1).view(torch.uint8).numpy()


# dtypes whose tensors `.numpy()` views (bfloat16 has no numpy dtype)
_NUMPY_DTYPES = frozenset(d for d in DTYPES.values() if d != torch.bfloat16)


def payload_nbytes(header: pb.FrameHeader) -> int:
    """Bytes of the payload the header announces (0 for none)."""
    if not header.dtype:
        return 0
    try:
        itemsize = DTYPES[header.dtype].itemsize
    except KeyError:
        raise FrameError(f"unknown payload dtype {header.dtype!r}") from None
    n = span = 1
    for d in header.shape:
        if d < 0:
            raise FrameError(f"negative dimension in payload shape {list(header.shape)}")
        n *= d
        span *= max(d, 1)
        # An empty tensor's other dimensions still make its strides: bounded like a payload.
        if span * itemsize > MAX_PAYLOAD_BYTES:
            raise FrameError(
                f"payload shape {list(header.shape)} spans more than {MAX_PAYLOAD_BYTES} bytes"
            )
    return n * itemsize


def tensor_from_bytes(header: pb.FrameHeader, buf: np.ndarray | Tensor | None) -> Tensor | None:
    """Rebuild the payload tensor from received bytes (a uint8 buffer we own)."""
    nbytes = payload_nbytes(header)
    if nbytes == 0:
        if header.dtype:
            return torch.empty(tuple(header.shape), dtype=DTYPES[header.dtype])
        return None
    if buf is None:
        raise FrameError("frame announces a payload but none arrived")
    numpy_dtype = _NUMPY_OF.get(header.dtype)
    if (
        numpy_dtype is not None
        and isinstance(buf, np.ndarray)
        and buf.ndim == 1
        and buf.size == nbytes
        and buf.flags.writeable
        and buf.flags.aligned
    ):  # viewed in numpy, one torch call (torch's own views cost three)
        return torch.from_numpy(buf.view(numpy_dtype).reshape(tuple(header.shape)))
    flat = buf if isinstance(buf, Tensor) else torch.from_numpy(buf)
    if flat.numel() != nbytes:
        raise FrameError(f"payload has {flat.numel()} bytes, header announces {nbytes}")
    if header.dtype == "uint8" and len(header.shape) == 1 and flat.dim() == 1:
        return flat  # a control frame's message: no views to make
    return flat.view(DTYPES[header.dtype]).reshape(tuple(header.shape))


# the payload dtypes numpy has, by name (a received payload viewed through numpy)
_NUMPY_OF = {name: torch.empty(0, dtype=d).numpy().dtype for name, d in DTYPES.items()
             if d != torch.bfloat16}  # fmt: skip


def decode(frame: Frame) -> Activation:
    """The Activation a (non-error) frame carries."""
    h = frame.header
    act = activation_from_rows(h.request_id, h.rows)
    if h.kind == Kind.PAYLOAD_KIND_HIDDEN:
        act.hidden = frame.payload
    elif h.kind == Kind.PAYLOAD_KIND_TOKENS:
        act.tokens = frame.payload
    elif h.kind != Kind.PAYLOAD_KIND_EMPTY:
        raise FrameError(f"frame kind {h.kind} carries no activation")
    payload = act.hidden if act.hidden is not None else act.tokens
    if payload is not None and payload.ndim == 0:
        raise FrameError("a payload needs one row per position, got a 0-dim tensor")
    if payload is not None and payload.shape[0] != len(act):
        raise FrameError(f"payload has {payload.shape[0]} rows, header lists {len(act)} positions")
    return act


def framed_bytes(header_bytes: int, payload_bytes: int) -> int:
    """Bytes of a frame as framed (preamble, header, payload; not an auth tag), from its
    header's and payload's sizes: what every count of frame bytes counts."""
    return PREAMBLE.size + header_bytes + payload_bytes


def frame_bytes(header: pb.FrameHeader, payload: Tensor | None) -> int:
    """`framed_bytes` of a frame."""
    n = 0 if payload is None else payload.numel() * payload.element_size()
    return framed_bytes(header.ByteSize(), n)


def received_bytes(frame: Frame) -> int:
    """`frame_bytes` of a received frame, without making its payload's tensor."""
    if frame.raw is not None:
        return framed_bytes(frame.header.ByteSize(), frame.raw.nbytes)
    return frame_bytes(frame.header, frame.payload)


def parse_preamble(data: bytes | memoryview) -> tuple[int, int]:
    hlen, plen = PREAMBLE.unpack(data)
    if hlen > MAX_HEADER_BYTES or plen > MAX_PAYLOAD_BYTES:
        raise FrameError(f"frame too large: header {hlen} bytes, payload {plen} bytes")
    return hlen, plen


def parse_header(data: bytes | memoryview, payload_len: int) -> pb.FrameHeader:
    header = pb.FrameHeader()
    try:
        header.ParseFromString(bytes(data))
    except Exception as e:  # protobuf raises DecodeError, a bare Exception subclass
        raise FrameError(f"corrupt frame header: {e}") from None
    if payload_nbytes(header) != payload_len:
        raise FrameError(
            f"frame payload is {payload_len} bytes, header announces {payload_nbytes(header)}"
        )
    return header
