"""The router: the client-facing Generation service, request validation, and one
`RequestDriver` per request over a path of healthy stage and draft replicas."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path as FsPath

import grpc
from specpipe.common.runtime.lease import DEFAULT_LEASE_SECONDS
from specpipe.common.spec.controller import make_controller
from specpipe.common.spec.options import (
    DecodeOptions,
    Mode,
    check_context,
    check_prompt_ids,
    tree_capacity,
)
from specpipe.common.spec.sampling import SamplingParams
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import generation_pb2 as gen
from specpipe.v1 import generation_pb2_grpc

from ..auth import ApiKeys
from ..grpc_util import Server, channel, wait_until_idle
from ..security import PublicTls, Security
from ..stats_wire import stats_to_proto
from ..transport import TCP, Inbox, Transport, make_transport
from .backends import Backend, Backends, ModelInfo, NoPath
from .bounds import context_of, max_prompt_chars, max_request_bytes
from .driver import DriverError, RequestDriver

log = logging.getLogger(__name__)
SERVICE_NAME = "specpipe.v1.Generation"
# The watchdog: a request with no event (logits, a draft answer) for this long fails
# UNAVAILABLE. Generous: a long prompt's prefill on a slow device brings no event.
DEFAULT_PROGRESS_TIMEOUT = 120.0


@dataclass(frozen=True)
class Plan:
    """A validated request."""

    prompt: list[int]
    mode: Mode
    opts: DecodeOptions


class RequestFailed(Exception):
    """A request refused or failed: the gRPC status a client receives and why. What
    `RouterService.generate` raises; the gRPC handler aborts with it, the HTTP API turns
    it into an OpenAI-shaped error."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class InvalidRequest(RequestFailed):
    """Refused before it starts (validation)."""


class StopGeneration(Exception):
    """Thrown into `RouterService.generate` at a delta (`athrow`): end the request now,
    as finished with reason "stop" (the HTTP API's stop strings)."""


def _invalid(message: str) -> InvalidRequest:
    return InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, message)


