"""What the sync and asyncio clients share: request building and result types."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from specpipe.common.spec.grammar import ResponseFormat
from specpipe.common.spec.stats import speculation_of, summary_of
from specpipe.v1 import generation_pb2 as gen

from ..grpc_util import MESSAGE_OPTIONS
from ..stats_wire import stats_from_proto

CHANNEL_OPTIONS = MESSAGE_OPTIONS


def tls_credentials(tls) -> grpc.ChannelCredentials | None:
    """For a router serving TLS (`--public-tls-cert`): `tls` True trusts the system's
    roots, a path the CA certificate in that file; False/None: plaintext."""
    if not tls:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    return grpc.ssl_channel_credentials(Path(tls).read_bytes())


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

    def summary(self) -> dict[str, object]:
        """The stats keys `specpipe generate --json` prints."""
        return summary_of(self.stats)

    def speculation(self) -> dict[str, object]:
        """Stats beyond `summary()`, which `--json` prints beside "stats" (not inside it,
        so "stats" keeps exactly the keys of `specpipe generate --json`)."""
        return speculation_of(self.stats)


def build_request(
    prompt: str | None = None,
    *,
    prompt_ids: Sequence[int] | None = None,
    chat: bool = False,
    model: str = "",
    mode: str = "specpipe",
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int = 0,
    width: int | str | None = None,
    top_k_children: int | None = None,
    depth: int | None = None,
    ignore_eos: bool = False,
    stop_token_ids: Sequence[int] = (),
    prefill_chunk: int | None = None,
    priority: int = 0,
    layers_per_step: int | str | None = None,
    token_source: str = "",
    ranking: str = "",
    growth: str = "",
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    response_format: dict | str | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = 0,
    cache_salt: str = "",
) -> gen.GenerateRequest:
    """`width`, `layers_per_step`, `token_source`: "auto" leaves them to the router (see
    `RouterDescription.tuning`); None or "" to its default. `response_format`: OpenAI's
    ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": ...}}),
    or the same as JSON text. The penalties, `logit_bias` ({token id: bias}) and
    `min_tokens` are vLLM's (the router checks them)."""
    if prompt is not None and prompt_ids is not None:
        raise ValueError("give either prompt text or prompt_ids, not both")
    req = gen.GenerateRequest(
        model=model,
        chat=chat,
        mode=mode,
        max_new_tokens=max_new_tokens,
        sampling=gen.SamplingOptions(
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            logit_bias={int(t): float(b) for t, b in (logit_bias or {}).items()},
        ),
        ignore_eos=ignore_eos,
        stop_token_ids=list(stop_token_ids),
        priority=priority,
        token_source=token_source,
        ranking=ranking,
        growth=growth,
        min_tokens=min_tokens,
        cache_salt=cache_salt,
    )
    if top_p is not None:
        req.sampling.top_p = top_p
    if repetition_penalty is not None:
        req.sampling.repetition_penalty = repetition_penalty
    if logprobs is not None:
        req.logprobs = logprobs
    if prompt_logprobs is not None:
        req.prompt_logprobs = prompt_logprobs
    fmt = ResponseFormat.from_openai(response_format)  # GrammarError (ValueError): malformed
    if fmt.constrains:
        req.response_format.type, req.response_format.schema = fmt.type, fmt.schema
    if prompt is not None:
        req.text = prompt
    elif prompt_ids is not None:
        req.token_ids.ids.extend(prompt_ids)
    for name, value in (
        ("width", width),
        ("top_k_children", top_k_children),
        ("depth", depth),
        ("prefill_chunk", prefill_chunk),
        ("layers_per_step", layers_per_step),
    ):
        if value == "auto":
            value = 0  # the wire's "auto"
        if value is not None:
            setattr(req, name, value)
    return req


class Collector:
    """Accumulates a Generate stream into chunks and the final Completion."""

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

    def add(self, resp: gen.GenerateResponse) -> Chunk | None:
        kind = resp.WhichOneof("event")
        if kind == "started":
            self.request_id = resp.started.request_id
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
            )
            if f.text:
                return Chunk([], f.text, len(self.token_ids))
        return None


def _logprobs(msgs) -> list[tuple[float, dict[int, float]]]:
    return [(lp.logprob, dict(zip(lp.top_ids, lp.top_logprobs, strict=True))) for lp in msgs]
