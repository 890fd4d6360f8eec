"""What the sync and asyncio clients share: request building, result types, and
resuming a stream that broke (`Resumer`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Unpack

import grpc
from specpipe.common.spec.grammar import ResponseFormat
from specpipe.common.spec.options import DEFAULT_MAX_NEW_TOKENS, Mode
from specpipe.common.spec.request_options import (
    REQUEST_OPTIONS,
    RequestOptions,
    options_doc,
    set_on_wire,
)
from specpipe.common.spec.stats import speculation_of, summary_of
from specpipe.v1 import generation_pb2 as gen
from specpipe.v1 import generation_pb2_grpc

from ..grpc_util import MESSAGE_OPTIONS
from ..stats_wire import stats_from_proto
from .errors import FINAL_METADATA, error_from_rpc

CHANNEL_OPTIONS = MESSAGE_OPTIONS


def tls_credentials(tls) -> grpc.ChannelCredentials | None:
    """For a router serving TLS (`--public-tls-cert`): `tls` True trusts the system's
    roots, a path the CA certificate in that file; False/None: plaintext."""
    if not tls:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    return grpc.ssl_channel_credentials(Path(tls).read_bytes())


def keepalive_options(seconds: float | None) -> list[tuple[str, int]]:
    """Channel options that ping the router every `seconds` while a call is open and
    drop the connection (UNAVAILABLE: the stream is resumed elsewhere) when a ping is not
    answered within as long: a router whose host went silent (powered off, cut off)
    sends no reset. None: no pings."""
    if seconds is None:
        return []
    ms = max(int(seconds * 1e3), 1000)  # the router accepts a ping a second at most
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),  # a stream may wait long for a token
    ]


def open_stub(api, address: str, creds: grpc.ChannelCredentials | None, options=()):
    """(channel, Generation stub) to `address`; `api`: `grpc` (blocking) or `grpc.aio`."""
    opts = [*CHANNEL_OPTIONS, *options]
    ch = (
        api.insecure_channel(address, options=opts)
        if creds is None
        else api.secure_channel(address, creds, options=opts)
    )
    return ch, generation_pb2_grpc.GenerationStub(ch)


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata for a router started with API keys (`--api-key`)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


@dataclass
class Chunk:
    """Tokens verified together (one, or a SpecInfer path) and their text."""

    token_ids: list[int]
    text: str
    index: int  # position of the first token in the output
    # per token, for a request that asked for logprobs: (logprob, {top id: logprob})
    logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)


@dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, object] = field(default_factory=dict)
    model: str = ""
    weight_hash: str = ""  # the model version that served it (content hash of the weights)
    # per token, for a request that asked for logprobs: (logprob, {top id: logprob})
    logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    # for a request that asked for prompt_logprobs: the prompt's token ids, and the same
    # per prompt token after the first
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    # resume attempts after the stream broke (its router died), the one that went on
    # included; `stats` are the last router's (its new_tokens: the tokens it drew)
    resumes: int = 0

    def summary(self) -> dict[str, object]:
        """The stats keys `specpipe generate --json` prints."""
        return summary_of(self.stats)

    def speculation(self) -> dict[str, object]:
        """Stats beyond `summary()`, which `--json` prints beside "stats" (not inside it,
        so "stats" keeps exactly the keys of `specpipe generate --json`)."""
        return speculation_of(self.stats)


# What the SDK sends when the caller leaves it out: the proto's empty value is no
# request here (0 new tokens), and the mode goes on the wire as the one chosen.
_SDK_DEFAULTS = {"mode": Mode.SPECPIPE.value, "max_new_tokens": DEFAULT_MAX_NEW_TOKENS}


def _response_format_message(value) -> gen.ResponseFormat | None:
    """OpenAI's response_format (a dict or JSON text) as the wire's message (None: text)."""
    fmt = ResponseFormat.from_openai(value)  # GrammarError (ValueError): malformed
    return gen.ResponseFormat(type=fmt.type, schema=fmt.schema) if fmt.constrains else None


# The options whose SDK form is not the wire's (the only ones named here).
_TO_WIRE = {
    "response_format": _response_format_message,
    "logit_bias": lambda bias: {int(t): float(b) for t, b in bias.items()},
}
_BY_KEYWORD = {o.keyword: o for o in REQUEST_OPTIONS}


def build_request(
    prompt: str | None = None,
    *,
    prompt_ids: Sequence[int] | None = None,
    **options: Unpack[RequestOptions],
) -> gen.GenerateRequest:
    """A `GenerateRequest` for a text prompt or token ids, with the request options
    (common/spec/request_options.py) given as keywords; an option left out or None is
    the router's to choose or default. `response_format` is OpenAI's dict or the same
    as JSON text; `resume_token_ids` the output already received (the clients send it
    themselves when a router dies mid-stream). The options:
    """
    if prompt is not None and prompt_ids is not None:
        raise ValueError("give either prompt text or prompt_ids, not both")
    unknown = set(options) - set(_BY_KEYWORD)
    if unknown:
        raise TypeError(f"build_request() got unexpected keyword arguments {sorted(unknown)}")
    req = gen.GenerateRequest()
    for keyword, o in _BY_KEYWORD.items():
        value = options.get(keyword)
        if value is None:
            value = _SDK_DEFAULTS.get(keyword)
        elif keyword in _TO_WIRE:
            value = _TO_WIRE[keyword](value)
        set_on_wire(req, o, value)
    if prompt is not None:
        req.text = prompt
    elif prompt_ids is not None:
        req.token_ids.ids.extend(prompt_ids)
    return req


build_request.__doc__ += options_doc()


def targets_of(address: str | Sequence[str]) -> list[str]:
    """Router addresses: one ("host:port"), several separated by commas, or a list."""
    items = [address] if isinstance(address, str) else list(address)
    out = [a.strip() for item in items for a in item.split(",") if a.strip()]
    if not out:
        raise ValueError("no router address given")
    return out


@dataclass(frozen=True)
class ResumePolicy:
    """How a stream that breaks (its router died: UNAVAILABLE, the connection lost) is
    resumed on the client's next router address (the same one with one address: it may
    have been restarted): at most `attempts` times per request, waiting `backoff`
    seconds before the first, doubling up to `max_backoff`. attempts=0: never."""

    attempts: int = 8  # with the backoff, about 9 s: a restarted router is back by then
    backoff: float = 0.1
    max_backoff: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 0 or self.backoff < 0 or self.max_backoff < 0:
            raise ValueError("resume attempts and backoff must not be negative")

    def wait(self, attempt: int) -> float:
        """Seconds before resume attempt `attempt` (1-based)."""
        return min(self.backoff * 2 ** (attempt - 1), self.max_backoff)


# The statuses of a stream that broke because its router went away (a killed process's
# connection reads as UNAVAILABLE; a proxy in between may reset the stream instead).
_BROKEN_CODES = {grpc.StatusCode.UNAVAILABLE}
_BROKEN_DETAILS = ("RST_STREAM", "Socket closed", "Connection reset", "Stream removed")


def broken(e: grpc.RpcError) -> bool:
    """Whether `e` says the stream's router went away (resume elsewhere) rather than
    that the request is wrong or was refused (raise it)."""
    code = e.code() if hasattr(e, "code") else None
    trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    if any(tuple(m) == FINAL_METADATA for m in trailing or ()):
        return False  # the router is there and gave up on the request itself
    if code in _BROKEN_CODES:
        return True
    details = (e.details() if hasattr(e, "details") else "") or ""
    return code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and any(
        d in details for d in _BROKEN_DETAILS
    )


class Resumer:
    """One request's resumes (the sync and asyncio streams share it): which router
    address the next call goes to, the request that continues the output received so far
    (`GenerateRequest.resume_token_ids`), the backoff, the deadline, and the clear error
    once every attempt failed."""

    def __init__(
        self,
        request: gen.GenerateRequest,
        targets: int,
        first: int,
        policy: ResumePolicy,
        timeout: float | None,
    ) -> None:
        self.request, self.targets, self.target, self.policy = request, targets, first, policy
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.attempts = 0  # resumes started
        self.errors: list[str] = []

    def timeout(self) -> float | None:
        """What is left of the request's deadline for the next call."""
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def next(self, e: grpc.RpcError, collector: Collector, address: str) -> float:
        """The stream broke with `e`: the seconds to wait before resuming on `self.target`
        (moved to the next address); raises the error to give the caller when the stream
        cannot be resumed (not a router's death, no attempt or time left)."""
        err = error_from_rpc(e)
        if collector.completion is not None or not broken(e):
            raise err
        self.errors.append(f"{address}: {err}")
        self.attempts += 1
        wait = self.policy.wait(self.attempts)
        left = self.timeout()
        if self.attempts > self.policy.attempts or (left is not None and left <= wait):
            why = (
                "no time left" if self.attempts <= self.policy.attempts else "every attempt failed"
            )
            raise type(err)(
                f"the stream broke after {len(collector.token_ids)} tokens and could not "
                f"be resumed ({why}; {self.attempts - 1} resumes tried): " + "; ".join(self.errors),
                err.code,
            ) from None
        self.target = (self.target + 1) % self.targets
        return wait

    def resumed_request(self, collector: Collector) -> gen.GenerateRequest:
        """The request again, continuing after the tokens received so far (and without
        the prompt's logprobs once they came)."""
        req = gen.GenerateRequest()
        req.CopyFrom(self.request)
        del req.resume_token_ids[:]
        req.resume_token_ids.extend([*self.request.resume_token_ids, *collector.token_ids])
        if collector.prompt_token_ids:
            req.ClearField("prompt_logprobs")
        collector.resumes += 1
        return req


