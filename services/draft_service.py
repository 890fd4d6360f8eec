"""The Draft service: a `DraftRuntime` behind gRPC.

The router calls it in order for each request (it awaits each call of a request before
the next), so the service adds no ordering of its own: it runs each call's forward on
its compute thread and answers. `Propose` calls and prefill chunks (of `Open` and
`Prefill`) of different requests that wait while a forward runs are answered together
by the next batched forward, which the compute thread takes straight from the inbox
(`DraftRounds`, draft_rounds.py; `DraftRuntime.step_many`, SpecPipe-DB: a prompt that
arrives beside running requests takes no forward of its own, which would make their
answers a forward late); a forward that would miss requests whose
next call is due within a few milliseconds waits for them first, a bounded window
(`StepAligner`, common/runtime/alignment.py; `--batch-wait-ms`). Without it the calls of
one pipeline step, which reach the draft spread over the router's handling of the
step, take two forwards, and the answers of the second come a draft forward late. The
router sends its calls on one control stream (`Control`; services/router/
control_stream.py), or as control frames to the draft's data plane (a `DraftControl` in
a PAYLOAD_KIND_CONTROL frame, transport/control_frames.py, answered by CONTROL_REPLY
frames to the router's address, one of `--peers`, which the compute thread sends itself
where it can (`_answer_now`; in no promised order: the router matches them by call_id),
while the stream stays open so that a lost draft still breaks it), each run as its unary
handler runs it (`Open`'s prefix lookup, `Prune` and `Release` on the replica's executor
thread, beside a batch that computes: the runtime's locks keep them apart, as a
stage's). The lifecycle (server, drain, leases, `Renew`, most of `Describe`) is the
`Replica`'s.

One module: the unary handlers, the control stream and the control frames take calls
into the same state (the batch's asks, the leases) under the same checks, and refuse
them the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from specpipe.common.model.loading import weight_fingerprint
from specpipe.common.perf.clock import device_timer
from specpipe.common.perf.emulate import Pacer, paced
from specpipe.common.runtime.alignment import StepAligner
from specpipe.common.runtime.draft import Proposal
from specpipe.common.runtime.errors import InvalidInput, Overloaded, RequestError
from specpipe.common.runtime.lease import DEFAULT_LEASE_SECONDS
from specpipe.common.runtime.loader import load_draft, parse_dtype
from specpipe.common.runtime.validation import (
    Limits,
    check_capacity,
    check_rows,
    check_span,
    check_token_ids,
    check_tokens,
)
from specpipe.common.spec.growth import chunk_spans
from specpipe.common.spec.messages import Activation, Candidates, Prune
from specpipe.common.spec.options import DEFAULT_PREFILL_CHUNK
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, draft_pb2_grpc

from .control import (
    FrameError,
    cache_scope_from_proto,
    max_control_bytes,
    prune_from_proto,
    token_activation,
)
from .draft_rounds import DraftRounds
from .metrics import DraftMetrics
from .peers import Peers
from .prefill_slices import prefill_cells
from .ratelog import RateLimitedLog
from .replica import Replica
from .security import Security
from .status import status_code
from .transport import TCP, Frame, Transport, control_frames, make_transport
from .transport.background_sends import BackgroundSends

log = logging.getLogger(__name__)
rlog = RateLimitedLog(log)
SERVICE_NAME = "specpipe.v1.Draft"
DRAFT_FRACTION = 0.25  # of the draft's recent forward: the automatic batch wait
# Propose calls of one request waiting at once: its router awaits each before the next
# (a replay's new path has another id), so more is a client flooding the queue.
MAX_ASKS_PER_REQUEST = 2
MAX_HOPS_REMEMBERED = 64  # reply addresses that passed the peer check, kept


Answer = Callable[[draft_pb2.DraftAnswer], None]  # where a control call's answer goes


@dataclass
class _Reply:
    """Where a control frame's Propose is answered: in a reply frame to the frame's
    sender (`request`: its token and address), by its call id; `answer` gives it from
    the event loop (`_FrameAnswers`), where the compute thread did not send it itself."""

    request: pb.FrameHeader
    call_id: int
    answer: Answer

    @property
    def key(self) -> tuple[str, str]:
        """The reply frame it goes in: one per sender's token and address."""
        return self.request.request_id, self.request.reply_to


