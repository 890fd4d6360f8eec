from specpipe.v1 import dataplane_pb2 as _dataplane_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StageDescription(_message.Message):
    __slots__ = ("model_id", "weight_hash", "layer_start", "layer_end", "num_layers", "hidden_size", "vocab_size", "max_position_embeddings", "eos_token_ids", "dtype", "device", "weight_bytes", "free_memory_bytes", "cache_bytes_used", "cache_bytes_limit", "active_requests", "data_address", "ready", "row_budget", "lease_seconds", "cost_curve", "max_step_rows", "cache_blocks_used", "cache_blocks_free", "cache_block_rows", "prefix_caching", "cache_blocks_cached", "prefix_cache_queries", "prefix_cache_hits", "step_memory_bytes", "prefill_cells", "control_frames", "health_status", "relay_prunes")
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
    ROW_BUDGET_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COST_CURVE_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_ROWS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCK_ROWS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    STEP_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CELLS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FRAMES_FIELD_NUMBER: _ClassVar[int]
    HEALTH_STATUS_FIELD_NUMBER: _ClassVar[int]
    RELAY_PRUNES_FIELD_NUMBER: _ClassVar[int]
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
    row_budget: int
    lease_seconds: float
    cost_curve: _dataplane_pb2.CostCurve
    max_step_rows: int
    cache_blocks_used: int
    cache_blocks_free: int
    cache_block_rows: int
    prefix_caching: bool
    cache_blocks_cached: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    step_memory_bytes: int
    prefill_cells: int
    control_frames: bool
    health_status: int
    relay_prunes: bool
    def __init__(self, model_id: _Optional[str] = ..., weight_hash: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., free_memory_bytes: _Optional[int] = ..., cache_bytes_used: _Optional[int] = ..., cache_bytes_limit: _Optional[int] = ..., active_requests: _Optional[int] = ..., data_address: _Optional[str] = ..., ready: _Optional[bool] = ..., row_budget: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., cost_curve: _Optional[_Union[_dataplane_pb2.CostCurve, _Mapping]] = ..., max_step_rows: _Optional[int] = ..., cache_blocks_used: _Optional[int] = ..., cache_blocks_free: _Optional[int] = ..., cache_block_rows: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., cache_blocks_cached: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., step_memory_bytes: _Optional[int] = ..., prefill_cells: _Optional[int] = ..., control_frames: _Optional[bool] = ..., health_status: _Optional[int] = ..., relay_prunes: _Optional[bool] = ...) -> None: ...

class ConfigureStageRequest(_message.Message):
    __slots__ = ("model_path", "layer_start", "layer_end", "dtype", "model_id")
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
    def __init__(self, model_path: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., dtype: _Optional[str] = ..., model_id: _Optional[str] = ...) -> None: ...

class OpenStageRequest(_message.Message):
    __slots__ = ("request_id", "capacity", "next_hop", "report_to", "lease_owner", "lease_epoch", "lease_token", "fills_pipeline", "prefix_token_ids", "verify", "cache_scope", "report_progress")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    NEXT_HOP_FIELD_NUMBER: _ClassVar[int]
    REPORT_TO_FIELD_NUMBER: _ClassVar[int]
    LEASE_OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FILLS_PIPELINE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    REPORT_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    capacity: int
    next_hop: str
    report_to: str
    lease_owner: str
    lease_epoch: int
    lease_token: bytes
    fills_pipeline: bool
    prefix_token_ids: _containers.RepeatedScalarFieldContainer[int]
    verify: _dataplane_pb2.VerifySpec
    cache_scope: _dataplane_pb2.CacheScope
    report_progress: bool
    def __init__(self, request_id: _Optional[str] = ..., capacity: _Optional[int] = ..., next_hop: _Optional[str] = ..., report_to: _Optional[str] = ..., lease_owner: _Optional[str] = ..., lease_epoch: _Optional[int] = ..., lease_token: _Optional[bytes] = ..., fills_pipeline: _Optional[bool] = ..., prefix_token_ids: _Optional[_Iterable[int]] = ..., verify: _Optional[_Union[_dataplane_pb2.VerifySpec, _Mapping]] = ..., cache_scope: _Optional[_Union[_dataplane_pb2.CacheScope, _Mapping]] = ..., report_progress: _Optional[bool] = ...) -> None: ...

class OpenStageResponse(_message.Message):
    __slots__ = ("cached_tokens",)
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ...) -> None: ...

class FeedRequest(_message.Message):
    __slots__ = ("request_id", "seq", "after_prune", "rows", "token_ids", "verified_at_ns")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AFTER_PRUNE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_AT_NS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    after_prune: int
    rows: _dataplane_pb2.Rows
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    verified_at_ns: int
    def __init__(self, request_id: _Optional[str] = ..., seq: _Optional[int] = ..., after_prune: _Optional[int] = ..., rows: _Optional[_Union[_dataplane_pb2.Rows, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., verified_at_ns: _Optional[int] = ...) -> None: ...

class FeedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FeedManyRequest(_message.Message):
    __slots__ = ("feeds",)
    FEEDS_FIELD_NUMBER: _ClassVar[int]
    feeds: _containers.RepeatedCompositeFieldContainer[FeedRequest]
    def __init__(self, feeds: _Optional[_Iterable[_Union[FeedRequest, _Mapping]]] = ...) -> None: ...

class FeedManyResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[_dataplane_pb2.CallOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[_dataplane_pb2.CallOutcome, _Mapping]]] = ...) -> None: ...

class StageControl(_message.Message):
    __slots__ = ("feeds", "prunes", "releases")
    FEEDS_FIELD_NUMBER: _ClassVar[int]
    PRUNES_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    feeds: _containers.RepeatedCompositeFieldContainer[FeedRequest]
    prunes: _containers.RepeatedCompositeFieldContainer[_dataplane_pb2.PruneRequest]
    releases: _containers.RepeatedCompositeFieldContainer[_dataplane_pb2.RequestRef]
    def __init__(self, feeds: _Optional[_Iterable[_Union[FeedRequest, _Mapping]]] = ..., prunes: _Optional[_Iterable[_Union[_dataplane_pb2.PruneRequest, _Mapping]]] = ..., releases: _Optional[_Iterable[_Union[_dataplane_pb2.RequestRef, _Mapping]]] = ...) -> None: ...

class ControlRefusal(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StageControlReply(_message.Message):
    __slots__ = ("refusals", "released")
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    refusals: _containers.RepeatedCompositeFieldContainer[ControlRefusal]
    released: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, refusals: _Optional[_Iterable[_Union[ControlRefusal, _Mapping]]] = ..., released: _Optional[_Iterable[str]] = ...) -> None: ...
