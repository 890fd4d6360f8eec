"""One choice of an HTTP request as OpenAI text: the engine's `GenerateResponse`
events (`RouterEngine.generate`) in, pieces of text cut at the request's stop strings
out, and at the end its finish reason, usage and speculation stats. No HTTP here:
http_api.py streams or collects the pieces; openai_responses.py shapes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import generation_pb2 as gen

from .openai_responses import speculation, usage
from .requests import StopGeneration


# -- stop strings --------------------------------------------------------------------------
class StopMatcher:
    """Cuts streamed text at the first stop string. Text that could be the start of a
    stop string is held back until the next piece decides; once a stop string has
    appeared, `stopped` is set and nothing more comes out (the stop string included).

    With `min_tokens`, text pushed before that many tokens are out is not searched
    (vLLM's rule: a stop string is honoured once min_tokens tokens are out): a stop
    string counts only where it ends in text pushed after (one may begin before)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._held = ""
        self._early = 0  # characters at the start of _held pushed before min_tokens

    def push(self, text: str, honoured: bool = True) -> str:
        """The text that is safe to emit after this piece; `honoured`: whether a stop
        string may end in it (False: the output has fewer than min_tokens tokens)."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        buf = self._held + text
        early = self._early if honoured else len(buf)  # where no stop string may end
        if honoured:
            found = (buf.find(s, max(0, early - len(s) + 1)) for s in self.stops)
            hits = [i for i in found if i >= 0]
            if hits:
                self.stopped, self._held = True, ""
                return buf[: min(hits)]
        cut = len(buf) - self._partial(buf)
        self._held, self._early = buf[cut:], max(0, early - cut)
        return buf[:cut]

    def flush(self) -> str:
        """At the end of the output: what was held back (no stop string came)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _partial(self, buf: str) -> int:
        """Length of the longest end of `buf` that begins some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best


# -- one request's events ------------------------------------------------------------------
@dataclass
class Piece:
    """Text left after stop strings, and the tokens generated since the previous piece
    (with their logprobs, for a request that asked for them): the text of a token may
    come later than the token (an incomplete character, a possible stop string)."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)


class TextRun:
    """The `GenerateResponse` events of one request (from `RouterEngine.generate`) as
    OpenAI text: `next()` gives the pieces of text left after stop strings; at the end,
    the finish reason, usage and speculation stats. A stop string ends the request at
    once (StopGeneration thrown in: the stages free it, the stats come back), but not
    before `min_tokens` tokens are out (the request's: its stop tokens wait as long;
    the engine starts a delta where the output reaches it). Raises what the events
    raise (RequestFailed)."""

    def __init__(
        self,
        responses: AsyncGenerator[gen.GenerateResponse, None],
        stops: Sequence[str] = (),
        min_tokens: int = 0,
    ) -> None:
        self._responses = responses
        self.matcher = StopMatcher(stops)
        self.min_tokens = min_tokens
        self._out = 0  # output tokens so far (a resume's included)
        self.request_id = ""
        self.model = ""
        self.weight_hash = ""
        self.prompt_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: list[pb.TokenLogprobs] = []  # one per token, when asked for
        # The first delta's, when the request asked for prompt logprobs.
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: list[pb.TokenLogprobs] = []
        self.output = ""  # the text given out so far
        self.finished: gen.Finished | None = None
        self.finish_reason = ""
        self._ids: list[int] = []  # tokens since the last piece
        self._lps: list[pb.TokenLogprobs] = []
        self._pieces = self._run()

    async def next(self) -> Piece | None:
        """The next piece; None once the request has finished."""
        piece = await anext(self._pieces, None)
        if piece is not None:
            self.output += piece.text
        return piece

    async def text(self) -> str:
        """All of the (rest of the) text."""
        parts = []
        while (piece := await self.next()) is not None:
            parts.append(piece.text)
        return "".join(parts)

    async def close(self) -> None:
        """Stop early (the client went away): the router releases the request."""
        await self._pieces.aclose()

    async def _run(self) -> AsyncIterator[Piece]:
        async with contextlib.aclosing(self._responses) as responses:
            async for resp in responses:
                kind = resp.WhichOneof("event")
                if kind == "started":
                    self.request_id = resp.started.request_id
                    self.model, self.weight_hash = resp.started.model, resp.started.weight_hash
                    self.prompt_tokens = resp.started.prompt_tokens
                    continue
                if kind == "delta":
                    d = resp.delta
                    if d.prompt_token_ids:
                        self.prompt_token_ids = list(d.prompt_token_ids)
                        self.prompt_logprobs = list(d.prompt_logprobs)
                    self.token_ids.extend(d.token_ids)
                    self.logprobs.extend(d.logprobs)
                    self._ids.extend(d.token_ids)
                    self._lps.extend(d.logprobs)
                    self._out = d.index + len(d.token_ids)
                    text = self.matcher.push(d.text, self._out >= self.min_tokens)
                    if self.matcher.stopped:
                        final = await responses.athrow(StopGeneration())
                        self._finish(final.finished)
                elif kind == "finished":
                    honoured = self._out >= self.min_tokens
                    text = self.matcher.push(resp.finished.text, honoured) + self.matcher.flush()
                    self._finish(resp.finished)
                # At the end, tokens whose text never came out still bring their logprobs.
                if text or (self.finished is not None and self._lps):
                    yield Piece(text, self._ids, self._lps)
                    self._ids, self._lps = [], []
                if self.finished is not None:
                    return

    @property
    def unsent_token_ids(self) -> list[int]:
        """Tokens no piece carried (their text never came out: an end-of-sequence
        token, text a stop string cut); the finishing chunk carries them."""
        return list(self._ids)

    def _finish(self, finished: gen.Finished) -> None:
        self.finished = finished
        self.finish_reason = "stop" if self.matcher.stopped else finished.finish_reason

    @property
    def completion_tokens(self) -> int:
        f = self.finished
        return f.usage.completion_tokens if f else len(self.token_ids)

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the path had in its prefix cache (None: not finished yet)."""
        return self.finished.usage.cached_tokens if self.finished else None

    @property
    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    @property
    def speculation(self) -> dict[str, Any] | None:
        """The stats, with `resumed_tokens` for a resumed request (`resume_token_ids`)."""
        f = self.finished
        if f is None:
            return None
        out = speculation(f.stats)
        if f.resumed_tokens:
            out["resumed_tokens"] = f.resumed_tokens
        return out
