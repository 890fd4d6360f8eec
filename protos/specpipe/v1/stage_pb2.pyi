from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from specpipe.v1 import dataplane_pb2 as _dataplane_pb2

DESCRIPTOR: _descriptor.FileDescriptor

class StageDescription(_message.Message):
    __slots__ = ("active_requests", "cache_bytes_limit", "cache_bytes_used", "data_address", "device", "dtype", "eos_token_ids", "free_memory_bytes", "hidden_size", "layer_end", "layer_start", "max_position_embeddings", "model_id", "num_layers", "ready", "vocab_size", "weight_bytes", "weight_hash")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    weight_hash: str
    layer_start: int
    layer_end: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    weight_bytes: int
    free_memory_bytes: int
    cache_bytes_used: int
    cache_bytes_limit: int
    active_requests: int
    data_address: str
    ready: bool
    def __init__(self, model_id: str | None = ..., weight_hash: str | None = ..., layer_start: int | None = ..., layer_end: int | None = ..., num_layers: int | None = ..., hidden_size: int | None = ..., vocab_size: int | None = ..., max_position_embeddings: int | None = ..., eos_token_ids: _Iterable[int] | None = ..., dtype: str | None = ..., device: str | None = ..., weight_bytes: int | None = ..., free_memory_bytes: int | None = ..., cache_bytes_used: int | None = ..., cache_bytes_limit: int | None = ..., active_requests: int | None = ..., data_address: str | None = ..., ready: bool | None = ...) -> None: ...

class ConfigureStageRequest(_message.Message):
    __slots__ = ("dtype", "layer_end", "layer_start", "model_id", "model_path")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    layer_start: int
    layer_end: int
    dtype: str
    model_id: str
    def __init__(self, model_path: str | None = ..., layer_start: int | None = ..., layer_end: int | None = ..., dtype: str | None = ..., model_id: str | None = ...) -> None: ...

class OpenStageRequest(_message.Message):
    __slots__ = ("capacity", "next_hop", "report_to", "request_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    NEXT_HOP_FIELD_NUMBER: _ClassVar[int]
    REPORT_TO_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    capacity: int
    next_hop: str
    report_to: str
    def __init__(self, request_id: str | None = ..., capacity: int | None = ..., next_hop: str | None = ..., report_to: str | None = ...) -> None: ...

class OpenStageResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FeedRequest(_message.Message):
    __slots__ = ("after_prune", "request_id", "rows", "seq", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AFTER_PRUNE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    after_prune: int
    rows: _dataplane_pb2.Rows
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: str | None = ..., seq: int | None = ..., after_prune: int | None = ..., rows: _dataplane_pb2.Rows | _Mapping | None = ..., token_ids: _Iterable[int] | None = ...) -> None: ...

class FeedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
