from specpipe.v1 import dataplane_pb2 as _dataplane_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "text", "token_ids", "chat", "mode", "max_new_tokens", "sampling", "width", "top_k_children", "depth", "ignore_eos", "stop_token_ids", "prefill_chunk", "priority", "layers_per_step", "token_source", "ranking", "growth", "logprobs", "prompt_logprobs", "response_format", "min_tokens", "cache_salt", "resume_token_ids")
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
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LAYERS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SOURCE_FIELD_NUMBER: _ClassVar[int]
    RANKING_FIELD_NUMBER: _ClassVar[int]
    GROWTH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
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
    priority: int
    layers_per_step: int
    token_source: str
    ranking: str
    growth: str
    logprobs: int
    prompt_logprobs: int
    response_format: ResponseFormat
    min_tokens: int
    cache_salt: str
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[bool] = ..., mode: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., width: _Optional[int] = ..., top_k_children: _Optional[int] = ..., depth: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., prefill_chunk: _Optional[int] = ..., priority: _Optional[int] = ..., layers_per_step: _Optional[int] = ..., token_source: _Optional[str] = ..., ranking: _Optional[str] = ..., growth: _Optional[str] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., min_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "schema")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    type: str
    schema: str
    def __init__(self, type: _Optional[str] = ..., schema: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("started", "delta", "finished")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    started: Started
    delta: TokenDelta
    finished: Finished
    def __init__(self, started: _Optional[_Union[Started, _Mapping]] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ("request_id", "model", "prompt_tokens", "weight_hash")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_HASH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_tokens: int
    weight_hash: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., weight_hash: _Optional[str] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text", "index", "logprobs", "prompt_token_ids", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_dataplane_pb2.TokenLogprobs]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_dataplane_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_dataplane_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_dataplane_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("mode", "stages", "width", "prefill_steps", "decode_steps", "new_tokens", "tokens_per_step", "hit_rate", "verifications", "time_to_first_token_ms", "mean_time_between_tokens_ms", "regrowths", "steady_tokens_per_step", "late_draft_answers", "replays", "draft_drops", "layers_per_step", "token_source", "draft_hit_rate", "ngram_hit_rate")
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
    REGROWTHS_FIELD_NUMBER: _ClassVar[int]
    STEADY_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    LATE_DRAFT_ANSWERS_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DROPS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    NGRAM_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
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
    regrowths: int
    steady_tokens_per_step: float
    late_draft_answers: int
    replays: int
    draft_drops: int
    layers_per_step: int
    token_source: str
    draft_hit_rate: float
    ngram_hit_rate: float
    def __init__(self, mode: _Optional[str] = ..., stages: _Optional[int] = ..., width: _Optional[int] = ..., prefill_steps: _Optional[int] = ..., decode_steps: _Optional[int] = ..., new_tokens: _Optional[int] = ..., tokens_per_step: _Optional[float] = ..., hit_rate: _Optional[float] = ..., verifications: _Optional[int] = ..., time_to_first_token_ms: _Optional[float] = ..., mean_time_between_tokens_ms: _Optional[float] = ..., regrowths: _Optional[int] = ..., steady_tokens_per_step: _Optional[float] = ..., late_draft_answers: _Optional[int] = ..., replays: _Optional[int] = ..., draft_drops: _Optional[int] = ..., layers_per_step: _Optional[int] = ..., token_source: _Optional[str] = ..., draft_hit_rate: _Optional[float] = ..., ngram_hit_rate: _Optional[float] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "usage", "stats", "text", "resumed_tokens")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    stats: SpeculationStats
    text: str
    resumed_tokens: int
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., text: _Optional[str] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text", "chat")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    chat: bool
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("id", "vocab_size", "max_context", "num_layers", "stages", "draft_model", "weight_hash", "modes", "has_tokenizer")
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
    def __init__(self, id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., num_layers: _Optional[int] = ..., stages: _Optional[int] = ..., draft_model: _Optional[str] = ..., weight_hash: _Optional[str] = ..., modes: _Optional[_Iterable[str]] = ..., has_tokenizer: _Optional[bool] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...

class DescribeRouterRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Backend(_message.Message):
    __slots__ = ("kind", "address", "healthy", "layers", "error", "weight_hash", "active_requests", "draining", "refused")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_HASH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    kind: str
    address: str
    healthy: bool
    layers: str
    error: str
    weight_hash: str
    active_requests: int
    draining: bool
    refused: bool
    def __init__(self, kind: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., layers: _Optional[str] = ..., error: _Optional[str] = ..., weight_hash: _Optional[str] = ..., active_requests: _Optional[int] = ..., draining: _Optional[bool] = ..., refused: _Optional[bool] = ...) -> None: ...

class RouterDescription(_message.Message):
    __slots__ = ("ready", "active_requests", "backends", "transport", "data_address", "waiting_requests", "max_running", "max_waiting", "row_budget", "tuning", "max_running_per_key", "max_waiting_per_key", "caller_running", "caller_waiting")
    READY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    ROW_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TUNING_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_PER_KEY_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_PER_KEY_FIELD_NUMBER: _ClassVar[int]
    CALLER_RUNNING_FIELD_NUMBER: _ClassVar[int]
    CALLER_WAITING_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    active_requests: int
    backends: _containers.RepeatedCompositeFieldContainer[Backend]
    transport: str
    data_address: str
    waiting_requests: int
    max_running: int
    max_waiting: int
    row_budget: int
    tuning: _containers.RepeatedCompositeFieldContainer[Tuning]
    max_running_per_key: int
    max_waiting_per_key: int
    caller_running: int
    caller_waiting: int
    def __init__(self, ready: _Optional[bool] = ..., active_requests: _Optional[int] = ..., backends: _Optional[_Iterable[_Union[Backend, _Mapping]]] = ..., transport: _Optional[str] = ..., data_address: _Optional[str] = ..., waiting_requests: _Optional[int] = ..., max_running: _Optional[int] = ..., max_waiting: _Optional[int] = ..., row_budget: _Optional[int] = ..., tuning: _Optional[_Iterable[_Union[Tuning, _Mapping]]] = ..., max_running_per_key: _Optional[int] = ..., max_waiting_per_key: _Optional[int] = ..., caller_running: _Optional[int] = ..., caller_waiting: _Optional[int] = ...) -> None: ...

class Tuning(_message.Message):
    __slots__ = ("weight_hash", "regime", "chosen", "reason", "arms", "price")
    WEIGHT_HASH_FIELD_NUMBER: _ClassVar[int]
    REGIME_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ARMS_FIELD_NUMBER: _ClassVar[int]
    PRICE_FIELD_NUMBER: _ClassVar[int]
    weight_hash: str
    regime: str
    chosen: TuningArm
    reason: str
    arms: _containers.RepeatedCompositeFieldContainer[TuningArm]
    price: str
    def __init__(self, weight_hash: _Optional[str] = ..., regime: _Optional[str] = ..., chosen: _Optional[_Union[TuningArm, _Mapping]] = ..., reason: _Optional[str] = ..., arms: _Optional[_Iterable[_Union[TuningArm, _Mapping]]] = ..., price: _Optional[str] = ...) -> None: ...

class TuningArm(_message.Message):
    __slots__ = ("width", "layers_per_step", "token_source", "requests", "tokens", "steps", "hit_rate", "step_ms", "ms_per_token", "wall_ms_per_token", "mixed_requests")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    LAYERS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SOURCE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    WALL_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MIXED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    width: int
    layers_per_step: int
    token_source: str
    requests: int
    tokens: int
    steps: int
    hit_rate: float
    step_ms: float
    ms_per_token: float
    wall_ms_per_token: float
    mixed_requests: int
    def __init__(self, width: _Optional[int] = ..., layers_per_step: _Optional[int] = ..., token_source: _Optional[str] = ..., requests: _Optional[int] = ..., tokens: _Optional[int] = ..., steps: _Optional[int] = ..., hit_rate: _Optional[float] = ..., step_ms: _Optional[float] = ..., ms_per_token: _Optional[float] = ..., wall_ms_per_token: _Optional[float] = ..., mixed_requests: _Optional[int] = ...) -> None: ...