class RouterTargets:
    """What the sync and asyncio clients share: the router addresses, the resume
    policy, call metadata and deadline, and one channel per address (opened at first
    use); `API` is `grpc` or `grpc.aio`."""

    API = grpc

    def __init__(
        self,
        address: str | Sequence[str],
        timeout: float | None = None,
        api_key: str | None = None,
        tls: bool | str | Path = False,
        resume: ResumePolicy | None = None,
        keepalive: float | None = 20.0,
    ) -> None:
        """`address`: the router's "host:port", or several (a list, or separated by
        commas): requests go to the first, and a stream whose router dies is resumed on
        the next (`resume`: how; default `ResumePolicy()`). `tls`: the router serves TLS;
        True trusts the system's roots, a path names the CA certificate to trust.
        `keepalive`: seconds between pings of an open call's router, and how long one
        may go unanswered before the connection counts as lost (a silent router's
        stream is then resumed; None: no pings, such a stream waits for its deadline)."""
        self.targets = targets_of(address)
        self.address = self.targets[0]
        self.resume = resume or ResumePolicy()
        self._metadata = auth_metadata(api_key)  # for a router started with --api-key
        self.timeout = timeout  # default deadline of every call, seconds
        self._creds = tls_credentials(tls)
        self._options = keepalive_options(keepalive)
        self._stubs: dict[int, tuple] = {}  # address index -> (channel, stub)
        self._current = 0  # the address new requests go to (the last one resumed on)

    def _stub_of(self, target: int) -> generation_pb2_grpc.GenerationStub:
        if target not in self._stubs:
            address = self.targets[target]
            self._stubs[target] = open_stub(self.API, address, self._creds, self._options)
        return self._stubs[target][1]

    @property
    def _stub(self) -> generation_pb2_grpc.GenerationStub:
        return self._stub_of(self._current)

    def _generate(self, target: int, req: gen.GenerateRequest, timeout: float | None):
        self._current = target
        return self._stub_of(target).Generate(req, timeout=timeout, metadata=self._metadata)

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout


