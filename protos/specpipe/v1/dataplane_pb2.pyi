from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PayloadKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAYLOAD_KIND_UNSPECIFIED: _ClassVar[PayloadKind]
    PAYLOAD_KIND_TOKENS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_HIDDEN: _ClassVar[PayloadKind]
    PAYLOAD_KIND_EMPTY: _ClassVar[PayloadKind]
    PAYLOAD_KIND_ERROR: _ClassVar[PayloadKind]
    PAYLOAD_KIND_BATCH: _ClassVar[PayloadKind]
    PAYLOAD_KIND_VERIFIED: _ClassVar[PayloadKind]
    PAYLOAD_KIND_CONTROL: _ClassVar[PayloadKind]
    PAYLOAD_KIND_CONTROL_REPLY: _ClassVar[PayloadKind]
PAYLOAD_KIND_UNSPECIFIED: PayloadKind
PAYLOAD_KIND_TOKENS: PayloadKind
PAYLOAD_KIND_HIDDEN: PayloadKind
PAYLOAD_KIND_EMPTY: PayloadKind
PAYLOAD_KIND_ERROR: PayloadKind
PAYLOAD_KIND_BATCH: PayloadKind
PAYLOAD_KIND_VERIFIED: PayloadKind
PAYLOAD_KIND_CONTROL: PayloadKind
PAYLOAD_KIND_CONTROL_REPLY: PayloadKind

class Rows(_message.Message):
    __slots__ = ("positions", "committed", "node_ids", "parent_ids", "token_ids")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    committed: bool
    node_ids: _containers.RepeatedScalarFieldContainer[int]
    parent_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, positions: _Optional[_Iterable[int]] = ..., committed: _Optional[bool] = ..., node_ids: _Optional[_Iterable[int]] = ..., parent_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FrameHeader(_message.Message):
    __slots__ = ("request_id", "seq", "after_prune", "rows", "kind", "dtype", "shape", "error", "sender", "error_code", "parts", "verified", "reply_to", "prunes", "prunes_only", "prunes_now")
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
    PARTS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    PRUNES_FIELD_NUMBER: _ClassVar[int]
    PRUNES_ONLY_FIELD_NUMBER: _ClassVar[int]
    PRUNES_NOW_FIELD_NUMBER: _ClassVar[int]
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
    parts: _containers.RepeatedCompositeFieldContainer[FrameHeader]
    verified: Verification
    reply_to: str
    prunes: _containers.RepeatedCompositeFieldContainer[PruneSignal]
    prunes_only: bool
    prunes_now: bool
    def __init__(self, request_id: _Optional[str] = ..., seq: _Optional[int] = ..., after_prune: _Optional[int] = ..., rows: _Optional[_Union[Rows, _Mapping]] = ..., kind: _Optional[_Union[PayloadKind, str]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ..., sender: _Optional[str] = ..., error_code: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[FrameHeader, _Mapping]]] = ..., verified: _Optional[_Union[Verification, _Mapping]] = ..., reply_to: _Optional[str] = ..., prunes: _Optional[_Iterable[_Union[PruneSignal, _Mapping]]] = ..., prunes_only: _Optional[bool] = ..., prunes_now: _Optional[bool] = ...) -> None: ...

class VerifySpec(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "output_start", "logprobs", "prompt_logprobs", "grammar", "grammar_consumed", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "min_tokens", "stop_token_ids")
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
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    output_start: int
    logprobs: int
    prompt_logprobs: int
    grammar: str
    grammar_consumed: _containers.RepeatedScalarFieldContainer[int]
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., output_start: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., grammar_consumed: _Optional[_Iterable[int]] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Verification(_message.Message):
    __slots__ = ("node_ids", "token_ids", "position", "logprobs", "sent_at_ns", "prompt_logprobs")
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_NS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    node_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    position: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    sent_at_ns: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, node_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., position: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., sent_at_ns: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class PruneSignal(_message.Message):
    __slots__ = ("seq", "commit_ids", "keep_ids", "horizon")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    COMMIT_IDS_FIELD_NUMBER: _ClassVar[int]
    KEEP_IDS_FIELD_NUMBER: _ClassVar[int]
    HORIZON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    commit_ids: _containers.RepeatedScalarFieldContainer[int]
    keep_ids: _containers.RepeatedScalarFieldContainer[int]
    horizon: int
    def __init__(self, seq: _Optional[int] = ..., commit_ids: _Optional[_Iterable[int]] = ..., keep_ids: _Optional[_Iterable[int]] = ..., horizon: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestRef(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PruneRequest(_message.Message):
    __slots__ = ("request_id", "prune", "relay")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRUNE_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prune: PruneSignal
    relay: bool
    def __init__(self, request_id: _Optional[str] = ..., prune: _Optional[_Union[PruneSignal, _Mapping]] = ..., relay: _Optional[bool] = ...) -> None: ...

class PruneResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PruneManyRequest(_message.Message):
    __slots__ = ("prunes",)
    PRUNES_FIELD_NUMBER: _ClassVar[int]
    prunes: _containers.RepeatedCompositeFieldContainer[PruneRequest]
    def __init__(self, prunes: _Optional[_Iterable[_Union[PruneRequest, _Mapping]]] = ...) -> None: ...

class PruneManyResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[CallOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[CallOutcome, _Mapping]]] = ...) -> None: ...

class CallOutcome(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("owner", "epoch", "token", "request_ids")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    epoch: int
    token: bytes
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, owner: _Optional[str] = ..., epoch: _Optional[int] = ..., token: _Optional[bytes] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("unknown_ids",)
    UNKNOWN_IDS_FIELD_NUMBER: _ClassVar[int]
    unknown_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, unknown_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CostCurve(_message.Message):
    __slots__ = ("rows", "seconds", "context")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedScalarFieldContainer[int]
    seconds: _containers.RepeatedScalarFieldContainer[float]
    context: int
    def __init__(self, rows: _Optional[_Iterable[int]] = ..., seconds: _Optional[_Iterable[float]] = ..., context: _Optional[int] = ...) -> None: ...

class CacheScope(_message.Message):
    __slots__ = ("salt", "owner")
    SALT_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    salt: bytes
    owner: bytes
    def __init__(self, salt: _Optional[bytes] = ..., owner: _Optional[bytes] = ...) -> None: ...