class RequestIds:
    """Request ids that are capabilities (docs/architecture.md, "9. Security"): 128
    random bits each, no counter, so no client can predict another's id from its own
    `Started.request_id`, and routers sharing stages never collide."""

    BITS = 128

    def next(self) -> str:
        return secrets.token_urlsafe(self.BITS // 8)


def _load_codec(model_dir: str | None):
    """The target's tokenizer, when its directory has one (random test models do not)."""
    if not model_dir:
        return None
    d = FsPath(model_dir)
    if not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from specpipe.common.text import TextCodec

    return TextCodec.from_dir(d)


class RouterService(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        stage_addresses: list[str],
        draft_address: str | None,
        tokenizer_dir: str | None = None,
        transport_kind: str = TCP,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        model_id: str = "",
        check_interval: float = 0.5,
        api_keys: ApiKeys | None = None,
        name: str = "",
        progress_timeout: float | None = DEFAULT_PROGRESS_TIMEOUT,
        security: Security | None = None,
        public_tls: PublicTls | None = None,
    ) -> None:
        """`security`: mutual TLS to the stages and the draft and authenticated frames
        (--secure); `public_tls`: TLS on the public gRPC port (clients use API keys)."""
        self.security = security
        self.public_tls = public_tls
        self.inbox = Inbox()
        self.transport: Transport = make_transport(
            transport_kind,
            self.inbox,
            bind_host=bind_host,
            advertise_host=advertise_host,
            admit=self.inbox.admit,
            auth=security.frame_auth() if security else None,
        )
        self.transport_kind = transport_kind
        self.backends = Backends(
            stage_addresses,
            draft_address,
            on_down=self._backend_down,
            on_readiness=self._readiness,
            check_interval=check_interval,
            make_channel=lambda address: channel(address, security),
        )
        self.tokenizer_dir = tokenizer_dir
        self.codec = None
        self.model_id_override = model_id
        self.model: ModelInfo | None = None
        self.drivers: dict[str, RequestDriver] = {}
        self._cleanup: set[asyncio.Task] = set()
        self._ids = RequestIds()
        # Leases: this router's stable name (default host:port, set at start) and this
        # process's epoch (start time first: a restarted router's is larger).
        self.name = name
        self.epoch = f"{time.time_ns():020d}-{secrets.token_hex(4)}"
        self._renewer: asyncio.Task | None = None
        self.progress_timeout = progress_timeout
        self.draining = False
        self.api_keys = api_keys or ApiKeys()
        auth = [self.api_keys.grpc_interceptor(SERVICE_NAME)] if self.api_keys.enabled else []
        # Requests larger than any prompt that fits the context are refused by gRPC
        # before they are read (RESOURCE_EXHAUSTED); the HTTP API caps bodies the same.
        self.max_request_bytes = max_request_bytes(context_of(tokenizer_dir))
        self.server = Server(
            [SERVICE_NAME],
            interceptors=auth,
            max_receive_bytes=self.max_request_bytes,
            credentials=public_tls.server_credentials() if public_tls else None,
        )
        # Tokenizing (and chat templates) off the event loop: a long prompt never delays
        # other requests' tokens or the health checks.
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        generation_pb2_grpc.add_GenerationServicer_to_server(self, self.server.server)

    # -- lifecycle -----------------------------------------------------------------------
    async def start(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        data_port: int = 0,
        startup_timeout: float = 120.0,
        health_port: int | None = None,
    ) -> int:
        await self.transport.start(data_port)
        port = await self.server.start(host, port, health_port)
        self.name = self.name or f"{socket.gethostname()}:{port}"
        await self.server.set_serving(False)
        self.codec = await asyncio.get_running_loop().run_in_executor(
            None, _load_codec, self.tokenizer_dir
        )
        self.model = await self.backends.connect(startup_timeout)
        for b in self.backends.stages:
            scheme = b.desc.data_address.partition("://")[0]
            if scheme != self.transport_kind:
                raise RuntimeError(
                    f"{b.label} uses the {scheme} data plane, this router {self.transport_kind}: "
                    "start every service of a deployment with the same --transport"
                )
        if self.model_id_override:
            self.model.model_id = self.model_id_override
        await self.renew()  # a restarted router's predecessor's requests are freed now
        self._renewer = asyncio.create_task(self._renew_forever(), name="lease-renewal")
        await self._readiness(self.backends.ready)
        return port

    async def drain(self, seconds: float) -> None:
        """Graceful shutdown, first half: NOT_SERVING at once, refuse new requests, and
        let open ones finish for up to `seconds` (then `stop` fails what is left)."""
        self.draining = True
        await self.server.enter_drain()
        log.info("draining %d open requests for up to %.0f s", len(self.drivers), seconds)
        left = await wait_until_idle(lambda: len(self.drivers), seconds)
        if left:
            log.warning("drain deadline passed with %d requests open", left)

    async def stop(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
        for d in list(self.drivers.values()):
            d.fail(
                grpc.StatusCode.UNAVAILABLE,
                "the router shut down before this request finished (retry it)",
            )
        await self.server.stop()
        if self._cleanup:
            await asyncio.wait(self._cleanup, timeout=5.0)
        await self.backends.close()
        await self.transport.close()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    async def _readiness(self, ready: bool) -> None:
        await self.server.set_serving(ready)

    # -- leases --------------------------------------------------------------------------
    def renew_interval(self) -> float:
        """A third of the shortest lease any backend grants (they say in Describe)."""
        leases = [b.desc.lease_seconds for b in self.backends.all if b.desc is not None]
        leases = [t for t in leases if t > 0] or [DEFAULT_LEASE_SECONDS]
        return min(leases) / 3

    async def renew(self) -> None:
        """One keep-alive round: every backend renews the leases of this router's requests
        on it; a request a backend no longer holds fails (its lease expired, or the
        backend restarted)."""
        calls, backends = [], []
        for b in self.backends.all:
            ids = [
                rid
                for rid, d in self.drivers.items()
                if b in d.path.backends and (b.kind == "stage" or d.draft is not None)
            ]
            req = pb.RenewRequest(owner=self.name, epoch=self.epoch, request_ids=ids)
            calls.append(b.stub.Renew(req, timeout=5.0))
            backends.append(b)
        results = await asyncio.gather(*calls, return_exceptions=True)
        for b, r in zip(backends, results, strict=True):
            if isinstance(r, BaseException):
                log.debug("renewing leases on %s failed: %s", b.label, r)
                continue
            for rid in r.unknown_ids:
                d = self.drivers.get(rid)
                if d is not None:
                    d.fail(
                        grpc.StatusCode.UNAVAILABLE,
                        f"{b.label} no longer holds this request (its lease expired or it "
                        "restarted); retry it",
                    )

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.renew_interval())
            await self.renew()

    def _backend_down(self, b: Backend, error: str) -> None:
        for d in list(self.drivers.values()):
            if b in d.path.backends and (b.kind == "stage" or d.draft is not None):
                d.fail(grpc.StatusCode.UNAVAILABLE, f"{b.label} went down: {error}")

    # -- validation ----------------------------------------------------------------------
    def _check_model(self, name: str) -> ModelInfo:
        model = self.model
        if model is None:
            raise InvalidRequest(grpc.StatusCode.UNAVAILABLE, "the router is still starting")
        if name and name != model.model_id:
            raise InvalidRequest(
                grpc.StatusCode.NOT_FOUND,
                f"model {name!r} is not served here (this deployment serves {model.model_id!r})",
            )
        return model

    def _tokenize(self, text: str, chat: bool) -> list[int]:
        if self.codec is None:
            raise InvalidRequest(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the served model has no tokenizer: send prompt token ids instead of text",
            )
        from specpipe.common.text import TokenizerError

        try:
            return self.codec.encode(text, chat=chat)
        except TokenizerError as e:
            raise _invalid(str(e)) from None

    def _check_size(self, r: gen.GenerateRequest, model: ModelInfo) -> None:
        """Refuse a prompt that cannot fit the context from its length alone, before it is
        copied or tokenized."""
        which = r.WhichOneof("prompt")
        if which == "text" and len(r.text) > max_prompt_chars(model.max_positions):
            raise _invalid(
                f"the prompt has {len(r.text)} characters: more than any prompt that fits "
                f"the model's context of {model.max_positions} tokens"
            )
        if which == "token_ids" and len(r.token_ids.ids) >= model.max_positions:
            try:
                check_context(len(r.token_ids.ids), 1, model.max_positions)
            except ValueError as e:
                raise _invalid(str(e)) from None

    def _prompt(self, r: gen.GenerateRequest) -> list[int]:
        which = r.WhichOneof("prompt")
        if which == "text":
            if not r.text:
                raise _invalid("the prompt is empty")
            return self._tokenize(r.text, r.chat)
        if which == "token_ids":
            if r.chat:
                raise _invalid("chat needs a text prompt")
            return list(r.token_ids.ids)
        return []

    async def tokenize_off_loop(self, fn, *args):
        """`fn(*args)` (tokenizing, a chat template) on the tokenizer threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, fn, *args)

    async def prepare(self, r: gen.GenerateRequest) -> Plan:
        """`plan`, with the prompt tokenized off the event loop."""
        self._check_size(r, self._check_model(r.model))
        return self.plan(r, await self.tokenize_off_loop(self._prompt, r))

    def plan(self, r: gen.GenerateRequest, prompt: list[int] | None = None) -> Plan:
        """Validate a request against the deployment; every problem is a clear status.
        `prompt`: the request's prompt already tokenized (see `prepare`)."""
        model = self._check_model(r.model)
        if prompt is None:
            self._check_size(r, model)
            prompt = self._prompt(r)
        try:
            check_prompt_ids(prompt, model.vocab_size)
        except ValueError as e:
            raise _invalid(str(e)) from None
        try:
            mode = Mode(r.mode or Mode.SPECPIPE)
        except ValueError:
            modes = ", ".join(m.value for m in Mode)
            raise _invalid(f"unknown mode {r.mode!r} (choose from {modes})") from None
        if mode.uses_draft and self.backends.draft is None:
            raise InvalidRequest(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"mode {mode} needs a draft and this deployment has none (use pp)",
            )
        stops = list(r.stop_token_ids)
        bad = [t for t in stops if not 0 <= t < model.vocab_size]
        if bad:
            raise _invalid(f"stop token ids {bad[:4]} are outside the vocabulary")
        if not r.ignore_eos:
            stops = [*model.eos_token_ids, *stops]
        # The same checks as every other entry point (DecodeOptions, SamplingParams);
        # fields the request leaves unset take DecodeOptions' defaults.
        s = r.sampling
        given = {
            name: getattr(r, field)
            for field, name in (
                ("width", "width"),
                ("top_k_children", "top_k_children"),
                ("depth", "specinfer_depth"),
                ("prefill_chunk", "prefill_chunk"),
            )
            if r.HasField(field)
        }
        try:
            sampling = SamplingParams(
                s.temperature, s.top_k, s.top_p if s.HasField("top_p") else 1.0, s.seed
            )
            opts = DecodeOptions(
                max_new_tokens=r.max_new_tokens,
                sampling=sampling,
                stop_token_ids=tuple(dict.fromkeys(stops)),
                **given,
            )
            check_context(len(prompt), opts.max_new_tokens, model.max_positions)
        except ValueError as e:
            raise _invalid(str(e)) from None
        # The largest logits frame such a request can bring back must be one the router
        # reads (float64 logits, the widest dtype, of every tree row).
        rows = tree_capacity(mode, max(len(model.ranges), 1), opts)
        if rows * model.vocab_size * 8 > self.transport.max_payload_bytes:
            raise _invalid(
                f"a tree of up to {rows} rows (width {opts.width}, depth {opts.specinfer_depth}) "
                f"would bring back more logits of this model's {model.vocab_size}-token "
                "vocabulary than one frame may hold: use a smaller width or depth"
            )
        return Plan(prompt=prompt, mode=mode, opts=opts)

    # -- RPCs ------------------------------------------------------------------------------
    async def generate(
        self, request: gen.GenerateRequest, deadline: float | None = None
    ) -> AsyncIterator[gen.GenerateResponse]:
        """One request: `started`, then `delta`s, then `finished`; raises RequestFailed.
        `deadline` is on time.monotonic() (None: none). The gRPC and HTTP APIs both serve
        requests through this. Closing the generator early (the client went away)
        releases the request on every stage and the draft; throwing StopGeneration in at
        a delta ends it as finished ("stop") and yields the final message."""
        if self.draining:
            raise RequestFailed(
                grpc.StatusCode.UNAVAILABLE,
                "the router is shutting down (draining its open requests): "
                "send new requests to another replica",
            )
        plan = await self.prepare(request)
        try:
            path = self.backends.path(needs_draft=plan.mode.uses_draft)
        except NoPath as e:
            raise RequestFailed(
                grpc.StatusCode.UNAVAILABLE, f"cannot serve requests now: {e}"
            ) from None
        rid = self._ids.next()
        events = self.inbox.open(rid, tree_capacity(plan.mode, len(path.stages), plan.opts))
        controller = make_controller(plan.mode, rid, plan.prompt, plan.opts, len(path.stages))
        driver = RequestDriver(
            controller,
            path,
            self.transport.address,
            events,
            deadline=deadline,
            vocab_size=self.model.vocab_size,
            lease=(self.name, self.epoch),
            progress_timeout=self.progress_timeout,
        )
        self.drivers[rid] = driver
        log.info(
            "%s: %s, %d prompt tokens, %d new",
            rid,
            plan.mode,
            len(plan.prompt),
            plan.opts.max_new_tokens,
        )
        stream = self.codec.stream() if self.codec else None
        index = 0
        stopped = False
        try:
            yield gen.GenerateResponse(
                started=gen.Started(
                    request_id=rid, model=self.model.model_id, prompt_tokens=len(plan.prompt)
                )
            )
            async with contextlib.aclosing(driver.run()) as batches:
                async for tokens in batches:
                    text = "".join(stream.push(t) for t in tokens) if stream else ""
                    try:
                        yield gen.GenerateResponse(
                            delta=gen.TokenDelta(token_ids=tokens, text=text, index=index)
                        )
                    except StopGeneration:
                        stopped = True
                        break
                    index += len(tokens)
            finished = self._finished(driver, stream, len(plan.prompt))
            if stopped:
                finished.finish_reason = "stop"
            yield gen.GenerateResponse(finished=finished)
        except DriverError as e:
            log.warning("%s failed: %s %s", rid, e.code.name, e.message)
            raise RequestFailed(e.code, e.message) from None
        except (RuntimeError, ValueError) as e:  # a bug or a desynchronized pipeline
            log.exception("%s failed", rid)
            raise RequestFailed(grpc.StatusCode.INTERNAL, f"request {rid} failed: {e}") from None
        finally:
            self.drivers.pop(rid, None)
            self.inbox.close(rid)
            # Runs even when the client cancelled (this generator is being closed).
            task = asyncio.ensure_future(driver.release())
            self._cleanup.add(task)
            task.add_done_callback(self._cleanup.discard)

    async def Generate(self, request, context):
        remaining = context.time_remaining()  # None: the client set no deadline
        deadline = None if remaining is None else time.monotonic() + remaining
        async with contextlib.aclosing(self.generate(request, deadline)) as responses:
            try:
                async for response in responses:
                    yield response
            except RequestFailed as e:
                await context.abort(e.code, e.message)

    def _finished(self, driver: RequestDriver, stream, prompt_tokens: int) -> gen.Finished:
        st = driver.stats
        return gen.Finished(
            finish_reason=driver.finish_reason,
            usage=gen.Usage(prompt_tokens=prompt_tokens, completion_tokens=st.new_tokens),
            stats=stats_to_proto(st, *driver.timing()),
            text=stream.flush() if stream else "",
        )

    async def Tokenize(self, request, context) -> gen.TokenizeResponse:
        try:
            self._check_model(request.model)
            if not request.text:
                raise _invalid("the text is empty")
            model = self._check_model(request.model)
            if len(request.text) > max_prompt_chars(model.max_positions):
                raise _invalid(f"the text has {len(request.text)} characters: too long")
            ids = await self.tokenize_off_loop(self._tokenize, request.text, request.chat)
        except InvalidRequest as e:
            await context.abort(e.code, e.message)
        return gen.TokenizeResponse(token_ids=ids)

    async def ListModels(self, request, context) -> gen.ListModelsResponse:
        m = self.model
        if m is None:
            return gen.ListModelsResponse()
        has_draft = self.backends.draft is not None
        modes = [m.value for m in Mode if has_draft or not m.uses_draft]
        card = gen.ModelCard(
            id=m.model_id,
            vocab_size=m.vocab_size,
            max_context=m.max_positions,
            num_layers=m.num_layers,
            stages=len(m.ranges),
            draft_model=m.draft_model,
            weight_hash=m.weight_hash,
            modes=modes,
            has_tokenizer=self.codec is not None,
        )
        return gen.ListModelsResponse(models=[card])

    async def Describe(self, request, context) -> gen.RouterDescription:
        backends = []
        for b in self.backends.all:
            layers = f"{b.layers[0]}:{b.layers[1]}" if b.kind == "stage" and b.desc else ""
            backends.append(
                gen.Backend(
                    kind=b.kind, address=b.address, healthy=b.healthy, layers=layers, error=b.error
                )
            )
        return gen.RouterDescription(
            ready=self.backends.ready,
            active_requests=len(self.drivers),
            backends=backends,
            transport=self.transport_kind,
            data_address=self.transport.address,
        )
