"""The router's request engine (as vLLM's EngineCore apart from its API server): it
owns admission (the scheduler), each request's first path, its `RequestDriver` and its
events. `generate` takes one request from any front end (the gRPC service, the HTTP
API) and yields its `started`, `delta`s and `finished`; the request's model and size
are checked once, here (`generate` -> `prepare` -> `plan`).

The front ends (service.py, http_api.py) translate to and from it and call only its
public methods; waiting for a running slot is admission.py, the lease keep-alive
keepalive.py. One module of about 610 lines: a request's walk (check, plan, admit,
open, stream, end) reads top to bottom here, over the state it shares with the other
requests (drivers, scheduler, codec).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
from specpipe.common.runtime.lease import MIN_TOKEN_BYTES
from specpipe.common.runtime.prefix_hash import NO_SCOPE, CacheScope
from specpipe.common.spec.controller import make_controller
from specpipe.common.spec.grammar import GrammarError, load_grammar_tokenizer
from specpipe.common.spec.options import Mode, check_step_rows
from specpipe.v1 import generation_pb2 as gen

from ..auth import ApiKeys, Caller
from ..control import logprobs_to_proto
from ..grpc_util import channel
from ..ratelog import RateLimitedLog
from ..security import Security
from ..stats_wire import stats_to_proto
from ..transport import TCP, Inbox, Transport, make_transport
from .admission import Admission
from .backends import Backend, Backends, ModelInfo, NoPath
from .bounds import context_of, max_prompt_chars, max_request_bytes
from .cache_scope import CacheScopes
from .calls import DriverError, LeaseClaim
from .control_stream import ControlFrames
from .discovery import Discovery, discovery_of
from .driver import DriverSettings, RequestDriver
from .keepalive import LeaseKeepAlive
from .path_session import first_path
from .requests import (
    InvalidRequest,
    Plan,
    RequestDefaults,
    RequestFailed,
    RequestIds,
    StopGeneration,
    check_model,
    check_priority,
    check_size,
    grammar_of,
    invalid,
    load_codec,
    plan_request,
    prompt_of,
    response_format_of,
)
from .step_fit import check_cache_fits, prefill_cells_of
from .tokenizing import BUDGET_PROMPTS, TokenizingQueue
from .tuning import RouterTuning, Tuned

if TYPE_CHECKING:
    from ..config import RouterConfig

log = logging.getLogger(__name__)


class RouterEngine:
    """Requests in, events out, over the replicas `discovery` finds."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        discovery: Discovery | None = None,
        api_keys: ApiKeys | None = None,
        security: Security | None = None,
        metrics=None,
    ) -> None:
        """Every setting comes from `config` (`specpipe router`'s flags). The live
        objects it names, when the caller made them already (the command line does, to
        report a bad file before anything starts): `discovery`, the replicas' source
        (None: made here from --stages/--draft/--discovery), `api_keys` (None: loaded
        here from --api-key/--api-key-file); `security`: the internal planes' mutual TLS
        and frame keys (--secure; None: plaintext); `metrics`: a RouterMetrics, or None."""
        s = config.scheduling
        self.config = config
        self.security = security
        self.inbox = Inbox()
        self.transport_kind = config.transport or TCP
        self.transport = data_plane(config, self.inbox, security)
        if discovery is None:
            discovery = discovery_of(config)
        self.backends = Backends(
            discovery,
            on_down=self._backend_down,
            on_readiness=self._readiness,
            check_interval=config.health_check_interval,
            transport_kind=self.transport_kind,
            make_channel=lambda address: channel(address, security),
            stall_seconds=config.replica_stall_seconds,
            control_frames=(
                None if config.no_control_frames else ControlFrames(self.transport, self.inbox)
            ),
            relay_prunes=not config.no_relay_prunes,
        )
        self.metrics = metrics  # services/metrics.RouterMetrics, or None
        self.tokenizer_dir = config.target
        # Requests larger than any prompt that fits the context are refused before they
        # are read: by gRPC (RESOURCE_EXHAUSTED) and the HTTP API (413).
        self.max_request_bytes = max_request_bytes(context_of(config.target))
        self.codec = None
        self.grammar_tokenizer = None  # response_format: loaded at the first such request
        self.model_id_override = config.model_id
        self.drivers: dict[str, RequestDriver] = {}
        self.defaults = RequestDefaults(s.width, s.layers_per_step, s.token_source)
        self.tuning = RouterTuning.of(s)
        # Faults: how long a replay waits for a path, how long a silent path is trusted
        # (the watchdog), how often one request is replayed before it fails, and how
        # long a verification waits for a late draft answer (driver.py).
        self.driver_settings = DriverSettings.of(config)
        # Admission and elastic width; the row budget may come from the stages ("auto").
        self.admission = Admission(
            self.drivers,
            s.max_running,
            s.max_waiting,
            s.max_running_per_key,
            s.max_waiting_per_key,
        )
        self.scheduler = self.admission.scheduler
        # Prefix-cache namespaces: per tenant, keyed with the deployment's secret.
        self.cache_scopes = CacheScopes(
            security.data_secret if security else None, config.share_prefix_cache
        )
        self._cleanup: set[asyncio.Task] = set()
        self._ids = RequestIds()
        # Leases: this router's stable name (default host:port, set at start), this
        # process's epoch (its start time in ns: a restarted router's is larger) and its
        # lease token (random: only this process renews its requests).
        self.name = config.router_name
        self.epoch = time.time_ns()
        self.lease_token = secrets.token_bytes(MIN_TOKEN_BYTES)
        self.keepalive = LeaseKeepAlive(self.backends, self.drivers, self.lease)
        self.draining = False
        self.api_keys = api_keys or ApiKeys.load(
            config.api_keys, config.api_key_files, config.max_priority
        )
        self._readiness_watchers: list[Callable[[bool], Awaitable[None]]] = []
        # Tokenizing (and chat templates) off the event loop, bounded: a long prompt never
        # delays other requests' tokens or the health checks (tokenizing.py).
        self._tokenizing = TokenizingQueue()
        self._failures = RateLimitedLog(log)  # a failing replica fails many requests

    @property
    def lease(self) -> LeaseClaim:
        return LeaseClaim(self.name, self.epoch, self.lease_token)

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self, startup_timeout: float, default_name: str) -> None:
        """Load the tokenizer, find a complete path, free a predecessor's requests (a
        restarted router's: its name is this one's; `default_name` without
        --router-name) and keep this router's leases. The data plane is started first
        (`transport.start`): the front end that owns the process starts both."""
        self.name = self.name or default_name
        self.codec = await asyncio.get_running_loop().run_in_executor(
            None, load_codec, self.tokenizer_dir
        )
        try:
            await self.backends.connect(startup_timeout)
        except NoPath as e:
            raise RuntimeError(f"the router cannot start: {e}") from None
        self.scheduler.num_stages = len(self.backends.model.ranges) if self.backends.model else 1
        self.scheduler.row_budget = self._row_budget()
        self.keepalive.claim = self.lease
        await self.keepalive.renew()  # a restarted router's predecessor's requests go now
        self.keepalive.start()

    async def stop(self) -> None:
        """Fail what is still open (`close` then releases it and closes the replicas and
        the data plane)."""
        self.keepalive.stop()
        for d in list(self.drivers.values()):
            d.fail(
                grpc.StatusCode.UNAVAILABLE,
                "the router shut down before this request finished (retry it)",
            )

    async def close(self) -> None:
        if self._cleanup:
            await asyncio.wait(self._cleanup, timeout=5.0)
        await self.backends.close()
        await self.transport.close()
        self._tokenizing.shutdown()

    def watch_readiness(self, watcher: Callable[[bool], Awaitable[None]]) -> None:
        """Call `watcher(ready)` whenever a complete path comes up or goes (a front end
        reports it: gRPC health)."""
        self._readiness_watchers.append(watcher)

    async def _readiness(self, ready: bool) -> None:
        for watcher in self._readiness_watchers:
            await watcher(ready)

    def _row_budget(self) -> int | None:
        """--row-budget: a number, "auto" (the smallest a stage measured), or None."""
        spec = self.config.scheduling.row_budget
        if spec in (None, "", "none"):
            return None
        if spec != "auto":
            return int(spec)
        stages = [b for b in self.backends.stages if b.desc is not None]
        measured = [b.desc.row_budget for b in stages if b.desc.row_budget]
        if not stages or len(measured) < len(stages):
            raise RuntimeError(
                "--row-budget auto needs every stage's measured cost curve: "
                "start the stages with --measure-costs"
            )
        budget = min(measured)
        log.info("row budget %d rows per step (the smallest of %s)", budget, measured)
        return budget

    @property
    def model(self) -> ModelInfo | None:
        """The model version new requests go to (the newest complete one)."""
        m = self.backends.model
        if m is not None and self.model_id_override:
            return dataclasses.replace(m, model_id=self.model_id_override)
        return m

    @model.setter
    def model(self, value: ModelInfo | None) -> None:
        self.backends.model = value

    def _backend_down(self, b: Backend, error: str) -> None:
        for d in list(self.drivers.values()):
            d.backend_down(b, error)

    # -- validation ----------------------------------------------------------------------
    def check_model(self, name: str) -> ModelInfo:
        """The served model, if `name` (empty: any) names it; a clear status if not."""
        return check_model(self.model, name)

    def model_cards(self) -> list[gen.ModelCard]:
        """The served model as the APIs list it (none while the router starts)."""
        m = self.model
        if m is None:
            return []
        has_draft = self.backends.has_draft
        return [
            gen.ModelCard(
                id=m.model_id,
                vocab_size=m.vocab_size,
                max_context=m.max_positions,
                num_layers=m.num_layers,
                stages=len(m.ranges),
                draft_model=m.draft_model,
                weight_hash=m.weight_hash,
                modes=[mode.value for mode in Mode if has_draft or not mode.uses_draft],
                has_tokenizer=self.codec is not None,
            )
        ]

    def plan(
        self,
        r: gen.GenerateRequest,
        prompt: list[int] | None = None,
        grammar=None,
        model: ModelInfo | None = None,
    ) -> Plan:
        """Validate a request against the deployment; every problem is a clear status.
        `prompt`, `grammar`, `model`: the request's prompt already tokenized (and so
        its size checked), its response_format compiled and its model checked (see
        `prepare`)."""
        model = model or self.check_model(r.model)
        if prompt is None:
            check_size(r, model)
            prompt = prompt_of(r, self.codec)
        plan = plan_request(
            r,
            model,
            prompt,
            self.backends.has_draft,
            self.defaults,
            self.grammar_tokenizer,
            grammar,
        )
        # The rows one step may take here: the fewest any stage or the draft takes.
        caps = [b.desc.max_step_rows for b in self.backends.all if b.desc is not None]
        caps = [c for c in caps if c > 0]
        if caps:
            try:
                check_step_rows(plan.mode, plan.opts, min(caps))
            except ValueError as e:
                raise invalid(str(e)) from None
        return self._fit_stages(plan)

    def _fit_stages(self, plan: Plan) -> Plan:
        """Refuse a prompt no path can hold; size its prefill chunks to the stages'
        prefill budget (step_fit.py)."""
        descs = [b.desc for b in self.backends.stages if b.desc is not None]
        try:
            check_cache_fits(len(plan.prompt), descs)
        except ValueError as e:
            raise invalid(str(e)) from None
        cells = prefill_cells_of(descs)
        if cells is None or plan.opts.prefill_cells is not None:
            return plan
        return dataclasses.replace(plan, opts=dataclasses.replace(plan.opts, prefill_cells=cells))

    def _tune(self, plan: Plan) -> tuple[Plan, Tuned | None]:
        """Fill in the settings a request leaves to the router (`auto`); every request is
        tracked while it runs (`Tuned`: the tuner measures only requests with no other
        setting beside them)."""
        model = self.model
        if model is None:
            return plan, None
        mode, opts, tuned = self.tuning.resolve(
            plan.mode, plan.opts, plan.space, self.backends, model.weight_hash
        )
        return dataclasses.replace(plan, mode=mode, opts=opts), tuned

    def _tokenize_budget(self) -> int:
        model = self.model or self.check_model("")  # none yet: the router is starting
        return BUDGET_PROMPTS * max_prompt_chars(model.max_positions)

    async def tokenize_off_loop(self, chars: int, fn, *args):
        """`fn(*args)` (tokenizing, a chat template) for a text of `chars` characters, on
        the tokenizer threads; RESOURCE_EXHAUSTED when they have too much to do."""
        return await self._tokenizing.run(chars, self._tokenize_budget(), fn, *args)

    def tokenizer_full(self, chars: int) -> bool:
        """Whether a text of at least `chars` characters would be refused now."""
        return self.model is not None and self._tokenizing.full(chars, self._tokenize_budget())

    async def prepare(self, r: gen.GenerateRequest, model: ModelInfo) -> Plan:
        """`plan` for the checked `model`: the size checked once, a text prompt
        tokenized off the event loop."""
        check_size(r, model)
        grammar = await self._grammar_of(r, model)
        if r.WhichOneof("prompt") != "text" or not r.text:
            prompt = prompt_of(r, self.codec)
        else:
            prompt = await self.tokenize_off_loop(len(r.text), prompt_of, r, self.codec)
        return self.plan(r, prompt, grammar, model)

    async def _grammar_of(self, r: gen.GenerateRequest, model: ModelInfo):
        """The request's response_format compiled (None: text), off the event loop: the
        tokenizer's view once (about a second for a large vocabulary), then the grammar
        (milliseconds, about 0.1 s for a schema of 100 kB)."""
        if not response_format_of(r).constrains:
            return None
        loop = asyncio.get_running_loop()
        if self.grammar_tokenizer is None and self.codec is not None and self.tokenizer_dir:
            try:
                self.grammar_tokenizer = await loop.run_in_executor(
                    None,
                    load_grammar_tokenizer,
                    str(self.tokenizer_dir),
                    model.vocab_size,
                    tuple(model.eos_token_ids),
                )
            except GrammarError as e:
                raise InvalidRequest(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        return await loop.run_in_executor(None, grammar_of, r, self.grammar_tokenizer)

    # -- requests ------------------------------------------------------------------------
    async def generate(
        self,
        request: gen.GenerateRequest,
        deadline: float | None = None,
        caller: Caller | None = None,
        model: ModelInfo | None = None,
        sink: Callable[[gen.GenerateResponse], None] | None = None,
    ) -> AsyncIterator[gen.GenerateResponse]:
        """One request: `started`, then `delta`s, then `finished`; raises RequestFailed.
        `deadline` is on time.monotonic() (None: none); `caller`: what the client may do
        (its API key's; None: the defaults); `model`: `check_model(request.model)` as a
        front end already called it for its own checks (None: called here). The gRPC and HTTP APIs both serve
        requests through this. Closing the generator early (the client went away)
        releases the request on every stage and the draft; throwing StopGeneration in at
        a delta ends it as finished ("stop") and yields the final message. With `sink`,
        the deltas go to it instead, each called where its tokens were verified (a
        frame's callback: no task wakes per delta, issue 34), and only `started` and
        `finished` are yielded; an exception `sink` raises (other than RuntimeError or
        ValueError: grpc_util.ClientGone, the client went away) comes out of here as is
        and the request ends as when the generator is closed early."""
        self._refuse_while_draining()
        caller = caller or self.api_keys.caller(None)
        check_priority(request.priority, caller)
        try:
            scope = self.cache_scopes.of(caller.tenant, request.cache_salt)
        except ValueError as e:
            raise invalid(str(e)) from None
        model = model or self.check_model(request.model)
        plan, tuned = self._tune(await self.prepare(request, model))
        driver = await self._start(plan, tuned, request.priority, deadline, caller.tenant, scope)
        stream = self.codec.stream() if self.codec else None
        if stream is not None:  # a resume: the client has these tokens' text; continue it
            for t in plan.resume:
                stream.push(t)
        failed, stopped, index = True, False, len(plan.resume)
        if sink is not None:

            def hand_on(batch: list[int]) -> None:
                nonlocal index
                for tokens in split_at_min_tokens(batch, index, plan.opts.min_tokens):
                    sink(self._delta(driver, stream, tokens, index, plan))
                    index += len(tokens)

            driver.on_tokens = hand_on
        try:
            yield self._started(driver, len(plan.prompt))
            async with contextlib.aclosing(driver.run()) as batches:
                async for batch in batches:
                    for tokens in split_at_min_tokens(batch, index, plan.opts.min_tokens):
                        try:
                            yield self._delta(driver, stream, tokens, index, plan)
                        except StopGeneration:
                            stopped = True
                            break
                        index += len(tokens)
                    if stopped:
                        break
            finished = self._finished(driver, stream, len(plan.prompt))
            if stopped:
                finished.finish_reason = "stop"
            failed = False
            # measured before the client hears: its next request is decided after this
            try:
                self.tuning.finish(tuned, driver.stats, driver.timing()[1])
            except Exception:  # a bug in the tuner's accounting: not the request's failure
                log.exception("tuning: a finished request's measurement failed")
            tuned = None
            yield gen.GenerateResponse(finished=finished)
        except DriverError as e:
            self._failures.warning(
                e.code.name, "a %s request failed: %s %s", plan.mode, e.code.name, e.message
            )
            log.debug("%s failed", driver.request_id)
            raise RequestFailed(e.code, e.message, final=True) from None
        except (RuntimeError, ValueError) as e:  # a bug or a desynchronized pipeline
            log.exception("a %s request failed", plan.mode)
            log.debug("%s failed", driver.request_id)
            raise RequestFailed(grpc.StatusCode.INTERNAL, f"the request failed: {e}") from None
        finally:  # also when the client cancelled (this generator is being closed)
            self._end(driver, tuned, failed)

    def _refuse_while_draining(self) -> None:
        if self.draining:
            raise RequestFailed(
                grpc.StatusCode.UNAVAILABLE,
                "the router is shutting down (draining its open requests): "
                "send new requests to another replica",
            )

    async def _start(
        self,
        plan: Plan,
        tuned: Tuned | None,
        priority: int,
        deadline: float | None,
        tenant: str = "",
        scope: CacheScope = NO_SCOPE,
    ) -> RequestDriver:
        """Admit a planned request of `tenant` (it may wait for a slot), choose its first
        path and make its controller and driver; the request then counts as running.
        `scope`: its prefix-cache scope on every replica."""
        rid = self._ids.next()
        try:
            await self.admission.admit(rid, plan, priority, deadline, tenant)
        except BaseException:
            self.tuning.finish(tuned, None)
            raise
        self.tuning.started(tuned)  # runs from now on: shares its version's forwards
        t0 = time.perf_counter()
        try:
            path = first_path(self.backends, plan.mode, plan.opts, plan.prompt, scope)
        except NoPath as e:
            self.admission.leave(rid)
            self.tuning.finish(tuned, None)
            log.debug("no path for a request: %s", e)  # names replicas: not for clients
            raise RequestFailed(
                grpc.StatusCode.UNAVAILABLE,
                "cannot serve requests now: no complete path of healthy replicas",
            ) from None
        metrics = self.metrics
        if metrics is not None:
            metrics.path_choice.observe(time.perf_counter() - t0)
        try:
            controller = make_controller(plan.mode, rid, plan.prompt, plan.opts, len(path.stages))
            controller.resume(plan.resume)  # a resume: a replay at the client's tokens
            driver = RequestDriver(
                controller,
                self.backends,
                path,
                self.transport.address,
                self.inbox,
                settings=self.driver_settings,
                deadline=deadline,
                lease=LeaseClaim(self.name, self.epoch, self.lease_token),
                vocab_size=self.model.vocab_size if self.model else None,
                on_replay=metrics.replayed if metrics is not None else None,
                cache_scope=scope,
            )
        except BaseException:  # its slot and its tuning ticket are not kept by a failure
            self.admission.leave(rid)
            self.tuning.finish(tuned, None)
            raise
        if metrics is not None:
            driver.on_step_cpu = metrics.step_cpu.observe
            driver.on_opened = metrics.opened
            metrics.started(len(plan.prompt))
        self.drivers[rid] = driver
        self.admission.apply_widths()
        log.debug(  # request ids are capabilities: never above DEBUG
            "%s: %s, %d prompt tokens, %d new%s",
            rid,
            plan.mode,
            len(plan.prompt),
            plan.opts.max_new_tokens,
            f", auto: {tuned.decision.setting.label()}" if tuned and tuned.decision else "",
        )
        return driver

    def _started(self, driver: RequestDriver, prompt_tokens: int) -> gen.GenerateResponse:
        path = driver.path
        return gen.GenerateResponse(
            started=gen.Started(
                request_id=driver.request_id,
                model=self.model_id_override or path.stages[0].desc.model_id,
                prompt_tokens=prompt_tokens,
                weight_hash=path.version,
            )
        )

    def _delta(
        self, driver: RequestDriver, stream, tokens: list[int], index: int, plan: Plan
    ) -> gen.GenerateResponse:
        """Tokens `index`.. of the output, detokenized incrementally, with their logprobs
        (the first also with the prompt's, when asked for)."""
        if self.metrics is not None:
            self.metrics.tokens(driver, len(tokens))
        text = "".join(stream.push(t) for t in tokens) if stream else ""
        delta = gen.TokenDelta(token_ids=tokens, text=text, index=index)
        delta.logprobs.extend(logprobs_to_proto(driver.logprobs_of(index, tokens)))
        if index == len(plan.resume) and plan.opts.prompt_logprobs is not None:
            delta.prompt_token_ids.extend(plan.prompt)
            delta.prompt_logprobs.extend(
                logprobs_to_proto(driver.controller.out.prompt_logprobs or ())
            )
        return gen.GenerateResponse(delta=delta)

    def _end(self, driver: RequestDriver, tuned: Tuned | None, failed: bool) -> None:
        """The request no longer runs: admit the next, report it, release its path (in
        the background: the client may have gone already)."""
        rid = driver.request_id
        self.drivers.pop(rid, None)
        self.admission.leave(rid)
        self.tuning.finish(tuned, None if failed else driver.stats, driver.timing()[1])
        if self.metrics is not None:
            self.metrics.finished(driver, failed)
        task = asyncio.ensure_future(driver.release())
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    def check_room(self, caller: Caller | None, n: int) -> None:
        """RESOURCE_EXHAUSTED unless `caller` may hold `n` more requests now (the `n`
        choices of one HTTP request: all of them count, up front; one is admitted as
        any request is)."""
        self._refuse_while_draining()
        if n > 1:
            self.admission.check_room((caller or self.api_keys.caller(None)).tenant, n)

    def _finished(self, driver: RequestDriver, stream, prompt_tokens: int) -> gen.Finished:
        st = driver.stats
        return gen.Finished(
            finish_reason=driver.finish_reason,
            usage=gen.Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=st.resumed_tokens + st.new_tokens,
                cached_tokens=driver.cached_tokens,
            ),
            stats=stats_to_proto(st, *driver.timing()),
            text=stream.flush() if stream else "",
            resumed_tokens=st.resumed_tokens,
        )


def split_at_min_tokens(tokens: list[int], index: int, min_tokens: int) -> list[list[int]]:
    """The deltas of `tokens` (output positions `index`..): one, or two where the output
    reaches `min_tokens` tokens, so that a stop string, honoured from there on
    (text_run.StopMatcher), is searched only in the text of the tokens after."""
    cut = min_tokens - 1 - index
    return [tokens[:cut], tokens[cut:]] if 0 < cut < len(tokens) else [tokens]


def data_plane(config: RouterConfig, inbox: Inbox, security: Security | None) -> Transport:
    """The router's data-plane endpoint: the last stages' verifications arrive in
    `inbox`, admitted per request, authenticated with --secure's frame keys."""
    return make_transport(
        config.transport or TCP,
        inbox,
        bind_host=config.host,
        advertise_host=config.advertise_host,
        admit=inbox.admit,
        auth=security.frame_auth() if security else None,
    )
