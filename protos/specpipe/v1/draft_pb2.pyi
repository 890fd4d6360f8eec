from specpipe.v1 import dataplane_pb2 as _dataplane_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftDescription(_message.Message):
    __slots__ = ("model_id", "weight_hash", "vocab_size", "num_layers", "dtype", "device", "weight_bytes", "free_memory_bytes", "active_requests", "lease_seconds", "cost_curve", "max_step_rows", "prefix_caching", "cache_blocks_cached", "prefix_cache_queries", "prefix_cache_hits", "health_status", "control_frames", "data_address")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_HASH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COST_CURVE_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_ROWS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_STATUS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FRAMES_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    weight_hash: str
    vocab_size: int
    num_layers: int
    dtype: str
    device: str
    weight_bytes: int
    free_memory_bytes: int
    active_requests: int
    lease_seconds: float
    cost_curve: _dataplane_pb2.CostCurve
    max_step_rows: int
    prefix_caching: bool
    cache_blocks_cached: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    health_status: int
    control_frames: bool
    data_address: str
    def __init__(self, model_id: _Optional[str] = ..., weight_hash: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., free_memory_bytes: _Optional[int] = ..., active_requests: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., cost_curve: _Optional[_Union[_dataplane_pb2.CostCurve, _Mapping]] = ..., max_step_rows: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., cache_blocks_cached: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., health_status: _Optional[int] = ..., control_frames: _Optional[bool] = ..., data_address: _Optional[str] = ...) -> None: ...

class OpenDraftRequest(_message.Message):
    __slots__ = ("request_id", "capacity", "prompt_ids", "prefill_chunk", "lease_owner", "lease_epoch", "lease_token", "cache_scope")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    LEASE_OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    capacity: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    prefill_chunk: int
    lease_owner: str
    lease_epoch: int
    lease_token: bytes
    cache_scope: _dataplane_pb2.CacheScope
    def __init__(self, request_id: _Optional[str] = ..., capacity: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., prefill_chunk: _Optional[int] = ..., lease_owner: _Optional[str] = ..., lease_epoch: _Optional[int] = ..., lease_token: _Optional[bytes] = ..., cache_scope: _Optional[_Union[_dataplane_pb2.CacheScope, _Mapping]] = ...) -> None: ...

class OpenDraftResponse(_message.Message):
    __slots__ = ("cached_tokens",)
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillDraftRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "start_position", "prefill_chunk")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_position: int
    prefill_chunk: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_position: _Optional[int] = ..., prefill_chunk: _Optional[int] = ...) -> None: ...

class PrefillDraftResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("request_id", "rows", "token_ids", "top_k", "temperature", "prunes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    PRUNES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    rows: _dataplane_pb2.Rows
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_k: int
    temperature: float
    prunes: _containers.RepeatedCompositeFieldContainer[_dataplane_pb2.PruneSignal]
    def __init__(self, request_id: _Optional[str] = ..., rows: _Optional[_Union[_dataplane_pb2.Rows, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., top_k: _Optional[int] = ..., temperature: _Optional[float] = ..., prunes: _Optional[_Iterable[_Union[_dataplane_pb2.PruneSignal, _Mapping]]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("parent_ids", "token_ids", "probs")
    PARENT_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    parent_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, parent_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftCall(_message.Message):
    __slots__ = ("call_id", "prefill", "propose", "prune", "release")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    PRUNE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    prefill: PrefillDraftRequest
    propose: ProposeRequest
    prune: _dataplane_pb2.PruneRequest
    release: _dataplane_pb2.RequestRef
    def __init__(self, call_id: _Optional[int] = ..., prefill: _Optional[_Union[PrefillDraftRequest, _Mapping]] = ..., propose: _Optional[_Union[ProposeRequest, _Mapping]] = ..., prune: _Optional[_Union[_dataplane_pb2.PruneRequest, _Mapping]] = ..., release: _Optional[_Union[_dataplane_pb2.RequestRef, _Mapping]] = ...) -> None: ...

class DraftControl(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[DraftCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[DraftCall, _Mapping]]] = ...) -> None: ...

class DraftAnswer(_message.Message):
    __slots__ = ("call_id", "code", "message", "proposal")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    code: int
    message: str
    proposal: ProposeResponse
    def __init__(self, call_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., proposal: _Optional[_Union[ProposeResponse, _Mapping]] = ...) -> None: ...

class DraftControlReply(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[DraftAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[DraftAnswer, _Mapping]]] = ...) -> None: ...