@dataclass
class _Ask:
    """One request's work waiting for the next batched forward: a Propose call (its
    prunes first), or a prefill chunk (committed tokens; answered None once cached).
    A control frame's Propose (`reply`) has no future: its answer is a reply frame."""

    prunes: list[Prune]
    work: Proposal | Activation
    answer: asyncio.Future | None = None  # made on the event loop unless `reply` is given
    arrived: float = field(default_factory=time.monotonic)
    # a control call's: told of its answer where the answer is given (no done callback:
    # no turn of the event loop between a batch's results and their reply)
    told: Callable[[asyncio.Future], None] | None = None
    reply: _Reply | None = None

    def __post_init__(self) -> None:
        if self.answer is None and self.reply is None:
            self.answer = asyncio.get_running_loop().create_future()

    @property
    def rows(self) -> Activation:
        return self.work.layer if isinstance(self.work, Proposal) else self.work

    @property
    def request_id(self) -> str:
        return self.rows.request_id

    @property
    def is_proposal(self) -> bool:
        return isinstance(self.work, Proposal)

    def gone(self) -> bool:
        """Answered already: its caller went away."""
        return self.answer is not None and self.answer.done()

    def settle(self, result: object) -> None:
        """On the event loop: its answer (a result, or the exception that fails it),
        unless its caller went away; a control call's is passed on at once."""
        if self.reply is not None:
            self.reply.answer(_answer_for(self.reply.call_id, result))
            return
        assert self.answer is not None
        if self.answer.done():
            return
        if isinstance(result, BaseException):
            self.answer.set_exception(result)
        else:
            self.answer.set_result(result)
        if self.told is not None:
            self.told(self.answer)


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _CallContext:
    """The context of one call on the control stream: its refusal (`abort`, as a unary
    handler's) ends the handler with `_Refused`, answered by its call id."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Refused(code, details)


def _proposal(cand: Candidates) -> draft_pb2.ProposeResponse:
    return draft_pb2.ProposeResponse(
        parent_ids=cand.parent_ids.tolist(),
        token_ids=cand.tokens.tolist(),
        probs=cand.probs.tolist(),
    )


def _refused(call_id: int, code: grpc.StatusCode, message: str) -> draft_pb2.DraftAnswer:
    return draft_pb2.DraftAnswer(call_id=call_id, code=code.value[0], message=message)


def _answer_of(call_id: int, answer: asyncio.Future) -> draft_pb2.DraftAnswer:
    """A proposal's answer on the control stream: the candidates, or its refusal."""
    e = answer.exception()
    return _answer_for(call_id, answer.result() if e is None else e)


def _answer_for(call_id: int, result: object) -> draft_pb2.DraftAnswer:
    """A proposal's answer from its result (candidates, or the exception that failed
    it); one that cannot be made (a bug) is logged and answers INTERNAL."""
    try:
        if not isinstance(result, BaseException):
            return draft_pb2.DraftAnswer(call_id=call_id, proposal=_proposal(result))
        if isinstance(result, (RequestError, ValueError)):
            return _refused(call_id, status_code(result), f"draft: {result}")
        return _refused(call_id, grpc.StatusCode.INTERNAL, f"draft failed: {result!r}")
    except Exception as e:
        rlog.error("compute", "draft: answering a call failed: %s: %s", type(e).__name__, e)
        log.debug("the answer failed", exc_info=True)
        return _refused(call_id, grpc.StatusCode.INTERNAL, f"draft failed: {e!r}")


