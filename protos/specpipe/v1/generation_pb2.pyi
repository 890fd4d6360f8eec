from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Iterable[int] | None = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("seed", "temperature", "top_k", "top_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: float | None = ..., top_k: int | None = ..., top_p: float | None = ..., seed: int | None = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("chat", "depth", "ignore_eos", "max_new_tokens", "mode", "model", "prefill_chunk", "sampling", "stop_token_ids", "text", "token_ids", "top_k_children", "width")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    TOP_K_CHILDREN_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    token_ids: TokenIds
    chat: bool
    mode: str
    max_new_tokens: int
    sampling: SamplingOptions
    width: int
    top_k_children: int
    depth: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefill_chunk: int
    def __init__(self, model: str | None = ..., text: str | None = ..., token_ids: TokenIds | _Mapping | None = ..., chat: bool | None = ..., mode: str | None = ..., max_new_tokens: int | None = ..., sampling: SamplingOptions | _Mapping | None = ..., width: int | None = ..., top_k_children: int | None = ..., depth: int | None = ..., ignore_eos: bool | None = ..., stop_token_ids: _Iterable[int] | None = ..., prefill_chunk: int | None = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "finished", "started")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    started: Started
    delta: TokenDelta
    finished: Finished
    def __init__(self, started: Started | _Mapping | None = ..., delta: TokenDelta | _Mapping | None = ..., finished: Finished | _Mapping | None = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ("model", "prompt_tokens", "request_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_tokens: int
    def __init__(self, request_id: str | None = ..., model: str | None = ..., prompt_tokens: int | None = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("index", "text", "token_ids")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    index: int
    def __init__(self, token_ids: _Iterable[int] | None = ..., text: str | None = ..., index: int | None = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("completion_tokens", "prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: int | None = ..., completion_tokens: int | None = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("decode_steps", "hit_rate", "mean_time_between_tokens_ms", "mode", "new_tokens", "prefill_steps", "stages", "time_to_first_token_ms", "tokens_per_step", "verifications", "width")
    MODE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STEPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    VERIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    MEAN_TIME_BETWEEN_TOKENS_MS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    stages: int
    width: int
    prefill_steps: int
    decode_steps: int
    new_tokens: int
    tokens_per_step: float
    hit_rate: float
    verifications: int
    time_to_first_token_ms: float
    mean_time_between_tokens_ms: float
    def __init__(self, mode: str | None = ..., stages: int | None = ..., width: int | None = ..., prefill_steps: int | None = ..., decode_steps: int | None = ..., new_tokens: int | None = ..., tokens_per_step: float | None = ..., hit_rate: float | None = ..., verifications: int | None = ..., time_to_first_token_ms: float | None = ..., mean_time_between_tokens_ms: float | None = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "stats", "text", "usage")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    stats: SpeculationStats
    text: str
    def __init__(self, finish_reason: str | None = ..., usage: Usage | _Mapping | None = ..., stats: SpeculationStats | _Mapping | None = ..., text: str | None = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("chat", "model", "text")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    chat: bool
    def __init__(self, model: str | None = ..., text: str | None = ..., chat: bool | None = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Iterable[int] | None = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("draft_model", "has_tokenizer", "id", "max_context", "modes", "num_layers", "stages", "vocab_size", "weight_hash")
    ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_HASH_FIELD_NUMBER: _ClassVar[int]
    MODES_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    id: str
    vocab_size: int
    max_context: int
    num_layers: int
    stages: int
    draft_model: str
    weight_hash: str
    modes: _containers.RepeatedScalarFieldContainer[str]
    has_tokenizer: bool
    def __init__(self, id: str | None = ..., vocab_size: int | None = ..., max_context: int | None = ..., num_layers: int | None = ..., stages: int | None = ..., draft_model: str | None = ..., weight_hash: str | None = ..., modes: _Iterable[str] | None = ..., has_tokenizer: bool | None = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Iterable[ModelCard | _Mapping] | None = ...) -> None: ...

class DescribeRouterRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Backend(_message.Message):
    __slots__ = ("address", "error", "healthy", "kind", "layers")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    kind: str
    address: str
    healthy: bool
    layers: str
    error: str
    def __init__(self, kind: str | None = ..., address: str | None = ..., healthy: bool | None = ..., layers: str | None = ..., error: str | None = ...) -> None: ...

class RouterDescription(_message.Message):
    __slots__ = ("active_requests", "backends", "data_address", "ready", "transport")
    READY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    active_requests: int
    backends: _containers.RepeatedCompositeFieldContainer[Backend]
    transport: str
    data_address: str
    def __init__(self, ready: bool | None = ..., active_requests: int | None = ..., backends: _Iterable[Backend | _Mapping] | None = ..., transport: str | None = ..., data_address: str | None = ...) -> None: ...
