from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from specpipe.v1 import dataplane_pb2 as _dataplane_pb2

DESCRIPTOR: _descriptor.FileDescriptor

class DraftDescription(_message.Message):
    __slots__ = ("active_requests", "device", "dtype", "free_memory_bytes", "model_id", "num_layers", "vocab_size", "weight_bytes", "weight_hash")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_HASH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    weight_hash: str
    vocab_size: int
    num_layers: int
    dtype: str
    device: str
    weight_bytes: int
    free_memory_bytes: int
    active_requests: int
    def __init__(self, model_id: str | None = ..., weight_hash: str | None = ..., vocab_size: int | None = ..., num_layers: int | None = ..., dtype: str | None = ..., device: str | None = ..., weight_bytes: int | None = ..., free_memory_bytes: int | None = ..., active_requests: int | None = ...) -> None: ...

class OpenDraftRequest(_message.Message):
    __slots__ = ("capacity", "prefill_chunk", "prompt_ids", "request_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    capacity: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    prefill_chunk: int
    def __init__(self, request_id: str | None = ..., capacity: int | None = ..., prompt_ids: _Iterable[int] | None = ..., prefill_chunk: int | None = ...) -> None: ...

class OpenDraftResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillDraftRequest(_message.Message):
    __slots__ = ("prefill_chunk", "request_id", "start_position", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_position: int
    prefill_chunk: int
    def __init__(self, request_id: str | None = ..., token_ids: _Iterable[int] | None = ..., start_position: int | None = ..., prefill_chunk: int | None = ...) -> None: ...

class PrefillDraftResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("request_id", "rows", "temperature", "token_ids", "top_k")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    rows: _dataplane_pb2.Rows
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_k: int
    temperature: float
    def __init__(self, request_id: str | None = ..., rows: _dataplane_pb2.Rows | _Mapping | None = ..., token_ids: _Iterable[int] | None = ..., top_k: int | None = ..., temperature: float | None = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("parent_ids", "probs", "token_ids")
    PARENT_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    parent_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, parent_ids: _Iterable[int] | None = ..., token_ids: _Iterable[int] | None = ..., probs: _Iterable[float] | None = ...) -> None: ...
