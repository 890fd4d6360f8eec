from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class PayloadKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAYLOAD_KIND_UNSPECIFIED: _ClassVar[PayloadKind]
    PAYLOAD_KIND_TOKENS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_HIDDEN: _ClassVar[PayloadKind]
    PAYLOAD_KIND_LOGITS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_EMPTY: _ClassVar[PayloadKind]
    PAYLOAD_KIND_ERROR: _ClassVar[PayloadKind]
PAYLOAD_KIND_UNSPECIFIED: PayloadKind
PAYLOAD_KIND_TOKENS: PayloadKind
PAYLOAD_KIND_HIDDEN: PayloadKind
PAYLOAD_KIND_LOGITS: PayloadKind
PAYLOAD_KIND_EMPTY: PayloadKind
PAYLOAD_KIND_ERROR: PayloadKind

class Rows(_message.Message):
    __slots__ = ("committed", "node_ids", "parent_ids", "positions")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_IDS_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    committed: bool
    node_ids: _containers.RepeatedScalarFieldContainer[int]
    parent_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, positions: _Iterable[int] | None = ..., committed: bool | None = ..., node_ids: _Iterable[int] | None = ..., parent_ids: _Iterable[int] | None = ...) -> None: ...

class FrameHeader(_message.Message):
    __slots__ = ("after_prune", "dtype", "error", "error_code", "kind", "request_id", "rows", "sender", "seq", "shape")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AFTER_PRUNE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    after_prune: int
    rows: Rows
    kind: PayloadKind
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    error: str
    sender: str
    error_code: int
    def __init__(self, request_id: str | None = ..., seq: int | None = ..., after_prune: int | None = ..., rows: Rows | _Mapping | None = ..., kind: PayloadKind | str | None = ..., dtype: str | None = ..., shape: _Iterable[int] | None = ..., error: str | None = ..., sender: str | None = ..., error_code: int | None = ...) -> None: ...

class PruneSignal(_message.Message):
    __slots__ = ("commit_ids", "horizon", "keep_ids", "seq")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    COMMIT_IDS_FIELD_NUMBER: _ClassVar[int]
    KEEP_IDS_FIELD_NUMBER: _ClassVar[int]
    HORIZON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    commit_ids: _containers.RepeatedScalarFieldContainer[int]
    keep_ids: _containers.RepeatedScalarFieldContainer[int]
    horizon: int
    def __init__(self, seq: int | None = ..., commit_ids: _Iterable[int] | None = ..., keep_ids: _Iterable[int] | None = ..., horizon: int | None = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestRef(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: str | None = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: bool | None = ...) -> None: ...

class PruneRequest(_message.Message):
    __slots__ = ("prune", "request_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRUNE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prune: PruneSignal
    def __init__(self, request_id: str | None = ..., prune: PruneSignal | _Mapping | None = ...) -> None: ...

class PruneResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
