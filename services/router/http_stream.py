"""One HTTP request's choices answered: what their answer sums up (`Choices`), their
pieces streamed as server-sent events (`events`, `EventStream`), and the waits that a
client's disconnect cancels (`unless_disconnected`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from .http_errors import ClientGone
from .openai_compat import ApiError
from .openai_responses import Entry, ResponseShape, prompt_entries, usage
from .requests import RequestFailed
from .text_run import Piece, TextRun
from .tool_calls import ToolAnswer, ToolChoice

T = TypeVar("T")


class Choices:
    """The generations of one request's choices and what their answer sums up: usage
    over every choice, their stats. `echo`: the prompt's text, for a text completion
    that echoes it (None: none); its tokens' logprobs are the first choice's (the only
    one that asks for them: the prompt is the same). `tools`: the request's function
    calling, which makes each choice's output text and calls (`ToolAnswer`)."""

    def __init__(
        self,
        runs: list[TextRun],
        firsts: list[Piece | None],
        shape: ResponseShape,
        echo: str | None,
        tools: ToolChoice | None = None,
    ) -> None:
        self.runs, self.firsts, self.shape, self.echo = runs, firsts, shape, echo
        self.prompt: list[Entry] = prompt_entries(runs[0]) if echo is not None else []
        self.tools: list[ToolAnswer] = [tools.answer() for _ in runs] if tools else []

    def finish_reason(self, index: int) -> str:
        """A choice's finish reason ("tool_calls" for one that ended with calls)."""
        reason = self.runs[index].finish_reason
        return self.tools[index].finish_reason(reason) if self.tools else reason

    def piece(self, index: int, text: str, final: bool = False) -> tuple[str, list]:
        """A choice's streamed text as (content, delta.tool_calls); `final`: the end."""
        if not self.tools:
            return text, []
        answer = self.tools[index]
        content, calls = answer.push(text)
        if final:
            tail, more = answer.flush()
            content, calls = content + tail, calls + more
        return content, calls

    def entries(self, index: int, ids, logprobs, with_prompt: bool = False) -> list[Entry]:
        """The tokens of a choice's logprobs (none without them); `with_prompt`: the
        echoed prompt's before them."""
        if not self.shape.logprobs:
            return []
        own = list(zip(ids, logprobs, strict=True))
        return [*self.prompt, *own] if with_prompt else own

    @property
    def usage(self) -> dict[str, Any]:
        """The prompt once (its cached tokens too), every choice's completion tokens
        (OpenAI's usage for n); streamed, so far."""
        lead = self.runs[0]
        done = sum(run.completion_tokens for run in self.runs)
        return usage(lead.prompt_tokens, done, lead.cached_tokens)

    @property
    def speculation(self) -> dict[str, Any] | list | None:
        """The request's stats; with several choices, one per choice."""
        if len(self.runs) == 1:
            return self.runs[0].speculation
        return [run.speculation for run in self.runs]


async def together(works) -> list:
    """Await all of `works`; if one fails, the others are cancelled (and awaited)
    before its error is raised, so their generations can be closed."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def close_runs(runs: list[TextRun]) -> None:
    for run in runs:
        await run.close()


async def sse_events(
    choices: Choices,
    include_usage: bool,
    token_ids: bool = False,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    """The server-sent events of a streamed completion: each choice's pieces as they
    come (every chunk holds one choice, `index`; with `token_ids`, the piece's token ids:
    what a resume sends back), then each one's finishing chunk.
    Without include_usage the last finishing chunk carries usage (of every choice) and
    speculation stats; with it, they come in OpenAI's extra last chunk without choices
    instead. `continuous_usage`: every chunk carries the usage so far (vLLM's
    continuous_usage_stats)."""
    shape, runs = choices.shape, choices.runs
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(runs))

    async def pump(i: int, run: TextRun, piece: Piece | None) -> None:
        try:
            while piece is not None:
                await queue.put((i, piece))
                piece = await run.next()
            await queue.put((i, None))
        except RequestFailed as e:
            await queue.put((i, e))

    def so_far() -> dict[str, Any]:
        return {"usage": choices.usage} if continuous_usage else {}

    tasks: list[asyncio.Task] = []
    try:
        for i in range(len(runs)):
            if shape.chat:
                yield sse(shape.chunk(text="", first=True, index=i, **so_far()))
            elif choices.echo is not None:
                yield sse(shape.chunk(text=choices.echo, index=i, entries=choices.prompt,
                                       **so_far()))  # fmt: skip
        tasks = [asyncio.ensure_future(pump(i, run, first))
                 for i, (run, first) in enumerate(zip(runs, choices.firsts, strict=True))]  # fmt: skip
        left = len(runs)
        while left:
            i, item = await queue.get()
            if isinstance(item, RequestFailed):
                yield sse(ApiError.from_status(item.code, item.message).body())
                break
            if item is not None:
                entries = choices.entries(i, item.token_ids, item.logprobs)
                ids = list(item.token_ids) if token_ids else None
                text, calls = choices.piece(i, item.text)
                if text or calls or entries or ids or not choices.tools:
                    yield sse(shape.chunk(text=text, index=i, entries=entries, tool_calls=calls,
                                           token_ids=ids, **so_far()))  # fmt: skip
                continue
            left -= 1
            text, calls = choices.piece(i, "", final=True) if choices.tools else ("", [])
            if text or calls:  # what the end decided (a call, or held text)
                yield sse(shape.chunk(text=text, index=i, tool_calls=calls, **so_far()))
            extra = so_far()
            if not include_usage and not left:
                extra = {"usage": choices.usage, "speculation": choices.speculation}
            ids = runs[i].unsent_token_ids if token_ids else None
            yield sse(
                shape.chunk(finish_reason=choices.finish_reason(i), index=i, token_ids=ids, **extra)
            )
        else:
            if include_usage:
                yield sse(shape.usage_chunk(choices.usage, choices.speculation))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_runs(runs)
    yield "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events; the event generator is closed however the response ends (a
    client that disconnects cancels the stream task: Starlette watches for it)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, cancelled if the client disconnects first (then ClientGone)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping: wait for the work to unwind
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone


async def disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