class Collector:
    """Accumulates a Generate stream into chunks and the final Completion; after a resume
    the next router's stream continues the same output (its deltas' indices start
    where the received tokens end)."""

    def __init__(self) -> None:
        self.request_id = ""
        self.model = ""
        self.weight_hash = ""
        self.prompt_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[float, dict[int, float]]] = []
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: list[tuple[float, dict[int, float]]] = []
        self.text: list[str] = []
        self.completion: Completion | None = None
        self.resumes = 0  # streams resumed on another router (or the same, restarted)

    def add(self, resp: gen.GenerateResponse) -> Chunk | None:
        kind = resp.WhichOneof("event")
        if kind == "started":
            self.request_id = self.request_id or resp.started.request_id
            self.model, self.weight_hash = resp.started.model, resp.started.weight_hash
            self.prompt_tokens = resp.started.prompt_tokens
        elif kind == "delta":
            d = resp.delta
            self.token_ids.extend(d.token_ids)
            self.text.append(d.text)
            lps = _logprobs(d.logprobs)
            self.logprobs += lps
            if d.prompt_token_ids:
                self.prompt_token_ids = list(d.prompt_token_ids)
                self.prompt_logprobs = _logprobs(d.prompt_logprobs)
            return Chunk(list(d.token_ids), d.text, d.index, lps)
        elif kind == "finished":
            f = resp.finished
            self.text.append(f.text)
            self.completion = Completion(
                request_id=self.request_id,
                token_ids=list(self.token_ids),
                text="".join(self.text),
                finish_reason=f.finish_reason,
                prompt_tokens=f.usage.prompt_tokens,
                completion_tokens=f.usage.completion_tokens,
                stats=stats_from_proto(f.stats),
                model=self.model,
                weight_hash=self.weight_hash,
                logprobs=list(self.logprobs),
                prompt_token_ids=self.prompt_token_ids,
                prompt_logprobs=self.prompt_logprobs,
                resumes=self.resumes,
            )
            if f.text:
                return Chunk([], f.text, len(self.token_ids))
        return None


def _logprobs(msgs) -> list[tuple[float, dict[int, float]]]:
    return [(lp.logprob, dict(zip(lp.top_ids, lp.top_logprobs, strict=True))) for lp in msgs]
