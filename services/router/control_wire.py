"""The bytes of the router's control messages sent as data-plane frames, encoded from
their items in one pass (issue 34, point 3): each item (a feed, a prune, a draft call's
request) is serialized once and framed as its container's field, instead of being
copied into a `StageControl` / `DraftControl` (a deep copy per item), sized again for
the packing and serialized again with it. The bytes are exactly the container's
serialization (`tests/unit/test_control_wire.py`), packed into parts as
`control_stream._packed` packs the items: at most `budget` bytes of items per part, an
item larger than that alone."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from google.protobuf.message import Message
from specpipe.v1 import draft_pb2, stage_pb2


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(cls: type[Message], field: str, wire_type: int = 2) -> bytes:
    """A field's key (number and wire type), from the message's descriptor."""
    return _varint(cls.DESCRIPTOR.fields_by_name[field].number << 3 | wire_type)


_FEED = _key(stage_pb2.StageControl, "feeds")
_PRUNE = _key(stage_pb2.StageControl, "prunes")
_CALL = _key(draft_pb2.DraftControl, "calls")
_CALL_ID = _key(draft_pb2.DraftCall, "call_id", wire_type=0)
_CALL_KIND = {
    kind: _key(draft_pb2.DraftCall, kind) for kind in ("prefill", "propose", "prune", "release")
}


class DraftCallItem(NamedTuple):
    """A draft call waiting to be sent: `DraftCall(call_id=call_id, **{kind: request})`."""

    call_id: int
    kind: str
    request: Message

    def message(self) -> draft_pb2.DraftCall:
        return draft_pb2.DraftCall(call_id=self.call_id, **{self.kind: self.request})

    def body(self) -> bytes:
        """The `DraftCall`'s serialization."""
        data = self.request.SerializeToString()
        head = _CALL_ID + _varint(self.call_id) if self.call_id else b""
        return b"".join((head, _CALL_KIND[self.kind], _varint(len(data)), data))


def _parts(fields: Iterable[tuple[bytes, bytes]], budget: int) -> list[bytes]:
    """(key, item bytes) as fields of a message, in parts of at most `budget` bytes of
    items (an item larger than that alone); at least one part."""
    parts: list[list[bytes]] = [[]]
    size = 0
    for key, data in fields:
        n = len(data)
        if parts[-1] and size + n > budget:
            parts.append([])
            size = 0
        parts[-1] += (key, _varint(n), data)
        size += n
    return [b"".join(p) for p in parts]


def stage_control_parts(feeds: list, prunes: list, budget: int) -> list[bytes]:
    """`StageControl(feeds=..., prunes=...)`'s bytes, feeds first, in parts."""
    fields = [(_FEED, f.SerializeToString()) for f in feeds]
    fields += [(_PRUNE, p.SerializeToString()) for p in prunes]
    return _parts(fields, budget)


def draft_control_parts(calls: list[DraftCallItem], budget: int) -> list[bytes]:
    """`DraftControl(calls=...)`'s bytes, in parts."""
    return _parts(((_CALL, c.body()) for c in calls), budget)
