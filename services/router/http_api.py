"""The router's OpenAI-compatible HTTP API: FastAPI served by uvicorn inside the
router's own asyncio loop.

Same loop, no hop: a request here calls the engine's `generate` (engine.py) directly, exactly as
the gRPC handler does, so both APIs give the same tokens for the same request and share
validation, draining and cancellation. (A separate process or thread would need a
gRPC hop or cross-loop plumbing for every token, for nothing: the router's work per
token is small and asynchronous.) uvicorn runs without its signal handlers; the
router's process owns SIGTERM and its drain.

Routes: POST /v1/chat/completions, POST /v1/completions (streamed as server-sent
events ending with `data: [DONE]`, or not), GET /v1/models[/{id}], GET /health, and
vLLM's beside them (side_endpoints.py): GET /metrics, GET /version, POST /tokenize,
POST /detokenize. Function calling (`tools`): tool_calls.py. Errors come in OpenAI's
shape (http_errors.py). A client that disconnects cancels its request on every stage
and the draft. A request for `n` choices is `n` generations: the first alone until its
prefill is done, then the others, which find the prompt in the prefix cache; streamed,
their chunks interleave (http_stream.py, docs/api.md).

The port is guarded (http_guard.py, the router's `EdgeLimits`): capped connections, in
all and per client address; a request's headers within a few seconds, its body within
`body_timeout` and no larger than the router's request cap (413 before it is parsed).

One module of about 480 lines: the routes and the server that runs them, each route
reading top to bottom from its body to its answer over the helpers they share (the
model and tokenizer checks, the chat template off the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from pathlib import Path
from typing import Any, TypeVar

import grpc
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from specpipe.common.spec.grammar import ResponseFormat
from specpipe.common.spec.tool_parsers import choose_parser
from specpipe.v1 import generation_pb2 as gen

from specpipe import __version__

from .backends import ModelInfo
from .bounds import max_prompt_chars
from .edge import EdgeLimits
from .engine import RouterEngine
from .http_errors import add_error_handlers
from .http_guard import (
    BodyLimit,
    ConnectionGuard,
    KeyConnections,
    guarded_protocol,
    limit_uvicorn_logs,
)
from .http_stream import Choices, EventStream, close_runs, sse_events, together, unless_disconnected
from .openai_compat import (
    DEFAULT_COMPLETION_TOKENS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
)
from .openai_responses import ResponseShape, TokenNames, model_card
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
from .text_run import TextRun
from .tool_calls import ToolChoice, rendered_conversation

log = logging.getLogger(__name__)
T = TypeVar("T")


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
        add_error_handlers(app)
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
        # The model is checked here, once: the engine takes the request for it.
        model = self._checked_model(body.model)
        tools = self._tool_choice(body, model)
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

    def _tool_choice(self, body: ChatCompletionRequest, model: ModelInfo) -> ToolChoice | None:
        """The request's function calling, checked (None: none)."""
        if body.tools is None and body.tool_choice is None:
            return None
        codec = self.engine.codec
        template = codec.chat_template_text if codec is not None else ""
        names = (model.model_id, Path(self.engine.tokenizer_dir or "").name)
        parser = choose_parser(self.tool_call_parser, template, names)
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
            firsts = [await unless_disconnected(request, runs[0].next())]
            runs += [self._run(r, caller, body.stops, model) for r in reqs[1:]]
            if len(runs) > 1:
                firsts += await unless_disconnected(
                    request, together(run.next() for run in runs[1:])
                )
            lead = runs[0]
            model = lead.model or self.engine.model.model_id
            shape = ResponseShape(chat, lead.request_id, model, lead.weight_hash,
                                  self._token_names(), body.top_logprobs_wanted() is not None)  # fmt: skip
            choices = Choices(runs, firsts, shape, echo, tools)
            if body.stream:
                events = sse_events(
                    choices, body.include_usage, body.return_token_ids, body.continuous_usage
                )
                return EventStream(events, headers={"Cache-Control": "no-cache"})
            await unless_disconnected(request, together(run.text() for run in runs))
        except RequestFailed as e:
            await close_runs(runs)
            raise ApiError.from_status(e.code, e.message) from None
        except BaseException:
            await close_runs(runs)
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


def _conversation_chars(messages: list[dict[str, Any]], tools: list | None) -> int:
    """The text a conversation gives the chat template, in characters: the messages'
    content, their tool calls and the tools (as JSON)."""
    chars = sum(len(m.get("content") or "") for m in messages)
    calls = [m["tool_calls"] for m in messages if m.get("tool_calls")]
    extra = [x for x in (calls, tools) if x]
    return chars + sum(len(json.dumps(x, ensure_ascii=False)) for x in extra)


def _public_label(b) -> str:
    """A replica as the public may see it: its kind and layers."""
    layers = f" {b.layers[0]}:{b.layers[1]}" if b.kind == "stage" and b.desc else ""
    return f"{b.kind}{layers}"


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
