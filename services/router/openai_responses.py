"""OpenAI's response shapes: a chat or text completion, whole or streamed as chunks,
its usage, its logprobs (each token named by its text) and the model cards. No HTTP
here: http_api.py sends what these build.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import generation_pb2 as gen

if TYPE_CHECKING:
    from .text_run import TextRun

# What JSON carries for a logprob of -inf (JSON has no infinities), as OpenAI and vLLM.
MIN_LOGPROB = -9999.0


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: the prompt tokens served from the prefix cache
    (known when the request has finished; None: left out)."""
    answer: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        answer["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return answer


def speculation(stats: gen.SpeculationStats) -> dict[str, Any]:
    """`Finished.stats` as JSON (numbers stay numbers, unlike protobuf's JSON mapping of
    64-bit integers)."""
    return {f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields}


class TokenNames:
    """A token id as logprobs name it: its own text (the tokenizer's string of that one
    token, as vLLM's `convert_tokens_to_string`: "\\ufffd" for a piece of a character),
    or "token_id:N" without a tokenizer (vLLM's `return_tokens_as_token_ids`). Kept per
    id: at most the vocabulary."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        self._names: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            name = self._name(token_id)
            self._names[token_id] = name
        return name

    def _name(self, token_id: int) -> str:
        tok = self.tokenizer
        if tok is None:
            return f"token_id:{token_id}"
        piece = tok.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return f"token_id:{token_id}"
        return tok.convert_tokens_to_string([piece])


# One token of a logprobs answer: its id, and its logprobs (None: the prompt's first).
Entry = tuple[int, pb.TokenLogprobs | None]


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def chat_logprobs(entries: Sequence[Entry], names: TokenNames) -> dict[str, Any]:
    """A chat choice's `logprobs`: per token its text, logprob, UTF-8 bytes and the top
    alternatives (OpenAI's ChatCompletionTokenLogprob)."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        name = names(token_id)
        return {"token": name, "logprob": _lp(logprob), "bytes": list(name.encode())}

    content = []
    for token_id, lp in entries:
        assert lp is not None
        top = [one(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        content.append({**one(token_id, lp.logprob), "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: Sequence[Entry], names: TokenNames, offset: int = 0
) -> tuple[dict[str, Any], int]:
    """A text completion choice's `logprobs` (OpenAI's legacy shape: tokens, their
    logprobs, a {token: logprob} of the token and its alternatives each, and where each
    token's text starts, from `offset`) and the offset after the last token."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for token_id, lp in entries:
        name = names(token_id)
        tokens.append(name)
        offsets.append(offset)
        offset += len(name)
        if lp is None:
            logprobs.append(None)
            tops.append(None)
            continue
        logprobs.append(_lp(lp.logprob))
        top = {name: _lp(lp.logprob)}  # the token first, then its alternatives (vLLM's)
        for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
            top.setdefault(names(i), _lp(v))
        tops.append(top)
    answer = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
              "text_offset": offsets}  # fmt: skip
    return answer, offset


def prompt_entries(run: TextRun) -> list[Entry]:
    """The prompt's tokens with their logprobs (the first has none)."""
    ids, lps = run.prompt_token_ids, run.prompt_logprobs
    return [(t, None if i == 0 else lps[i - 1]) for i, t in enumerate(ids)]


class ResponseShape:
    """Builds the JSON objects of one chat or text completion (ids, times, model), and
    its choices' logprobs (`names`: the tokens' texts) when the request asked for them."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        weight_hash: str = "",
        names: TokenNames | None = None,
        logprobs: bool = False,
    ) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        # OpenAI's "backend configuration" fingerprint: the model version (weight hash).
        self.fingerprint = weight_hash
        self.created = int(time.time())
        self.names = names or TokenNames()
        self.logprobs = logprobs
        self._offsets: dict[int, int] = {}  # text completions streamed: text_offset so far

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict[str, Any]:
        envelope = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.fingerprint:
            envelope["system_fingerprint"] = self.fingerprint
        return {**envelope, **extra}

    def _logprobs(self, index: int, entries: Sequence[Entry]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(entries, self.names)
        answer, self._offsets[index] = completion_logprobs(
            entries, self.names, self._offsets.get(index, 0)
        )
        return answer

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str,
        entries: Sequence[Entry] = (),
        token_ids: list[int] | None = None,
        message: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One choice of a whole (not streamed) answer; `entries`: its tokens;
        `message`: a chat answer's own (function calls), instead of the text's."""
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason,
                                  "logprobs": self._logprobs(index, entries)}  # fmt: skip
        if self.chat:
            choice["message"] = message or {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return choice

    def completion(
        self, choices: list[dict[str, Any]], usage: dict[str, int], stats: Any
    ) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, choices, usage=usage, speculation=stats)

    def chunk(
        self,
        text: str | None = None,
        finish_reason: str | None = None,
        first: bool = False,
        index: int = 0,
        entries: Sequence[Entry] = (),
        token_ids: list[int] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        **extra,
    ) -> dict[str, Any]:
        """A streamed piece of choice `index`: `text` (and the logprobs of `entries`,
        the tokens since the previous piece; `token_ids`, those tokens, for a request
        with `return_token_ids`; a chat's `delta.tool_calls`), or the choice's last
        piece (`finish_reason`)."""
        lps = self._logprobs(index, entries) if entries else None
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": lps}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if token_ids is not None:
            choice["token_ids"] = token_ids
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [choice], **extra)

    def usage_chunk(self, usage: dict[str, int], stats: Any) -> dict[str, Any]:
        """`stream_options.include_usage`: the extra last chunk, with no choices."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [], usage=usage, speculation=stats)


def model_card(model_id: str, created: int, max_context: int, **specpipe: Any) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "specpipe",
        "max_model_len": max_context,
        "specpipe": specpipe,
    }