def _answer_when_done(
    pending: set[asyncio.Future],
    answer: Answer,
    answer_of: Callable[[asyncio.Future], draft_pb2.DraftAnswer],
    call_id: int,
    done: asyncio.Future,
) -> None:
    """A control call's work ended: its answer (none if cancelled: its channel ended).
    Called where a batch's results are delivered: a failure making or giving one answer
    (a bug) is logged and answers that call INTERNAL, the batch's other calls answered."""
    pending.discard(done)
    if done.cancelled():
        return
    try:
        reply = answer_of(done)
    except Exception as e:
        rlog.error("compute", "draft: answering a call failed: %s: %s", type(e).__name__, e)
        log.debug("the answer failed", exc_info=True)
        reply = _refused(call_id, grpc.StatusCode.INTERNAL, f"draft failed: {e!r}")
    try:
        answer(reply)
    except Exception:
        log.exception("draft: an answer could not be given")


class _FrameAnswers:
    """The answers to control frames: one reply frame per sender (its stream's token and
    address) and turn of the event loop, as the Control stream sends one message."""

    def __init__(self, sends: BackgroundSends) -> None:
        self.sends = sends
        self._waiting: dict[tuple[str, str], tuple[pb.FrameHeader, list]] = {}

    def to(self, request: pb.FrameHeader) -> Answer:
        """Where the answers to the calls of control frame `request` go."""
        key = (request.request_id, request.reply_to)

        def answer(a: draft_pb2.DraftAnswer) -> None:
            if not self._waiting:
                asyncio.get_running_loop().call_soon(self._flush)
            self._waiting.setdefault(key, (request, []))[1].append(a)

        return answer

    def _flush(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for request, answers in waiting.values():
            reply = draft_pb2.DraftControlReply(answers=answers)
            control_frames.answer(self.sends, request, reply, "draft")


class DraftService(Replica, draft_pb2_grpc.DraftServicer):
    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "float32",
        model_id: str = "",
        device: str = "cpu",
        max_cache_bytes: int | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        security: Security | None = None,
        pacer: Pacer | None = None,
        batch_wait: float | None = None,
        max_step_rows: int | None = None,
        transport_kind: str | None = TCP,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        peers: Sequence[str] = (),
    ) -> None:
        """`security`: mutual TLS on gRPC and authenticated frames (--secure); `pacer`:
        every forward paced to a cost model (--emulate-costs); `batch_wait`: how long a
        forward may wait for Propose calls of the same step, in seconds (None:
        automatic; 0: never); `max_step_rows`: the most rows one call (a prefill chunk,
        a tree layer) may carry (None: from the measured cost curve, `step_row_cap`);
        `transport_kind`, `bind_host`, `advertise_host`: the data plane that takes
        control frames (kind None: none, the router's calls ride the stream); `peers`:
        the only hosts a control frame's answer may go to (as a stage's, `Peers`; empty:
        loopback only)."""
        self.runtime = load_draft(model_dir, parse_dtype(dtype), device, max_cache_bytes)
        self._model_limits = Limits.of(self.runtime.runtime.model)
        super().__init__(
            SERVICE_NAME, "draft", lease_seconds, security, max_step_rows, self._model_limits
        )
        self.pacer = pacer
        self.cost_curve = None  # perf.cost_model.CostCurve, with --measure-costs
        # Every open request asks once per step, at irregular times (answers it grows
        # on at once, or holds until a verification): the requests of the last batch
        # are expected, and a quarter of a forward is the most that waiting may cost.
        self.aligner = StepAligner(batch_wait, fraction=DRAFT_FRACTION, expect_recent=True)
        self.model_id = model_id or Path(model_dir).name
        self.weight_hash = weight_fingerprint(model_dir)
        # proposals and prefill chunks waiting, and the thread that computes them
        self.rounds: DraftRounds[_Ask] = DraftRounds(
            self.aligner, self._compute_batch, self._answer_now
        )
        draft_pb2_grpc.add_DraftServicer_to_server(self, self.server.server)
        self.peers = Peers.parse(peers)
        self._hops_passed: set[str] = set()  # reply addresses `_check_hop` passed
        self.transport: Transport | None = None
        self._frame_answers: _FrameAnswers | None = None
        if transport_kind is not None:
            self.transport = make_transport(
                transport_kind,
                self._on_frame,
                bind_host=bind_host,
                advertise_host=advertise_host,
                device=str(self.device),
                admit=self._admit,
                auth=security.frame_auth() if security else None,
            )
            self._frame_answers = _FrameAnswers(BackgroundSends(self.transport))
        self._frame_calls: set[asyncio.Future] = set()  # control frames' calls at work
        self.metrics = DraftMetrics()  # served by serve.py with --metrics-port
        self.metrics.watch_dataplane(self.transport)
        stage = self.runtime.runtime
        self.metrics.watch(
            self._queued_rows,
            lambda: stage.cache_bytes_used / stage.max_cache_bytes if stage.max_cache_bytes else 0,
            lambda: stage.info().active_requests,
        )

    def _queued_rows(self) -> int:
        """Rows waiting for the next batched forward (read when scraped, from another
        thread: a copy of the list)."""
        return sum(len(a.rows) for a in list(self.rounds.waiting))

    # -- process lifecycle (the rest is the Replica's) -------------------------------------
    async def start(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        data_port: int = 0,
        health_port: int | None = None,
    ) -> int:
        """Serve the data plane, if any (control frames, none larger than the largest
        control message), and gRPC; returns the gRPC port."""
        if self.transport is not None:
            await self.transport.start(data_port)
            self.transport.max_payload_bytes = max_control_bytes(self.limits)
        return await super().start(host, port, health_port)

    async def stop(self) -> None:
        await super().stop()
        for call in list(self._frame_calls):
            call.cancel()
        if self.transport is not None:
            await self.transport.close()

    # -- what the Replica asks of it -------------------------------------------------------
    @property
    def name(self) -> str:
        return "draft"

    @property
    def model_limits(self) -> Limits:
        return self._model_limits

    @property
    def device(self) -> torch.device:
        """Where the model is (the runtime's, read once: the model's own property walks
        its parameters, tens of microseconds a read)."""
        return self.runtime.runtime.device

    def _compute_forever(self):
        return self.rounds.run_forever(self._deliver)

    def _open_requests(self) -> int:
        return self.runtime.runtime.info().active_requests

    async def _release(self, rid: str) -> None:
        self._forget(rid)
        await asyncio.get_running_loop().run_in_executor(self._executor, self.runtime.release, rid)

    def _fail_held(self) -> None:
        """The batch loop ended: fail the waiting Propose calls."""
        for ask in self.rounds.take_all():
            ask.settle(RequestError("the draft's batch loop ended"))

    def _describe(self) -> draft_pb2.DraftDescription:
        desc = draft_pb2.DraftDescription()
        if self.transport is not None:
            desc.control_frames, desc.data_address = True, self.transport.address
        self._describe_model(desc, self.runtime.runtime.info(), self.model_id, self.weight_hash)
        return desc

    # -- calls -----------------------------------------------------------------------------
    async def _call(self, context, fn, *args):
        """Run an engine call (open, prune, release: no forward) on the replica's executor;
        engine errors become gRPC statuses, anything else INTERNAL with one (rate-limited)
        log line."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except (RequestError, FrameError, ValueError) as e:
            await context.abort(status_code(e), f"draft: {e}")
        except Exception as e:
            rlog.error("compute", "draft: %s failed: %s: %s", fn.__name__, type(e).__name__, e)
            await context.abort(grpc.StatusCode.INTERNAL, f"draft failed: {type(e).__name__}: {e}")

    async def _check(self, context, check, *args) -> None:
        """A validation of the request's input; InvalidInput becomes INVALID_ARGUMENT."""
        try:
            check(*args)
        except (InvalidInput, FrameError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"draft: {e}")

    async def _check_chunk(self, context, chunk: int) -> None:
        """A prefill chunk the caller chose: at most `max_step_rows`."""
        if chunk > self.max_step_rows:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"draft: prefill chunk {chunk} is above the {self.max_step_rows} rows one "
                "step may take here",
            )

    async def _prefill(self, context, rid: str, tokens: torch.Tensor, start: int, chunk: int):
        """Cache verified tokens one chunk per batched forward, beside the proposals of
        the running requests (one forward, not one of its own: a prompt that arrives
        mid-step must not make their answers late) and other prompts' chunks."""
        chunk = min(chunk or DEFAULT_PREFILL_CHUNK, self.max_step_rows)
        engine = self.runtime.runtime
        s, stop = start, start + tokens.numel()
        while s < stop:
            # rows x keys per chunk, as a stage's, decided chunk by chunk: beside other
            # requests, about what a batch of their proposals costs (`PrefillPace`);
            # alone, the memory bound
            alone = len(self.leases) <= 1 and not engine.prefill_pace.decoding()
            cells = engine.step_budget.prefill_cells if alone else engine.prefill_pace.cells
            _, e = chunk_spans(s, stop, chunk, cells)[0]
            part = tokens[s - start : e - start]
            positions = torch.arange(s, e)
            act = Activation(request_id=rid, positions=positions, committed=True, tokens=part)
            ask = _Ask([], act)
            if (refused := self._queue(ask)) is not None:
                await context.abort(*refused)
            try:
                await ask.answer
            except (RequestError, FrameError, ValueError) as e:
                await context.abort(status_code(e), f"draft: {e}")
            s = e

    async def Open(self, request, context) -> draft_pb2.OpenDraftResponse:
        await self._refuse_if_draining(context)
        rid = request.request_id
        if not rid or request.capacity <= 0 or not request.prompt_ids:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "request_id, capacity and prompt_ids are required"
            )
        n = len(request.prompt_ids)  # checked before anything is built from it
        await self._check_chunk(context, request.prefill_chunk)
        await self._check(context, check_capacity, int(request.capacity), self.limits)
        await self._check(context, check_span, 0, n, self.limits)
        if n > request.capacity:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"draft: a prompt of {n} tokens needs a capacity above {request.capacity}",
            )
        prompt = torch.tensor(request.prompt_ids, dtype=torch.int64)
        await self._check(
            context, check_token_ids, prompt, self.runtime.vocab_size, "prompt ids (draft)"
        )
        try:
            scope = cache_scope_from_proto(request.cache_scope)
        except InvalidInput as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"draft: {e}")
        if rid in self.leases:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"draft: request {rid!r} is already open"
            )
        try:
            claim = self._claim(
                request.lease_owner, request.lease_epoch, request.lease_token, context
            )
            stale = self.leases.grant(rid, claim)
        except RequestError as e:
            await context.abort(status_code(e), f"draft: {e}")
        await self._free_stale(stale)
        opened = False
        body = prompt[:-1]  # the first root is not prefilled
        try:
            cached = await self._call(
                context, self.runtime.open, rid, int(request.capacity), body.numpy(), scope
            )
            opened = True
            self.metrics.requests.inc()
        finally:
            if not opened:
                self.leases.end(rid)
        if self.runtime.runtime.prefix_caching:
            self.metrics.prefix_cache_queried(body.numel(), cached)
        if body.numel() > cached:
            await self._prefill(context, rid, body[cached:], cached, request.prefill_chunk)
        return draft_pb2.OpenDraftResponse(cached_tokens=cached)

    async def Prefill(self, request, context) -> draft_pb2.PrefillDraftResponse:
        self.leases.renew(request.request_id)
        n = len(request.token_ids)
        await self._check_chunk(context, request.prefill_chunk)
        await self._check(context, check_span, request.start_position, n, self.limits)
        tokens = torch.tensor(request.token_ids, dtype=torch.int64)
        await self._check(context, check_token_ids, tokens, self.runtime.vocab_size)
        if tokens.numel():
            await self._prefill(
                context, request.request_id, tokens, request.start_position, request.prefill_chunk
            )
        return draft_pb2.PrefillDraftResponse()

    async def Propose(self, request, context) -> draft_pb2.ProposeResponse:
        ask = self._take_propose(request)
        if not isinstance(ask, _Ask):
            await context.abort(*ask)
        try:
            cand = await ask.answer
        except (RequestError, ValueError) as e:
            await context.abort(status_code(e), f"draft: {e}")
        return _proposal(cand)

    def _take_propose(
        self, request, reply: _Reply | None = None
    ) -> _Ask | tuple[grpc.StatusCode, str]:
        """Queue one Propose for the next batched forward (`reply`: a control frame's);
        what refuses it (status and message) if not taken."""
        rid = request.request_id
        if not self.leases.renew(rid):
            return grpc.StatusCode.NOT_FOUND, f"draft: request {rid!r} is not open"
        try:
            limits = self.limits  # built once per call: the row cap reads the cost curve
            layer = token_activation(rid, request.rows, request.token_ids, limits.max_rows)
            check_rows(layer, limits)
            check_tokens(layer, limits)
            with self.rounds.inbox:
                waiting = sum(a.request_id == rid and a.is_proposal for a in self.rounds.waiting)
            if waiting >= MAX_ASKS_PER_REQUEST:
                raise Overloaded(
                    f"{waiting} Propose calls of this request wait already; at most "
                    f"{MAX_ASKS_PER_REQUEST} may (send each after the last one's answer)"
                )
        except (FrameError, RequestError) as e:
            return status_code(e), f"draft: {e}"
        prunes = [prune_from_proto(sig) for sig in request.prunes]
        proposal = Proposal(layer, int(request.top_k), float(request.temperature))
        ask = _Ask(prunes, proposal, reply=reply)
        if (refused := self._queue(ask)) is not None:
            return refused
        return ask

    def _queue(self, ask: _Ask) -> tuple[grpc.StatusCode, str] | None:
        """`ask` into the next batched forward (a proposal's arrival told to the aligner
        first); what refuses it if no forward will come."""
        if self._loop_task is None or self._loop_task.done():
            return grpc.StatusCode.UNAVAILABLE, "draft: not computing (see its log)"
        with self.rounds.inbox:
            if ask.is_proposal:
                self.aligner.arrived(ask.request_id)
            self.rounds.add(ask)
        return None

    def _forget(self, rid: str) -> None:
        with self.rounds.inbox:
            self.aligner.forget(rid)

    def _compute_batch(self, asks: list[_Ask]) -> list[Candidates | Exception | None]:
        """On the compute thread: one batched forward for `asks` (paced, timed), its time
        learned (aligner, prefill pace) and its metrics updated once; a forward that
        failed fails each of them."""
        engine, m = self.runtime.runtime, self.metrics
        decode = cells = chunk_rows = 0
        first_ask = None  # the earliest proposal's arrival: the batch's longest wait
        for a in asks:
            n = len(a.rows)
            if a.is_proposal:
                decode += n
                first_ask = a.arrived if first_ask is None else min(first_ask, a.arrived)
            else:
                chunk_rows += n
                cells += prefill_cells(a.rows)
        rows = decode + chunk_rows
        m.batch_requests.observe(len(asks))
        if first_ask is not None:
            m.queue_seconds.observe(time.monotonic() - first_ask)
        try:
            pacing = paced(self.pacer if rows else None, [a.rows for a in asks], self.device)
            counted = m.forward(rows) if rows else contextlib.nullcontext()
            with counted, device_timer(self.device) as elapsed, pacing:
                results = self._propose(asks)
            with self.rounds.inbox:
                self.aligner.computed(elapsed.seconds)
            engine.prefill_pace.observe(decode, cells, elapsed.seconds)
        except Exception as e:  # the batched forward itself failed
            log.exception("draft: a batched forward of %d requests failed", len(asks))
            return [RequestError(f"the draft's forward failed: {e}")] * len(asks)
        return results

    @staticmethod
    def _deliver(asks: list[_Ask], results) -> None:
        """On the event loop: each ask's answer (or error), unless its caller went away."""
        for ask, result in zip(asks, results, strict=True):
            ask.settle(result)

    def _answer_now(self, asks: list[_Ask], results: list) -> tuple[list[_Ask], list]:
        """On the compute thread, no batch of its waiting for the loop: the control
        frames' proposals answered from here, one reply frame per sender as
        `_FrameAnswers` makes them, where the transport sends it in order at once
        (`Transport.send_now`; issue 34 point 4: no wake of the event loop, no turn, no
        write of its). The rest, and a sender's answers not sent (no connection yet, a
        send of the loop's under way, a send that failed), are left for the loop, which
        answers them as before."""
        transport, left, left_results = self.transport, [], []
        replies: dict[tuple[str, str], list[tuple[_Ask, object]]] = {}
        for ask, result in zip(asks, results, strict=True):
            if ask.reply is None or transport is None:
                left.append(ask)
                left_results.append(result)
            else:
                replies.setdefault(ask.reply.key, []).append((ask, result))
        for group in replies.values():
            request = group[0][0].reply.request  # type: ignore[union-attr]
            answers = [_answer_for(a.reply.call_id, r) for a, r in group]  # type: ignore[union-attr]
            frame = control_frames.reply_frame(
                request, draft_pb2.DraftControlReply(answers=answers), "draft"
            )
            try:
                sent = transport.send_now(request.reply_to, [frame], "draft")  # type: ignore[union-attr]
            except Exception:  # a bug: the loop answers them
                log.exception("draft: sending answers from the compute thread failed")
                sent = False
            if not sent:
                left += [a for a, _ in group]
                left_results += [r for _, r in group]
        return left, left_results

    def _propose(self, asks: list[_Ask]) -> list[Candidates | RequestError | None]:
        """Each request's prunes (all of the batch's in one pass), then one forward for
        the requests whose prunes held."""
        results: list[Candidates | RequestError | None] = [None] * len(asks)
        prunes = [(i, p) for i, ask in enumerate(asks) for p in ask.prunes]
        if prunes:
            done = self.runtime.prune_many([(asks[i].request_id, p) for i, p in prunes])
            for (i, _), error in zip(prunes, done, strict=True):
                results[i] = results[i] or error
        todo = [i for i in range(len(asks)) if results[i] is None]
        for i, r in zip(todo, self.runtime.step_many([asks[i].work for i in todo]), strict=True):
            results[i] = r
        return results

    async def Prune(self, request, context) -> pb.PruneResponse:
        self.leases.renew(request.request_id)
        await self._call(
            context, self.runtime.prune, request.request_id, prune_from_proto(request.prune)
        )
        return pb.PruneResponse()

    async def Control(self, request_iterator, context):
        """A router's control stream (services/router/control_stream.py): its calls taken
        as `_take_calls` takes them; the answers ready in one turn of the event loop
        leave as one message."""
        answers: list[draft_pb2.DraftAnswer] = []
        ready = asyncio.Event()
        pending: set[asyncio.Future] = set()  # calls at work (cancelled if it ends)

        def answer(a: draft_pb2.DraftAnswer) -> None:
            answers.append(a)
            ready.set()

        async def read() -> None:
            async for msg in request_iterator:
                self._take_calls(msg, answer, pending)

        reader = asyncio.ensure_future(read())
        reader.add_done_callback(lambda _: ready.set())
        try:
            while not reader.done() or answers:
                await ready.wait()
                ready.clear()
                if answers:
                    out, answers = draft_pb2.DraftControlReply(answers=answers), []
                    yield out
            reader.result()  # a broken stream ends the call with its error
        finally:
            reader.cancel()
            for call in list(pending):
                call.cancel()

    def _take_calls(
        self,
        msg: draft_pb2.DraftControl,
        answer: Answer,
        pending: set[asyncio.Future],
        frame: pb.FrameHeader | None = None,
    ) -> None:
        """A router's control message (on the stream, or in control frame `frame`): a
        Propose joins the next batched forward at once and is answered from its result
        (a frame's by the compute thread itself where it can, `_answer_now`); the other
        calls run as their unary handlers run them. Each answer, by its call id, goes to
        `answer`; `pending` holds the calls at work."""
        for call in msg.calls:
            if call.WhichOneof("call") == "propose":  # no task: answered where delivered
                reply = None if frame is None else _Reply(frame, call.call_id, answer)
                try:
                    ask = self._take_propose(call.propose, reply)
                except Exception as e:  # answered, as a unary handler's crash would be
                    rlog.error("compute", "draft: a propose failed: %s: %s", type(e).__name__, e)
                    answer(_refused(call.call_id, grpc.StatusCode.INTERNAL, f"draft failed: {e!r}"))
                    continue
                if not isinstance(ask, _Ask):
                    answer(_refused(call.call_id, *ask))
                    continue
                if reply is not None:
                    continue
                assert ask.answer is not None
                answer_of = functools.partial(_answer_of, call.call_id)
                pending.add(ask.answer)  # cancelled, it is answered no more: it is skipped
                ask.told = functools.partial(
                    _answer_when_done, pending, answer, answer_of, call.call_id
                )
                continue
            work = asyncio.ensure_future(self._control_call(call))
            pending.add(work)
            work.add_done_callback(
                functools.partial(
                    _answer_when_done, pending, answer, asyncio.Future.result, call.call_id
                )
            )

    # -- control frames (data plane) -------------------------------------------------------
    def _admit(self, h: pb.FrameHeader) -> bool:
        """Only control frames are read here, up to the largest control message."""
        return h.kind == control_frames.CONTROL and control_frames.admitted(
            h, max_control_bytes(self.limits)
        )

    def _on_frame(self, frame: Frame) -> None:
        """A router's calls as a control frame: taken as on the stream; their answers go
        back as reply frames to its address (one of this draft's peers)."""
        if frame.kind != control_frames.CONTROL or self._frame_answers is None:
            return
        msg = control_frames.read_control(frame, draft_pb2.DraftControl, self._check_hop, "draft")
        if msg is not None:
            answer = self._frame_answers.to(frame.header)
            self._take_calls(msg, answer, self._frame_calls, frame.header)  # type: ignore[arg-type]

    def _check_hop(self, address: str) -> None:
        """A control frame's reply address is one of the peers (checked once per address,
        about 4 us of parsing each: a router sends every frame with the same one)."""
        assert self.transport is not None
        if address in self._hops_passed:
            return
        self.peers.check_hop(address, self.transport.scheme, "this draft")
        if len(self._hops_passed) >= MAX_HOPS_REMEMBERED:
            self._hops_passed.clear()
        self._hops_passed.add(address)

    async def _control_call(self, call: draft_pb2.DraftCall) -> draft_pb2.DraftAnswer:
        ctx, kind = _CallContext(), call.WhichOneof("call")
        try:
            if kind == "prefill":
                await self.Prefill(call.prefill, ctx)
            elif kind == "prune":
                await self.Prune(call.prune, ctx)
            elif kind == "release":
                await self.Release(call.release, ctx)
            else:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "draft: a call of no kind")
        except _Refused as e:
            return _refused(call.call_id, e.code, e.details)
        except Exception as e:  # answered, as a unary handler's crash would be
            rlog.error("compute", "draft: a %s call failed: %s: %s", kind, type(e).__name__, e)
            return _refused(call.call_id, grpc.StatusCode.INTERNAL, f"draft failed: {e!r}")
        return draft_pb2.DraftAnswer(call_id=call.call_id)

    async def Release(self, request, context) -> pb.ReleaseResponse:
        self.leases.end(request.request_id)
        self._forget(request.request_id)
        released = await asyncio.get_running_loop().run_in_executor(
            self._executor, self.runtime.release, request.request_id
        )
        return pb.ReleaseResponse(released=released)
