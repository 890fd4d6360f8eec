"""The router's OpenAI-compatible HTTP API: FastAPI served by uvicorn inside the
router's own asyncio loop.

Same loop, no hop: a request here calls the engine's `generate` (engine.py) directly, exactly as
the gRPC handler does, so both APIs give the same tokens for the same request and share
validation, draining and cancellation. (A separate process or thread would need a
gRPC hop or cross-loop plumbing for every token, for nothing: the router's work per
token is small and asynchronous.) uvicorn runs without its signal handlers; the
router's process owns SIGTERM and its drain.

One module: the routes, their error mapping and the server that runs them change
together. Routes: POST /v1/chat/completions, POST /v1/completions (streamed as server-sent events
ending with `data: [DONE]`, or not), GET /v1/models[/{id}], GET /health, and vLLM's
beside them (side_endpoints.py): GET /metrics, GET /version, POST /tokenize, POST
/detokenize. Function calling (`tools`): tool_calls.py. Errors come in
OpenAI's shape (see openai_compat.ApiError). A client that disconnects cancels its
request on every stage and the draft. A request for `n` choices is `n` generations
(`Choices`): the first alone until its prefill is done, then the others, which find the
prompt in the prefix cache; streamed, their chunks interleave (docs/api.md).

The port is guarded (http_guard.py, the router's `EdgeLimits`): capped connections, in
all and per client address; a request's headers within a few seconds, its body within
`body_timeout` and no larger than the router's request cap (413 before it is parsed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import grpc
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from specpipe.common.spec.grammar import ResponseFormat
from specpipe.common.spec.tool_parsers import choose_parser
from specpipe.v1 import generation_pb2 as gen
from starlette.exceptions import HTTPException

from specpipe import __version__

from .backends import ModelInfo
from .bounds import max_prompt_chars
from .edge import EdgeLimits
from .engine import RouterEngine
from .http_guard import ConnectionGuard, KeyConnections, guarded_protocol, limit_uvicorn_logs
from .openai_compat import (
    DEFAULT_COMPLETION_TOKENS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Entry,
    Piece,
    ResponseShape,
    TextRun,
    TokenNames,
    bad_request,
    model_card,
    prompt_entries,
    usage,
)
from .requests import RequestFailed
from .side_endpoints import (
    METRICS_KEY,
    METRICS_OFF,
    DetokenizeRequest,
    TokenizeRequest,
    decode_tokens,
    encode_prompt,
    tokenize_answer,
)
from .tool_calls import ToolAnswer, ToolChoice, rendered_conversation

log = logging.getLogger(__name__)
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never received


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


class HttpApi:
    """The routes over one `RouterEngine` (the one the gRPC service holds too); its
    configuration says the model's tool-call format for tool_choice "auto"
    (--tool-call-parser) and who may GET /metrics here (--http-metrics). `limits`: the
    port's (None: the configuration's, edge.py)."""

    def __init__(self, engine: RouterEngine, limits: EdgeLimits | None = None) -> None:
        self.engine = engine
        self.limits = limits or EdgeLimits.of(engine.config)
        self.created = int(time.time())
        self._names = TokenNames()
        self.tool_call_parser = engine.config.tool_call_parser
        self.metrics_access = engine.config.http_metrics
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI(title="SpecPipe", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(ApiError, _api_error)
        app.add_exception_handler(RequestValidationError, _validation_error)
        app.add_exception_handler(HTTPException, _http_error)
        app.add_exception_handler(ClientGone, _client_gone)
        app.add_api_route("/health", self.health, methods=["GET"])
        auth = [Depends(self.authorize)]
        app.add_api_route("/v1/models", self.models, methods=["GET"], dependencies=auth)
        app.add_api_route(
            "/v1/models/{model_id:path}", self.model, methods=["GET"], dependencies=auth
        )
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], dependencies=auth)
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"], dependencies=auth)
        app.add_api_route("/version", self.version, methods=["GET"], dependencies=auth)
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"], dependencies=auth)
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"], dependencies=auth)
        if self.metrics_access != METRICS_OFF:
            guard = auth if self.metrics_access == METRICS_KEY else []
            app.add_api_route("/metrics", self.metrics, methods=["GET"], dependencies=guard)
        app.add_middleware(
            BodyLimit,
            limit=lambda: self.engine.max_request_bytes,
            timeout=self.limits.body_timeout,
            # A body of n bytes holds at least n/4 characters (UTF-8).
            busy=lambda length: self.engine.tokenizer_full(length // 4),
        )
        return app

    # -- routes ------------------------------------------------------------------------
    async def authorize(self, request: Request) -> None:
        why = self.engine.api_keys.check(request.headers.get("authorization"))
        if why is not None:
            code = "missing_api_key" if "needs" in why else "invalid_api_key"
            raise ApiError(401, why, code)

    async def health(self) -> JSONResponse:
        """200 while the router takes requests (a complete path is up), else 503."""
        r = self.engine
        if r.draining:
            status = "draining"
        elif r.model is None:
            status = "starting"
        elif not r.backends.ready:
            status = "unavailable"
        else:
            return JSONResponse({"status": "ok", "model": r.model.model_id})
        # Open to anyone: replicas by kind and layers, never their addresses or errors.
        down = [_public_label(b) for b in r.backends.all if not b.healthy]
        return JSONResponse({"status": status, "unhealthy": down}, status_code=503)

    async def _cards(self) -> list[dict[str, Any]]:
        """The gRPC API's model cards, in OpenAI's shape."""
        return [
            model_card(
                c.id,
                self.created,
                c.max_context,
                stages=c.stages,
                draft_model=c.draft_model,
                weight_hash=c.weight_hash,
                modes=list(c.modes),
            )
            for c in self.engine.model_cards()
        ]

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": await self._cards()}

    async def model(self, model_id: str) -> dict[str, Any]:
        for card in await self._cards():
            if card["id"] == model_id:
                return card
        raise ApiError(404, f"model {model_id!r} is not served here", "model_not_found", "model")

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        body.check()
        prompt = body.prompt_value()
        reqs = body.to_requests(prompt, DEFAULT_COMPLETION_TOKENS, self._mode())
        echo = await self._echo(prompt) if body.echo else None
        return await self._respond(request, body, reqs, chat=False, echo=echo)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        body.check()
        tools = self._tool_choice(body)
        # The model is checked here, once: the engine takes the request for it.
        model = self._checked_model(body.model)
        ids = await self._chat_prompt(model, rendered_conversation(body.messages), tools)
        # OpenAI: without max_tokens, a chat completion may fill the context.
        default = max(1, model.max_positions - len(ids))
        reqs = body.to_requests(ids, default, self._mode())
        if tools is not None and tools.constrains:
            tools.constrain(reqs)
        return await self._respond(request, body, reqs, chat=True, tools=tools, model=model)

    def _checked_model(self, model_id: str) -> ModelInfo:
        """The served model, if `model_id` ("": any) names it; else OpenAI's error."""
        try:
            return self.engine.check_model(model_id)
        except RequestFailed as e:
            raise ApiError.from_status(e.code, e.message) from None

    async def _chat_prompt(
        self,
        model: ModelInfo,
        messages: list[dict[str, Any]],
        tools: ToolChoice | None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The conversation's tokens through the chat template (with the tools), for
        the checked `model`."""
        try:
            chars = _conversation_chars(messages, tools.tools if tools else None)
            if chars > max_prompt_chars(model.max_positions):
                raise bad_request(
                    f"the messages have {chars} characters: more than any prompt that fits "
                    f"the model's context of {model.max_positions} tokens",
                    "messages",
                )
            return await self.engine.tokenize_off_loop(
                chars, self._render, messages, tools.tools if tools else None,
                add_generation_prompt,
            )  # fmt: skip
        except RequestFailed as e:
            raise ApiError.from_status(e.code, e.message) from None

    def _tool_choice(self, body: ChatCompletionRequest) -> ToolChoice | None:
        """The request's function calling, checked (None: none)."""
        if body.tools is None and body.tool_choice is None:
            return None
        codec = self.engine.codec
        template = codec.chat_template_text if codec is not None else ""
        parser = choose_parser(self.tool_call_parser, template)
        tools = ToolChoice.of(body.tools, body.tool_choice, body.parallel_tool_calls, parser)
        fmt = ResponseFormat.from_openai(body.response_format)  # checked by body.check()
        if tools is not None and tools.constrains and fmt.constrains:
            raise bad_request(
                f"response_format cannot be combined with tool_choice {tools.mode!r}: the "
                "output is the tool calls",
                "response_format",
            )
        return tools

    # -- beside the API (vLLM's) ---------------------------------------------------------
    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    async def metrics(self) -> Response:
        """The router's Prometheus registry (its vllm: series too), text format 0.0.4."""
        registry = getattr(self.engine.metrics, "registry", None)
        if registry is None:
            raise ApiError(404, "this router keeps no metrics", "not_found")
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        body.check()
        model = self._model_with_codec(body.model)
        if body.messages is not None:
            tools = ToolChoice.of(body.tools, "none", None, None)
            messages = rendered_conversation(body.messages or [])
            ids = await self._chat_prompt(model, messages, tools, body.add_generation_prompt)
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            if len(body.prompt or "") > max_prompt_chars(model.max_positions):
                raise bad_request(f"the prompt has {len(body.prompt or '')} characters: too long",
                                  "prompt")  # fmt: skip
            ids = await self._off_loop(
                len(body.prompt or ""), encode_prompt, self.engine.codec, body.prompt, special
            )
        names = [self._token_names()(t) for t in ids] if body.return_token_strs else None
        return tokenize_answer(ids, model.max_positions, names)

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        model = self._model_with_codec(body.model)
        text = await self._off_loop(
            len(body.tokens), decode_tokens, self.engine.codec, body.tokens, model.vocab_size
        )
        return {"prompt": text}

    def _model_with_codec(self, model_id: str):
        """The served model, checked against `model_id`, when the router has its tokenizer."""
        model = self._checked_model(model_id)
        if self.engine.codec is None:
            raise ApiError(400, "the served model has no tokenizer here", "failed_precondition")
        return model

    async def _off_loop(self, chars: int, fn, *args):
        try:
            return await self.engine.tokenize_off_loop(chars, fn, *args)
        except RequestFailed as e:
            raise ApiError.from_status(e.code, e.message) from None

    # -- plumbing ------------------------------------------------------------------------
    async def _echo(self, prompt: str | list[int]) -> str:
        """The prompt as `echo` gives it back: its text (token ids decoded)."""
        if isinstance(prompt, str):
            return prompt
        codec = self.engine.codec
        if codec is None or not prompt:
            return ""
        try:
            return await self.engine.tokenize_off_loop(len(prompt), codec.decode, prompt)
        except RequestFailed as e:
            raise ApiError.from_status(e.code, e.message) from None

    def _token_names(self) -> TokenNames:
        """Token texts for logprobs, of the tokenizer the router has now."""
        codec = self.engine.codec
        tokenizer = None if codec is None else codec.tokenizer
        if self._names.tokenizer is not tokenizer:
            self._names = TokenNames(tokenizer)
        return self._names

    def _mode(self) -> str:
        """Without `mode`: specpipe, or pp on a deployment without a draft."""
        return "specpipe" if self.engine.backends.has_draft else "pp"

    def _render(
        self, messages: list[dict[str, Any]], tools=None, add_generation_prompt: bool = True
    ) -> list[int]:
        """Chat messages (and tools) through the model's chat template, as token ids."""
        codec = self.engine.codec
        if codec is None:
            raise RequestFailed(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the served model has no tokenizer: chat completions need one",
            )
        from specpipe.common.text import TokenizerError

        try:
            return codec.encode_chat(messages, tools, add_generation_prompt)
        except TokenizerError as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    def _run(
        self, request: gen.GenerateRequest, caller, stops: list[str], model: ModelInfo | None
    ) -> TextRun:
        """One choice: the engine's events as OpenAI text, cut at the stop strings
        (`model`: checked already; None: the engine checks it)."""
        events = self.engine.generate(request, caller=caller, model=model)
        return TextRun(events, stops, request.min_tokens)

    async def _respond(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        reqs: list[gen.GenerateRequest],
        chat: bool,
        echo: str | None = None,
        tools: ToolChoice | None = None,
        model: ModelInfo | None = None,
    ) -> Response:
        """Run the request's choices (one generation each) and answer, streamed or
        not. The first choice runs alone until its first text, so its prefill is done:
        the others find the prompt's blocks in every stage's prefix cache. With
        `tools`, each choice's output becomes its text and tool calls."""
        client = request.client.host if request.client else ""
        caller = self.engine.api_keys.caller(request.headers.get("authorization"), client)
        try:  # every choice counts against the client's share, all of them up front
            self.engine.check_room(caller, len(reqs))
        except RequestFailed as e:
            raise ApiError.from_status(e.code, e.message) from None
        runs = [self._run(reqs[0], caller, body.stops, model)]
        try:
            # Up to the first text (or the end): until then, a failure (bad request,
            # overload, ...) can still be an HTTP status rather than an event.
            firsts = [await _unless_disconnected(request, runs[0].next())]
            runs += [self._run(r, caller, body.stops, model) for r in reqs[1:]]
            if len(runs) > 1:
                firsts += await _unless_disconnected(
                    request, _together(run.next() for run in runs[1:])
                )
            lead = runs[0]
            model = lead.model or self.engine.model.model_id
            shape = ResponseShape(chat, lead.request_id, model, lead.weight_hash,
                                  self._token_names(), body.top_logprobs_wanted() is not None)  # fmt: skip
            choices = Choices(runs, firsts, shape, echo, tools)
            if body.stream:
                events = _events(
                    choices, body.include_usage, body.return_token_ids, body.continuous_usage
                )
                return EventStream(events, headers={"Cache-Control": "no-cache"})
            await _unless_disconnected(request, _together(run.text() for run in runs))
        except RequestFailed as e:
            await _close(runs)
            raise ApiError.from_status(e.code, e.message) from None
        except BaseException:
            await _close(runs)
            raise
        # With tools, the messages first: they decide the finish reasons.
        tools = choices.tools
        messages = [t.message(r.output) for t, r in zip(tools, runs, strict=True)] if tools else []
        answers = [
            shape.choice(
                i,
                (choices.echo or "") + run.output,
                choices.finish_reason(i),
                choices.entries(i, run.token_ids, run.logprobs, with_prompt=True),
                list(run.token_ids) if body.return_token_ids else None,
                messages[i] if messages else None,
            )
            for i, run in enumerate(runs)
        ]
        return JSONResponse(shape.completion(answers, choices.usage, choices.speculation))


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


def _conversation_chars(messages: list[dict[str, Any]], tools: list | None) -> int:
    """The text a conversation gives the chat template, in characters: the messages'
    content, their tool calls and the tools (as JSON)."""
    chars = sum(len(m.get("content") or "") for m in messages)
    calls = [m["tool_calls"] for m in messages if m.get("tool_calls")]
    extra = [x for x in (calls, tools) if x]
    return chars + sum(len(json.dumps(x, ensure_ascii=False)) for x in extra)


async def _together(works) -> list:
    """Await all of `works`; if one fails, the others are cancelled (and awaited)
    before its error is raised, so their generations can be closed."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _close(runs: list[TextRun]) -> None:
    for run in runs:
        await run.close()


async def _events(
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
                yield _sse(shape.chunk(text="", first=True, index=i, **so_far()))
            elif choices.echo is not None:
                yield _sse(shape.chunk(text=choices.echo, index=i, entries=choices.prompt,
                                       **so_far()))  # fmt: skip
        tasks = [asyncio.ensure_future(pump(i, run, first))
                 for i, (run, first) in enumerate(zip(runs, choices.firsts, strict=True))]  # fmt: skip
        left = len(runs)
        while left:
            i, item = await queue.get()
            if isinstance(item, RequestFailed):
                yield _sse(ApiError.from_status(item.code, item.message).body())
                break
            if item is not None:
                entries = choices.entries(i, item.token_ids, item.logprobs)
                ids = list(item.token_ids) if token_ids else None
                text, calls = choices.piece(i, item.text)
                if text or calls or entries or ids or not choices.tools:
                    yield _sse(shape.chunk(text=text, index=i, entries=entries, tool_calls=calls,
                                           token_ids=ids, **so_far()))  # fmt: skip
                continue
            left -= 1
            text, calls = choices.piece(i, "", final=True) if choices.tools else ("", [])
            if text or calls:  # what the end decided (a call, or held text)
                yield _sse(shape.chunk(text=text, index=i, tool_calls=calls, **so_far()))
            extra = so_far()
            if not include_usage and not left:
                extra = {"usage": choices.usage, "speculation": choices.speculation}
            ids = runs[i].unsent_token_ids if token_ids else None
            yield _sse(
                shape.chunk(finish_reason=choices.finish_reason(i), index=i, token_ids=ids, **extra)
            )
        else:
            if include_usage:
                yield _sse(shape.usage_chunk(choices.usage, choices.speculation))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close(runs)
    yield "data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> str:
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


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, cancelled if the client disconnects first (then ClientGone)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
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


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _public_label(b) -> str:
    """A replica as the public may see it: its kind and layers."""
    layers = f" {b.layers[0]}:{b.layers[1]}" if b.kind == "stage" and b.desc else ""
    return f"{b.kind}{layers}"


class BodyLimit:
    """ASGI middleware: a request body over `limit()` bytes is refused 413 before it is
    parsed: by its Content-Length, or by reading a chunked body up to the limit (the
    body is then passed on as read); one that has not all arrived `timeout` seconds
    after its headers is refused 408 (a client sending a byte at a time holds nothing
    for long); one whose size alone says its prompt could not be tokenized now
    (`busy(length)`) is refused 429 before it is read or parsed."""

    def __init__(self, app, limit, timeout: float, busy=lambda length: False) -> None:
        self.app, self.limit, self.timeout, self.busy = app, limit, timeout, busy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self.limit()
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > cap):
            await self._refuse(cap, scope, receive, send)
            return
        if length is not None and self.busy(int(length)):
            e = ApiError(429, "the router is tokenizing as much as it may at once: retry later",
                         "resource_exhausted")  # fmt: skip
            await _drain(receive)
            await _error_response(e, close=True)(scope, receive, send)
            return
        read, seen = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                e = ApiError(408, f"the request body did not arrive within {self.timeout:.0f} s",
                             "request_timeout")  # fmt: skip
                await _error_response(e, close=True)(scope, receive, send)
                return
            read.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > cap:
                await self._refuse(cap, scope, receive, send)
                return
            if not message.get("more_body"):
                break

        async def replay():
            return read.pop(0) if read else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(cap: int, scope, receive, send) -> None:
        e = ApiError(413, f"the request body is larger than {cap} bytes", "request_too_large")
        await _drain(receive)
        await _error_response(e, close=True)(scope, receive, send)


# A refused body is read and dropped, up to this much for this long, before the answer:
# closing a connection over unread bytes resets it, and the client may lose the answer.
DRAIN_BYTES = 8 << 20
DRAIN_SECONDS = 1.0


async def _drain(receive) -> None:
    seen = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_SECONDS):
            while seen <= DRAIN_BYTES:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body"):
                    return
                seen += len(message.get("body", b""))


# -- errors --------------------------------------------------------------------------------
def _error_response(e: ApiError, close: bool = False) -> JSONResponse:
    """`close`: the body was not read, so the connection ends with this response."""
    headers = {"Retry-After": "1"} if e.status in (429, 503) else {}
    if close:
        headers["Connection"] = "close"
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    return _error_response(e)


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    """A body that does not parse or fit the schema: 400 (FastAPI's default is 422)."""
    errors = e.errors()
    first = errors[0] if errors else {}
    loc = [p for p in first.get("loc", ()) if p != "body"]
    field = str(loc[0]) if loc else None
    if first.get("type") == "json_invalid":
        message = first.get("msg", "invalid request")
        message = f"the body is not valid JSON ({first.get('ctx', {}).get('error', message)})"
        return _error_response(bad_request(message))
    # A union (prompt, stop, content) fails once per accepted shape: the error of the
    # shape the value has (a bound, bad text) says more than "should be a list".
    same = [x for x in errors if [p for p in x.get("loc", ()) if p != "body"][:1] == loc[:1]]
    best = next((x for x in same if not x.get("type", "").endswith(_SHAPE_ERRORS)), first)
    message = best.get("msg", "invalid request").removeprefix("Value error, ")
    if len(same) > 1 and best.get("type", "").endswith(_SHAPE_ERRORS):
        message = f"{message}, nor any other accepted shape"
    return _error_response(bad_request(f"{field}: {message}" if field else message, field))


# pydantic error types that only say the value has another shape than one union member.
_SHAPE_ERRORS = ("_type", "literal_error", "union_tag_invalid")


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    if e.status_code == 400:  # FastAPI's body parse failure (JSON nested too deeply)
        return _error_response(bad_request(f"the body could not be parsed: {e.detail} "
                                           "(JSON nested too deeply?)"))  # fmt: skip
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return _error_response(ApiError(e.status_code, str(e.detail), code))


async def _client_gone(request: Request, e: ClientGone) -> Response:
    return Response(status_code=CLIENT_CLOSED)


# -- server --------------------------------------------------------------------------------
class _Server(uvicorn.Server):
    def capture_signals(self):  # the router's process handles SIGTERM/SIGINT (its drain)
        return contextlib.nullcontext()


class HttpServer:
    """uvicorn serving the HTTP API as a task of the running loop."""

    def __init__(self, engine: RouterEngine, limits: EdgeLimits | None = None) -> None:
        self.api = HttpApi(engine, limits)
        self.guard: ConnectionGuard | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0, tls=None) -> int:
        """Serve on `port` (0: any); HTTPS with `tls` (a `security.PublicTls`)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, reuse_port=False)
        self.port = sock.getsockname()[1]
        limits = self.api.limits
        keys = self.api.engine.api_keys
        self.guard = ConnectionGuard(limits, asyncio.get_running_loop(), per_key=keys.enabled)
        listener = self.guard.listen(sock)
        limit_uvicorn_logs()
        app = self.api.app
        if keys.enabled:  # the per-client connection cap counts keys
            app = KeyConnections(app, self.guard, keys.valid_tenant)
        config = uvicorn.Config(
            app,
            http=guarded_protocol(self.guard),
            timeout_keep_alive=limits.idle_timeout,
            h11_max_incomplete_event_size=limits.max_header_bytes,
            log_config=None,  # the process's logging, not uvicorn's own setup
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            **(
                {"ssl_certfile": str(tls.cert_file), "ssl_keyfile": str(tls.key_file)}
                if tls is not None
                else {}
            ),
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[listener]), name="http-api")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        """Close the listener and end open connections (streams the router has already
        failed end at once); at most `timeout_graceful_shutdown` seconds."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout=10.0)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()
