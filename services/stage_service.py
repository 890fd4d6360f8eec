"""The Stage service: a `StageRuntime` behind gRPC (control) and a transport (data).

Per request the stage keeps a `RequestOrder` (common/runtime/ordering.py): activations
wait there until it is their turn and the prunes they were created after are applied;
prunes are applied in their own order as soon as they arrive. Work comes in as `Feed`
calls (the first stage) and data-plane frames (the others), checked before it is
queued (`common/runtime/validation.py`; the values of hidden states on the compute
thread); one compute loop serves every request, in rounds (`compute_round.py`). Tree
rows carry their token ids on (`Rows.token_ids`). The last stage verifies every request
(`common/runtime/verifier.py`: it draws the tokens and walks down the tree, as the
`VerifySpec` of its Open says; an Open without one is refused) and sends the router a
small `Verification`. Requests join and leave between rounds; a request that fails
fails alone, and its router hears why (`fail`). The lifecycle (server, drain, leases,
`Renew`) is the `Replica`'s; everything else is the runtime's `StageRuntime`.

One module: the gRPC handlers and the data-plane admission take work into the same
per-request state (`StageRequest`) under the same checks, and fail a request the same
way (`fail`); the compute rounds, which only compute and send, are a module of their own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import grpc
import torch
from specpipe.common.perf.cost_model import CostCurve
from specpipe.common.perf.emulate import Pacer
from specpipe.common.runtime.alignment import StepAligner
from specpipe.common.runtime.errors import AlreadyOpen, BadInput, InvalidInput, RequestError
from specpipe.common.runtime.lease import DEFAULT_LEASE_SECONDS
from specpipe.common.runtime.loader import LoadedModel, load_model
from specpipe.common.runtime.ordering import Pending
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.runtime.validation import (
    MAX_CALLS_PER_BATCH,
    MAX_ROWS,
    Limits,
    check_capacity,
    check_input,
)
from specpipe.common.runtime.verifier import RequestVerifier
from specpipe.common.spec.grammar import GrammarError, load_grammar_tokenizer
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import stage_pb2, stage_pb2_grpc

from .compute_round import ComputeRounds, StageRequest
from .control import (
    cache_scope_from_proto,
    max_control_bytes,
    prune_from_proto,
    token_activation,
    verify_spec_from_proto,
)
from .metrics import StageMetrics
from .modelinfo import DEFAULT_CACHE_FRACTION, cache_budget, free_memory_bytes
from .peers import Peers
from .ratelog import RateLimitedLog
from .replica import Replica
from .security import Security
from .status import status_code
from .transport import (
    TCP,
    Frame,
    FrameError,
    Transport,
    control_frames,
    decode,
    make_transport,
)
from .transport.background_sends import BackgroundSends
from .transport.codec import Kind, error_header

log = logging.getLogger(__name__)
rlog = RateLimitedLog(log)
SERVICE_NAME = "specpipe.v1.Stage"
# The longest a Describe or an Open waits for the compute thread to apply waiting prunes
# (between two of its rounds: a round is milliseconds; a long prefill's may be more).
PRUNES_WAIT_SECONDS = 0.25
# The longest an Open that finds no free block after the first stage waits for relayed
# prunes still on their way from the stages before it (`StageService._room`).
RELAYED_PRUNES_WAIT_SECONDS = 0.5


async def _check_batch(context, n: int, what: str) -> None:
    if n > MAX_CALLS_PER_BATCH:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{n} {what} in one call; at most {MAX_CALLS_PER_BATCH}",
        )


def _outcomes(items, take) -> list[pb.CallOutcome]:
    """Each item of a batched call taken on its own: OK, or what refused it."""
    outcomes = []
    for item in items:
        refused = take(item)
        code, message = refused if refused is not None else (grpc.StatusCode.OK, "")
        outcomes.append(pb.CallOutcome(code=code.value[0], message=message))
    return outcomes


def _refusal(rid: str, code: grpc.StatusCode, message: str) -> stage_pb2.ControlRefusal:
    return stage_pb2.ControlRefusal(request_id=rid, code=code.value[0], message=message)


class StageService(Replica, stage_pb2_grpc.StageServicer):
    pacer: Pacer | None = None  # --emulate-costs: every forward paced to a cost model

    def __init__(
        self,
        model: LoadedModel | None,
        transport_kind: str = TCP,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        max_cache_bytes: int | None = None,
        device: str | None = None,
        cache_fraction: float = DEFAULT_CACHE_FRACTION,
        metrics: StageMetrics | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        security: Security | None = None,
        allow_configure: bool = False,
        peers: Sequence[str] = (),
        batch_wait: float | None = None,
        max_step_rows: int | None = None,
        pacer: Pacer | None = None,
        batch_invariant: bool | None = None,
    ) -> None:
        """`security`: mutual TLS on gRPC and authenticated frames (--secure); Configure
        (loading other weights) only with `allow_configure`; `peers`: the only hosts and
        networks (CIDR) a request's next hop and report address may name, in every mode
        (empty: loopback only; see `Peers`); `batch_wait`: how long a round may wait for
        requests of the same step, in seconds (None: a share of the recent forwards,
        capped; 0: never; see StepAligner); `max_step_rows`: the most rows one activation
        may carry (None: from the model's measured cost curve, `step_row_cap`);
        `batch_invariant`: of the models Configure loads, as in `load_stage`."""
        self.model = model
        self._limits: tuple[LoadedModel | None, CostCurve | None, Limits] | None = None
        limits = Limits.of(model.runtime.model) if model else None
        super().__init__(SERVICE_NAME, "stage", lease_seconds, security, max_step_rows, limits)
        self.allow_configure = allow_configure
        self.pacer = pacer
        self.peers = Peers.parse(peers)
        self.max_cache_bytes = max_cache_bytes
        self.batch_invariant = batch_invariant
        self.cache_fraction = cache_fraction
        # Where Configure loads models (default: where the given model lives, else cpu).
        self.device = device or (str(model.runtime.model.device) if model else "cpu")
        self._requests: dict[str, StageRequest] = {}
        self._room_wanted: list[asyncio.Future] = []  # Opens waiting for relayed prunes
        self.aligner = StepAligner(batch_wait)  # when a round waits for more requests
        self.rounds = ComputeRounds(self, self._requests)
        self.transport: Transport = make_transport(
            transport_kind,
            self._on_frame,
            bind_host=bind_host,
            advertise_host=advertise_host,
            device=str(model.runtime.model.device) if model else self.device,
            admit=self._admit,
            auth=security.frame_auth() if security else None,
        )
        self.transport.gather = self.rounds.inbox.gathering  # one wake per read
        self._bound_frames()
        self._sends = BackgroundSends(self.transport)
        stage_pb2_grpc.add_StageServicer_to_server(self, self.server.server)
        self.metrics = metrics or StageMetrics()  # served by serve.py with --metrics-port
        self.metrics.watch(self._queued_rows, self._kv_usage, lambda: len(self._requests))
        self.metrics.watch_dataplane(self.transport)

    def _queued_rows(self) -> int:
        """Rows received and not yet computed (read by the metrics thread)."""
        return sum(
            len(p.act)
            for st in list(self._requests.values())
            for p in list(st.order.pending.values())
            if not p.empty
        )

    def _kv_usage(self) -> float:
        if self.model is None or not self.runtime.max_cache_bytes:
            return 0.0
        return self.runtime.cache_bytes_used / self.runtime.max_cache_bytes

    # -- process lifecycle (the rest is the Replica's) -------------------------------------
    async def start(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        data_port: int = 0,
        health_port: int | None = None,
    ) -> int:
        await self.transport.start(data_port)
        port = await super().start(host, port, health_port)
        log.info("%s serving on %s, data plane %s", self.name, port, self.transport.address)
        return port

    async def stop(self) -> None:
        await self._stop_serving()
        for rid in list(self._requests):
            self._drop(rid)
        self._stop_computing()
        await self.transport.close()

    @property
    def ready(self) -> bool:
        return self.model is not None

    def _compute_forever(self):
        return self.rounds.run_forever()

    def _open_requests(self) -> int:
        return len(self._requests)

    def _fail_held(self) -> None:
        """The compute loop ended: fail every open request."""
        for st in list(self._requests.values()):
            if not st.closed:
                self.fail(st, f"{self.name}: its compute loop ended")

    def _release(self, rid: str) -> None:
        self._drop(rid)

    @property
    def name(self) -> str:
        """Made once per model loaded (read several times a round, by every frame)."""
        model = self.model
        if model is None:
            return "stage (no model)"
        named = getattr(self, "_named", None)
        if named is None or named[0] is not model:
            r = model.runtime.model.layer_range
            named = self._named = (model, f"stage layers {r.start}:{r.end}/{r.num_layers}")
        return named[1]

    @property
    def runtime(self) -> StageRuntime:
        assert self.model is not None
        return self.model.runtime

    @property
    def model_limits(self) -> Limits:
        assert self.model is not None
        return Limits.of(self.runtime.model)

    @property
    def limits(self) -> Limits:
        """The replica's limits (`Replica.limits`), built once per model and cost curve:
        every frame and feed reads them, and building them (the model's dtype from its
        parameters, the row cap from its cost curve) cost tens of microseconds each time."""
        model, curve = self.model, self.cost_curve
        cached = self._limits
        if cached is None or cached[0] is not model or cached[1] is not curve:
            cached = self._limits = (model, curve, Replica.limits.fget(self))  # type: ignore[attr-defined]
        return cached[2]

    @property
    def cost_curve(self) -> CostCurve | None:  # type: ignore[override]
        return self.model.cost_curve if self.model is not None else None

    def _pending_bytes(self, capacity: int) -> int:
        """What one request may hold waiting for its turn, as this stage's input (token
        ids and row ids; hidden states after the first): every row it may ever cache,
        twice. Rows wait both for their turn and for the prunes before them, and while
        a verification is held or its prune is on its way the rows already fed keep
        coming, some of which that prune drops: a tree's rows beside the cached ones
        (the request's capacity counts both, so twice it bounds them; once was reached
        at K = 3, S = 3 with a late-draft hold)."""
        lim = self.limits
        ids = 4 * torch.int64.itemsize  # position, token, node and parent id
        hidden = 0 if self.runtime.is_first else lim.row_bytes(lim.hidden_size)
        return 2 * capacity * (ids + hidden)

    # -- RPCs ------------------------------------------------------------------------------
    def _describe(self) -> stage_pb2.StageDescription:
        desc = stage_pb2.StageDescription(
            data_address=self.transport.address,
            ready=self.model is not None,
            control_frames=True,
            relay_prunes=True,
        )
        if self.model is None:
            self._describe_replica(desc)
            desc.free_memory_bytes = free_memory_bytes(self.device)
            return desc
        info = self.runtime.info()
        self._describe_model(desc, info, self.model.model_id, self.model.weight_hash)
        desc.layer_start, desc.layer_end = info.start, info.end
        desc.hidden_size = info.hidden_size
        desc.max_position_embeddings = self.model.max_positions
        desc.eos_token_ids.extend(self.model.eos_token_ids)
        desc.row_budget = self.model.row_budget
        desc.cache_bytes_used, desc.cache_bytes_limit = (
            info.cache_bytes_used,
            info.cache_bytes_limit,
        )
        desc.cache_blocks_used, desc.cache_blocks_free = (
            info.cache_blocks_used,
            info.cache_blocks_free,
        )
        desc.cache_block_rows = info.cache_block_rows
        budget = self.runtime.step_budget
        desc.step_memory_bytes = budget.bytes
        desc.prefill_cells = self.runtime.prefill_pace.cells
        return desc

    async def Describe(self, request, context) -> stage_pb2.StageDescription:
        """The description, its free blocks counted after the prunes waiting here (a
        prune that waits for its request's next round still holds its rows' blocks)."""
        if self.model is not None:
            await self.rounds.apply_prunes(PRUNES_WAIT_SECONDS)
        return self._describe()

    async def Configure(self, request, context) -> stage_pb2.StageDescription:
        if not self.allow_configure:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{self.name}: Configure (loading other weights) is off; start the stage "
                "with --allow-configure to use it",
            )
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is shutting down")
        if self._requests:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{len(self._requests)} requests are open on this stage; configure it when idle",
            )
        layers = (request.layer_start, request.layer_end)
        loop = asyncio.get_running_loop()
        try:
            self.model = await loop.run_in_executor(
                self._executor,
                lambda: load_model(
                    request.model_path,
                    layers,
                    request.dtype or "float32",
                    request.model_id,
                    device=self.device,
                    max_cache_bytes=self.max_cache_bytes,
                    batch_invariant=self.batch_invariant,
                ),
            )
        except (ValueError, OSError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot load the model: {e}")
        self.transport.device = str(self.runtime.model.device)
        self._bound_frames()
        if self.max_cache_bytes is None:
            self.runtime.max_cache_bytes = cache_budget(self.device, self.cache_fraction)
        await self.server.set_serving(True)
        return self._describe()

    async def Open(self, request, context) -> stage_pb2.OpenStageResponse:
        await self._refuse_if_draining(context)
        if self.model is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no model is loaded")
        rid = request.request_id
        if not rid or not request.next_hop:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "request_id and next_hop are required"
            )
        try:
            check_capacity(int(request.capacity), self.limits)
            for hop in (request.next_hop, request.report_to):
                if hop:
                    self._check_hop(hop)
            verify = None  # (awaited first: what follows runs without a pause)
            if self.runtime.is_last:
                if not request.HasField("verify"):
                    raise InvalidInput(
                        "the last stage verifies every request: Open needs a VerifySpec (`verify`)"
                    )
                verify = await self._verify_spec(request.verify)
            if not self.runtime.is_last:  # the later stages open it now too
                self.rounds.relay_waiting_prunes()
            if self.runtime.pool.free_blocks < 1:  # the blocks waiting prunes free first
                await self._room()
            if rid in self._requests:
                raise AlreadyOpen(f"request {rid!r} is already open on this stage")
            claim = self._claim(
                request.lease_owner, request.lease_epoch, request.lease_token, context
            )
            # (never suspends: a stage frees a request at once, so Open stays atomic)
            await self._free_stale(self.leases.grant(rid, claim))
            try:
                cached = self.runtime.open(
                    rid,
                    int(request.capacity),
                    prefix_tokens=request.prefix_token_ids,
                    cache_scope=cache_scope_from_proto(request.cache_scope),
                )
            except RequestError:
                self.leases.end(rid)
                raise
        except RequestError as e:
            await context.abort(status_code(e), f"{self.name}: {e}")
        capacity = int(request.capacity)
        st = StageRequest(rid, request.next_hop, request.report_to, capacity)
        st.report_progress = request.report_progress and bool(request.report_to)
        if verify is not None:
            st.verifier = RequestVerifier(
                rid, verify, self.runtime.model.logits, request.prefix_token_ids
            )
        # Every prefill chunk may be sent at once (one row each at least), then the layers
        # in flight: nothing legitimate is numbered further ahead.
        st.order.window = capacity + 64
        st.order.max_pending_bytes = self._pending_bytes(capacity)
        with self.rounds.inbox:  # the compute thread reads both
            self._requests[rid] = st
            self.aligner.opened(rid, joins=request.fills_pipeline, first=self.runtime.is_first)
        self.metrics.requests.inc()
        if self.runtime.prefix_caching:
            self.metrics.prefix_cache_queried(len(request.prefix_token_ids), cached)
        return stage_pb2.OpenStageResponse(cached_tokens=cached)

    async def _room(self) -> None:
        """Room for an Open that finds no free block: the prunes waiting here applied
        (`apply_prunes`); then, after the first stage and only while it holds requests
        (relayed prunes come only for those: a pool full of nothing else is refused at
        once), relayed prunes still on their way from the stages before (they pass
        theirs on at once when asked to open the same request: `relay_waiting_prunes`)
        waited for and applied as they come, until a block is free or
        RELAYED_PRUNES_WAIT_SECONDS pass (then the Open is refused). Prunes that arrive
        while others are applied are applied next without a wait, and once more at the
        end: a pool that stays full costs an Open at most about 0.8 s."""
        rounds = self.rounds
        await rounds.apply_prunes(PRUNES_WAIT_SECONDS)
        if self.runtime.is_first or not self._requests:
            return  # no prune comes here relayed
        loop = asyncio.get_running_loop()
        until = loop.time() + RELAYED_PRUNES_WAIT_SECONDS
        while self.runtime.pool.free_blocks < 1 and (left := until - loop.time()) > 0:
            with rounds.inbox:
                arrived_already = rounds.prunes_waiting()  # while the last were applied
            if not arrived_already:
                arrived = loop.create_future()
                self._room_wanted.append(arrived)
                try:
                    await asyncio.wait_for(arrived, left)
                except TimeoutError:
                    break
                finally:
                    if arrived in self._room_wanted:
                        self._room_wanted.remove(arrived)
            await rounds.apply_prunes(min(PRUNES_WAIT_SECONDS, max(until - loop.time(), 0.01)))
            await asyncio.sleep(0)  # a turn for the loop where nothing was applied (stopping)
        with rounds.inbox:
            last = self.runtime.pool.free_blocks < 1 and rounds.prunes_waiting()
        if last:  # arrived during the last wait's end: taken without waiting for a round
            await rounds.apply_prunes(0.01)

    async def _verify_spec(self, msg: pb.VerifySpec):
        """A request's verification parameters; with a grammar (structured output), bound
        to the model's tokenizer as the grammar library reads it, both built off the event
        loop (the tokenizer's view once, about a second for a large vocabulary; the
        grammar per request, milliseconds)."""
        if not msg.grammar:
            return verify_spec_from_proto(msg)
        m = self.model
        assert m is not None
        vocab = self.runtime.model.cfg.vocab_size
        loop = asyncio.get_running_loop()
        try:
            tok = await loop.run_in_executor(
                None, load_grammar_tokenizer, m.model_dir, vocab, tuple(m.eos_token_ids)
            )
        except GrammarError as e:
            raise BadInput(str(e)) from None
        return await loop.run_in_executor(None, verify_spec_from_proto, msg, tok)

    async def Feed(self, request, context) -> stage_pb2.FeedResponse:
        await self._check_first(context)
        self.metrics.feeds_per_call.observe(1)
        refused = self._take_feed(request)
        if refused is not None:
            await context.abort(*refused)
        return stage_pb2.FeedResponse()

    async def FeedMany(self, request, context) -> stage_pb2.FeedManyResponse:
        await self._check_first(context)
        await _check_batch(context, len(request.feeds), "feeds")
        self.metrics.feeds_per_call.observe(len(request.feeds))
        return stage_pb2.FeedManyResponse(outcomes=_outcomes(request.feeds, self._take_feed))

    async def _check_first(self, context) -> None:
        if self.model is None or not self.runtime.is_first:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{self.name} is not the first stage"
            )

    def _take_feed(self, request) -> tuple[grpc.StatusCode, str] | None:
        """Queue one feed's rows; what refuses it (status and message) if not taken."""
        st = self._requests.get(request.request_id)
        if st is None:
            return grpc.StatusCode.NOT_FOUND, self._not_open(request.request_id)
        self.leases.renew(st.request_id)
        if request.verified_at_ns > 0:
            self.metrics.step_overhead.observe(
                max(time.time_ns() - request.verified_at_ns, 0) / 1e9
            )
        try:
            act = token_activation(
                request.request_id, request.rows, request.token_ids, self._rows_of(st)
            )
            check_input(act, self.limits, first=True)
            self._enqueue(st, request.seq, Pending(act, request.after_prune))
        except (FrameError, RequestError) as e:
            return status_code(e), f"{self.name}: {e}"
        return None

    async def Prune(self, request, context) -> pb.PruneResponse:
        self.metrics.prunes_per_call.observe(1)
        refused = self._take_prune(request)
        if refused is not None:
            await context.abort(*refused)
        return pb.PruneResponse()

    async def PruneMany(self, request, context) -> pb.PruneManyResponse:
        await _check_batch(context, len(request.prunes), "prunes")
        self.metrics.prunes_per_call.observe(len(request.prunes))
        return pb.PruneManyResponse(outcomes=_outcomes(request.prunes, self._take_prune))

    def _take_prune(self, request) -> tuple[grpc.StatusCode, str] | None:
        """Queue one prune signal; what refuses it (status and message) if not taken."""
        st = self._requests.get(request.request_id)
        if st is None:
            return grpc.StatusCode.NOT_FOUND, self._not_open(request.request_id)
        self.leases.renew(st.request_id)
        try:
            with self.rounds.inbox:
                self._add_prune(st, request.prune, request.relay)
                self.rounds.prune_arrived(st)
        except (FrameError, RequestError) as e:
            return status_code(e), str(e)
        return None

    def _add_prune(self, st: StageRequest, sig: pb.PruneSignal, relay: bool) -> None:
        """Queue one prune signal (under `rounds.inbox`); a relayed one (`relay`) is
        also kept to pass on to the next stage once applied, unless this is the last."""
        st.order.add_prune(sig.seq, prune_from_proto(sig))
        if relay and not self.runtime.is_last:
            st.to_relay[sig.seq] = sig

    async def Release(self, request, context) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=self._drop(request.request_id))

    async def Control(self, request_iterator, context):
        """A router's control stream (services/router/control_stream.py): each message's
        feeds, prunes and releases taken as Feed, Prune and Release take them, and only
        refusals and releases answered."""
        async for msg in request_iterator:
            reply = self._take_control(msg)
            if reply is not None:
                yield reply

    def _take_control(self, msg: stage_pb2.StageControl) -> stage_pb2.StageControlReply | None:
        """A router's control message: its prunes first (a round may start as soon as a
        feed is queued, and must not allocate for one request while rows that another's
        prune in the same message drops still hold their blocks), then its feeds, then
        its releases."""
        refusals = []
        if msg.prunes:
            self.metrics.prunes_per_call.observe(len(msg.prunes))
            for prune in msg.prunes:
                refused = self._take_prune(prune)
                if refused is not None:
                    refusals.append(_refusal(prune.request_id, *refused))
        if msg.feeds:
            self.metrics.feeds_per_call.observe(len(msg.feeds))
            first = self.model is not None and self.runtime.is_first
            for feed in msg.feeds:
                refused = (
                    self._take_feed(feed)
                    if first
                    else (
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"{self.name} is not the first stage",
                    )
                )
                if refused is not None:
                    refusals.append(_refusal(feed.request_id, *refused))
        for ref in msg.releases:
            self._drop(ref.request_id)
        if not refusals and not msg.releases:
            return None
        released = [ref.request_id for ref in msg.releases]
        return stage_pb2.StageControlReply(refusals=refusals, released=released)

    def _on_control_frame(self, frame: Frame) -> None:
        """A router's control message on the data plane (`transport/control_frames.py`):
        taken as on the Control stream; its answer, if any, goes back as a frame to the
        router's address (one of this stage's peers, like every address it sends to)."""
        msg = control_frames.read_control(frame, stage_pb2.StageControl, self._check_hop,
                                          self.name)  # fmt: skip
        reply = None if msg is None else self._take_control(msg)  # type: ignore[arg-type]
        if reply is not None:
            control_frames.answer(self._sends, frame.header, reply, self.name)

    def _not_open(self, rid: str) -> str:
        return f"request {rid!r} is not open on {self.name}"

    # -- data plane ----------------------------------------------------------------------
    def _check_hop(self, address: str) -> None:
        """A next hop or report address must be a data-plane address of this deployment's
        transport on one of this stage's peers (--peers; loopback by default), in every
        mode: nobody makes a stage send frames elsewhere."""
        self.peers.check_hop(address, self.transport.scheme, "this stage")

    def _rows_of(self, st: StageRequest) -> int:
        """The most rows one activation of `st` may carry here."""
        return min(st.capacity, self.limits.max_rows)

    def _bound_frames(self) -> None:
        """No frame larger than the largest batch of activations a peer sends, or than the
        largest control message, is read (each part is then held to its request's rows,
        and a control frame to the control limit, by `_admit`)."""
        if self.model is not None:
            lim = self.limits
            most = max(MAX_ROWS * lim.row_bytes(lim.hidden_size), max_control_bytes(lim))
            self.transport.max_payload_bytes = most

    def _admit(self, h: pb.FrameHeader) -> bool:
        """Whether to read a frame's payload (the header is all there is yet): frames of
        requests open here, hidden states of this stage's dtype and width, one row per
        position and at most the request's capacity. A frame refused here fails its
        request (a well-behaved peer never sends one); frames of unknown requests
        (released already) are dropped, and where they carry relayed prunes their router
        is told (`_lost`). A control frame is read up to the control limit. The relayed
        prunes of a frame admitted are queued here (`_took_prunes`)."""
        if h.kind == Kind.PAYLOAD_KIND_CONTROL:
            return self.model is not None and control_frames.admitted(
                h, max_control_bytes(self.limits)
            )
        st = self._requests.get(h.request_id)
        if st is None or self.model is None:
            if h.prunes and self.model is not None:
                self._lost(h)
            return False
        if h.kind != Kind.PAYLOAD_KIND_HIDDEN:
            # empty and error frames carry no payload
            return not h.dtype and (not h.prunes or self._took_prunes(st, h))
        rows, lim, most = len(h.rows.positions), self.limits, self._rows_of(st)
        dtype = str(lim.dtype).removeprefix("torch.")
        if rows <= most and h.dtype == dtype and list(h.shape) == [rows, lim.hidden_size]:
            return not h.prunes or self._took_prunes(st, h)
        why = (
            f"hidden states {h.dtype or '?'} {list(h.shape)} for {rows} rows; this stage takes "
            f"{dtype} [rows, {lim.hidden_size}], at most {most} rows"
        )
        rlog.warning("bad-frame", "%s: bad frame from %s: %s", self.name, h.sender, why)
        log.debug("bad frame for %s", st.request_id)
        self._report(st, f"{self.name}: bad frame from {h.sender}: {why}")
        return False

    def _took_prunes(self, st: StageRequest, h: pb.FrameHeader) -> bool:
        """Queue the relayed prunes a frame carries as soon as its header is here (the
        transport judges every part of a batch frame before it delivers any), so every
        prune of a frame, or of any part of a batch, is queued before any activation of
        it: no round takes one request's activation, which allocates blocks, while rows
        that another's prune in the same frame drops still hold theirs. Applied at once
        where the sender says room is waited for (`prunes_now`). False (the request
        failed, its router told) where one is refused."""
        try:
            with self.rounds.inbox:
                for sig in h.prunes:
                    self._add_prune(st, sig, relay=True)
                self.rounds.prune_arrived(st, now=h.prunes_now)
        except (FrameError, RequestError) as e:
            rlog.warning("bad-frame", "%s: bad frame from %s: %s", self.name, h.sender, e)
            log.debug("bad frame for %s", st.request_id)
            self._report(st, f"{self.name}: bad frame from {h.sender}: {e}")
            return False
        if self._room_wanted:  # an Open waits for the blocks relayed prunes free (`_room`)
            for arrived in self._room_wanted:
                if not arrived.done():
                    arrived.set_result(None)
            self._room_wanted.clear()
        return True

    def _lost(self, h: pb.FrameHeader) -> None:
        """Relayed prunes for a request not open here (this stage lost it, e.g. its lease
        expired, or released it): its router (`reply_to`) is told at once, NOT_FOUND, as
        a prune it sent here would have been refused, so that it replays the request
        instead of waiting for its path to stall (a router ignores it for a request it
        released). Only to an address of this stage's peers, like every address it sends
        to."""
        try:
            self._check_hop(h.reply_to)
        except RequestError:
            return
        header = error_header(h.request_id, self._not_open(h.request_id), self.name)
        header.error_code = grpc.StatusCode.NOT_FOUND.value[0]
        self._send_later(h.reply_to, header, None, "tell a router of a request lost here")

    def _on_frame(self, frame: Frame) -> None:
        if frame.kind == Kind.PAYLOAD_KIND_CONTROL:
            self._on_control_frame(frame)
            return
        st = self._requests.get(frame.request_id)
        if st is None:  # released already (cancelled or failed): late frames are dropped
            return
        self.leases.renew(st.request_id)
        h = frame.header
        if h.kind == Kind.PAYLOAD_KIND_ERROR:
            return
        empty = h.kind == Kind.PAYLOAD_KIND_EMPTY
        try:
            if h.kind not in (Kind.PAYLOAD_KIND_HIDDEN, Kind.PAYLOAD_KIND_EMPTY):
                raise FrameError(f"a stage takes hidden states, not frames of kind {h.kind}")
            if h.prunes_only and empty:
                return  # its prunes were queued on arrival (`_took_prunes`)
            act = decode(frame)
            if not empty:  # values: on the compute thread (ComputeRounds)
                check_input(act, self.limits, first=False, finite=False)
            self._enqueue(st, h.seq, Pending(act, h.after_prune, empty))
        except (FrameError, RequestError) as e:
            rlog.warning("bad-frame", "%s: bad frame from %s: %s", self.name, h.sender, e)
            log.debug("bad frame for %s", st.request_id)
            self._report(st, f"{self.name}: bad frame from {h.sender}: {e}")

    def _enqueue(self, st: StageRequest, seq: int, item: Pending) -> None:
        """Queue an activation (the prunes relayed on its frame are queued already:
        `_took_prunes`)."""
        with self.rounds.inbox:
            st.order.add_activation(seq, item)
            self.aligner.arrived(st.request_id)
            self.rounds.wake()

    # -- failing a request -----------------------------------------------------------------
    def fail(self, st: StageRequest, message: str, unavailable: bool = False) -> None:
        """This request takes no more work here; the router hears why (and releases it)."""
        st.closed = True
        redacted = message.replace(st.request_id, "<request id>")
        rlog.error("compute", "%s: a request failed: %s", self.name, redacted)
        log.debug("request %s failed: %s", st.request_id, message)
        self._report(st, message, unavailable)

    def _report(self, st: StageRequest, message: str, unavailable: bool = False) -> None:
        """Tell the router this request failed here (it fails the request for the client)."""
        header = error_header(st.request_id, message, self.name)
        header.error_code = (
            grpc.StatusCode.UNAVAILABLE if unavailable else grpc.StatusCode.INTERNAL
        ).value[0]

        if st.report_to:
            self._send_later(st.report_to, header, None, "report a request's failure")

    def _send_later(self, address: str, header: pb.FrameHeader, payload, what: str) -> None:
        """Send a frame from the event loop without waiting for it (a failure is logged:
        the router learns of a lost stage from its control stream)."""
        self._sends.send(address, header, payload, what, self.name)

    def _drop(self, rid: str) -> bool:
        self.leases.end(rid)
        with self.rounds.inbox:
            self.aligner.forget(rid)
            st = self._requests.pop(rid, None)
            if st is not None:
                st.closed = True
        released = self.model is not None and self.runtime.release(rid)
        return st is not None or released
