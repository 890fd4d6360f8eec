"""The bytes of the router's control messages sent as data-plane frames, encoded from
their items in one pass (issue 34, point 3): each item (a feed, a prune, a draft call's
request) is serialized once and framed as its container's field, instead of being
copied into a `StageControl` / `DraftControl` (a deep copy per item), sized again for
the packing and serialized again with it. The bytes are exactly the container's
serialization (`tests/unit/test_control_wire.py`), packed into parts as
`control_stream._packed` packs the items (prunes first): at most `budget` bytes of items per part, an
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


def _groups(fields: Iterable[tuple[bytes, bytes]], budget: int) -> list[list[tuple[bytes, bytes]]]:
    """(key, item bytes) in order, in groups of at most `budget` bytes of items (an item
    larger than that alone); at least one group."""
    groups: list[list[tuple[bytes, bytes]]] = [[]]
    size = 0
    for key, data in fields:
        n = len(data)
        if groups[-1] and size + n > budget:
            groups.append([])
            size = 0
        groups[-1].append((key, data))
        size += n
    return groups


def _message(fields: Iterable[tuple[bytes, bytes]]) -> bytes:
    return b"".join(b"".join((key, _varint(len(data)), data)) for key, data in fields)


def stage_control_parts(feeds: list, prunes: list, budget: int) -> list[bytes]:
    """`StageControl(feeds=..., prunes=...)`'s bytes in parts, the prunes in the first
    parts (a stage takes a part's prunes before its feeds, and a later part's prunes
    after an earlier part's feeds: a feed must not allocate before a prune frees room),
    each part's fields in number order as the container serializes them."""
    fields = [(_PRUNE, p.SerializeToString()) for p in prunes]
    fields += [(_FEED, f.SerializeToString()) for f in feeds]
    return [_message(sorted(g, key=lambda f: f[0] != _FEED)) for g in _groups(fields, budget)]


def draft_control_parts(calls: list[DraftCallItem], budget: int) -> list[bytes]:
    """`DraftControl(calls=...)`'s bytes, in parts."""
    return [_message(g) for g in _groups(((_CALL, c.body()) for c in calls), budget)]
