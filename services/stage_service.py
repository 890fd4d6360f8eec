"""The Stage service: a `StageRuntime` behind gRPC (control) and a transport (data).

Per request the stage keeps a `RequestOrder` (common/runtime/ordering.py): activations
wait there until it is their turn and the prunes they were created after are applied;
prunes are applied in their own order as soon as they arrive. One compute loop serves
every request (SpecPipe-DB): each round it takes whatever is ready, across all requests,
applies the prunes and runs every ready activation in one batched forward
(`StageRuntime.forward_many`), then sends each output to its request's next hop; a round
that would miss requests expected within a few milliseconds waits for them first, a
bounded window (`StepAligner`, common/runtime/alignment.py; `--batch-wait-ms`), so
that the requests of one pipeline step share a forward. Tree rows carry their token ids
on (`Rows.token_ids`). The last stage verifies each request opened with a `VerifySpec`
(`common/runtime/verifier.py`: it draws the tokens and walks down the tree) and sends
the router a small `Verification` instead of logits (without one, logits as before:
for specpipe/pp only the root's, possibly once a prune makes a computed row the root).
Requests join and leave between rounds; a request that fails fails alone. Everything
else is the runtime's `StageRuntime`.

One module for now: the gRPC handlers, the data-plane admission and the compute loop all
act on the same per-request state (`_Request`) and the loop's rounds (the replica
lifecycle and the compute round are to become modules of their own, issue 25).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch
from specpipe.common.perf.cost_model import COST_CONTEXT
from specpipe.common.perf.emulate import Pacer, paced
from specpipe.common.runtime.alignment import StepAligner
from specpipe.common.runtime.errors import (
    AlreadyOpen,
    BadInput,
    InvalidInput,
    RequestError,
)
from specpipe.common.runtime.lease import DEFAULT_LEASE_SECONDS, LeaseTable
from specpipe.common.runtime.loader import LoadedModel, load_model
from specpipe.common.runtime.ordering import Pending, RequestOrder
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.runtime.validation import (
    MAX_CALLS_PER_BATCH,
    MAX_ROWS,
    Limits,
    check_capacity,
    check_input,
    step_row_cap,
)
from specpipe.common.runtime.verifier import RequestVerifier, row_tokens_of
from specpipe.common.spec.grammar import GrammarError, load_grammar_tokenizer
from specpipe.common.spec.messages import Activation, Prune, Verified
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import stage_pb2, stage_pb2_grpc

from .control import (
    cost_curve_to_proto,
    max_control_bytes,
    prune_from_proto,
    token_activation,
    verified_to_proto,
    verify_spec_from_proto,
)
from .grpc_util import Server, wait_until_idle
from .lease import DRAIN_LEASE_SECONDS, lease_claim, reap_expired
from .metrics import StageMetrics
from .modelinfo import DEFAULT_CACHE_FRACTION, cache_budget, free_memory_bytes
from .peers import Peers
from .ratelog import RateLimitedLog
from .security import Security
from .status import status_code
from .transport import (
    TCP,
    Address,
    Frame,
    FrameError,
    Transport,
    TransportError,
    decode,
    encode,
    make_transport,
)
from .transport.codec import Kind, empty_header, error_header

log = logging.getLogger(__name__)
rlog = RateLimitedLog(log)
SERVICE_NAME = "specpipe.v1.Stage"


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


@dataclass
class _Request:
    """One request's routing and ordering state on this stage."""

    request_id: str
    next_hop: str
    report_to: str
    capacity: int = MAX_ROWS
    order: RequestOrder = field(default_factory=RequestOrder)
    closed: bool = False  # released, or failed here: takes no more work
    verifier: RequestVerifier | None = None  # last stage: verifies the request here


@dataclass
class _Work:
    """What one round does for one request: prunes to apply, then activations to run."""

    st: _Request
    prunes: list[tuple[int, Prune]]
    turns: list[tuple[int, Pending]]
    root_seq: int  # seq to send a root released by a prune under
    released: list[Activation] = field(default_factory=list)  # roots the prunes released
    # one per turn: the next hop's activation, or (last stage, verifying) what it verified
    outputs: list[Activation | list[Verified] | None] = field(default_factory=list)
    error: RequestError | None = None


class StageService(stage_pb2_grpc.StageServicer):
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
    ) -> None:
        """`security`: mutual TLS on gRPC and authenticated frames (--secure); Configure
        (loading other weights) only with `allow_configure`; `peers`: the only hosts and
        networks (CIDR) a request's next hop and report address may name, in every mode
        (empty: loopback only; see `Peers`); `batch_wait`: how long a round may wait for
        requests of the same step, in seconds (None: a share of the recent forwards,
        capped; 0: never; see StepAligner); `max_step_rows`: the most rows one activation
        may carry (None: from the model's measured cost curve, `step_row_cap`)."""
        self.security = security
        self.allow_configure = allow_configure
        self.pacer = pacer
        self.peers = Peers.parse(peers)
        self._max_step_rows = max_step_rows
        self.model = model
        self.max_cache_bytes = max_cache_bytes
        self.cache_fraction = cache_fraction
        # Where Configure loads models (default: where the given model lives, else cpu).
        self.device = device or (str(model.runtime.model.device) if model else "cpu")
        self._requests: dict[str, _Request] = {}
        # Each request's state is a lease its router renews (common/runtime/lease.py).
        self.leases = LeaseTable(lease_seconds)
        self._reaper: asyncio.Task | None = None
        self.draining = False
        self._background: set[asyncio.Task] = set()
        self._wake = asyncio.Event()  # new work for the compute loop
        self.aligner = StepAligner(batch_wait)  # when a round waits for more requests
        self._loop_task: asyncio.Task | None = None
        # One model forward at a time, off the event loop (gRPC stays responsive).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")
        self.transport: Transport = make_transport(
            transport_kind,
            self._on_frame,
            bind_host=bind_host,
            advertise_host=advertise_host,
            device=str(model.runtime.model.device) if model else self.device,
            admit=self._admit,
            auth=security.frame_auth() if security else None,
        )
        self._bound_frames()
        limits = Limits.of(model.runtime.model) if model else None
        self.server = Server(
            [SERVICE_NAME],
            max_receive_bytes=max_control_bytes(limits),
            credentials=security.server_credentials() if security else None,
        )
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

    # -- process lifecycle ---------------------------------------------------------------
    async def start(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        data_port: int = 0,
        health_port: int | None = None,
    ) -> int:
        self._loop_task = asyncio.create_task(self._compute_loop(), name="stage-compute")
        self.server.supervise(self._loop_task, self._stopped_computing)
        await self.transport.start(data_port)
        port = await self.server.start(host, port, health_port)
        await self.server.set_serving(self.model is not None)
        self._reaper = asyncio.create_task(reap_expired(self.leases, self._expire), name="leases")
        log.info("%s serving on %s, data plane %s", self.name, port, self.transport.address)
        return port

    async def drain(self, seconds: float) -> None:
        """Graceful shutdown, first half: NOT_SERVING, refuse new requests, and keep
        computing open ones until their router releases them or `seconds` pass."""
        self.draining = True
        await self.server.enter_drain()
        self.leases.shorten(DRAIN_LEASE_SECONDS)  # a crashed router's requests go soon
        await wait_until_idle(lambda: len(self._requests), seconds)

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await self.server.stop()
        for rid in list(self._requests):
            self._drop(rid)
        if self._loop_task is not None:
            self._loop_task.cancel()
        await self.transport.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def name(self) -> str:
        if self.model is None:
            return "stage (no model)"
        r = self.model.runtime.model.layer_range
        return f"stage layers {r.start}:{r.end}/{r.num_layers}"

    @property
    def runtime(self) -> StageRuntime:
        assert self.model is not None
        return self.model.runtime

    @property
    def limits(self) -> Limits:
        """What this stage's model accepts (context, vocabulary, width, dtype, rows per
        activation)."""
        assert self.model is not None
        return dataclasses.replace(Limits.of(self.runtime.model), max_rows=self.max_step_rows)

    @property
    def max_step_rows(self) -> int:
        """The most rows one activation (a prefill chunk, a tree feed) may carry here."""
        if self._max_step_rows is not None:
            return self._max_step_rows
        return step_row_cap(self.model.cost_curve if self.model is not None else None)

    def _pending_bytes(self, capacity: int) -> int:
        """What one request may hold waiting for its turn: every row it may ever cache,
        as this stage's input (token ids and row ids; hidden states after the first)."""
        lim = self.limits
        ids = 4 * torch.int64.itemsize  # position, token, node and parent id
        hidden = 0 if self.runtime.is_first else lim.row_bytes(lim.hidden_size)
        return capacity * (ids + hidden)

    # -- RPCs ------------------------------------------------------------------------------
    async def Describe(self, request, context) -> stage_pb2.StageDescription:
        return self._describe()

    def _describe(self) -> stage_pb2.StageDescription:
        desc = stage_pb2.StageDescription(
            data_address=self.transport.address,
            active_requests=len(self._requests),
            ready=self.model is not None,
            lease_seconds=self.leases.seconds,
            max_step_rows=self.max_step_rows,
        )
        if self.model is None:
            desc.free_memory_bytes = free_memory_bytes(self.device)
            return desc
        info = self.runtime.info()
        desc.model_id = self.model.model_id
        desc.weight_hash = self.model.weight_hash
        desc.layer_start, desc.layer_end, desc.num_layers = info.start, info.end, info.num_layers
        desc.hidden_size, desc.vocab_size = info.hidden_size, info.vocab_size
        desc.max_position_embeddings = self.model.max_positions
        desc.eos_token_ids.extend(self.model.eos_token_ids)
        desc.dtype, desc.device = info.dtype, info.device
        desc.weight_bytes = info.weight_bytes
        desc.free_memory_bytes = free_memory_bytes(self.runtime.model.device)
        desc.row_budget = self.model.row_budget
        if self.model.cost_curve is not None:
            desc.cost_curve.CopyFrom(cost_curve_to_proto(self.model.cost_curve, COST_CONTEXT))
        desc.cache_bytes_used, desc.cache_bytes_limit = (
            info.cache_bytes_used,
            info.cache_bytes_limit,
        )
        desc.cache_blocks_used, desc.cache_blocks_free = (
            info.cache_blocks_used,
            info.cache_blocks_free,
        )
        desc.cache_block_rows = info.cache_block_rows
        desc.prefix_caching, desc.cache_blocks_cached = (
            info.prefix_caching,
            info.cache_blocks_cached,
        )
        desc.prefix_cache_queries = info.prefix_cache_queries
        desc.prefix_cache_hits = info.prefix_cache_hits
        return desc

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
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{self.name} is shutting down (draining): open the request on another replica",
            )
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
            if request.HasField("verify") and self.runtime.is_last:
                verify = await self._verify_spec(request.verify)
            if rid in self._requests:
                raise AlreadyOpen(f"request {rid!r} is already open on this stage")
            claim = lease_claim(
                request.lease_owner,
                request.lease_epoch,
                request.lease_token,
                context,
                authenticated=self.security is not None,
            )
            self._free_stale(self.leases.grant(rid, claim))
            try:
                cached = self.runtime.open(
                    rid,
                    int(request.capacity),
                    request.root_logits_only and verify is None,
                    prefix_tokens=request.prefix_token_ids,
                    final_hidden=verify is not None,
                )
            except RequestError:
                self.leases.end(rid)
                raise
        except RequestError as e:
            await context.abort(status_code(e), f"{self.name}: {e}")
        capacity = int(request.capacity)
        st = _Request(rid, request.next_hop, request.report_to, capacity)
        if verify is not None:
            st.verifier = RequestVerifier(rid, verify, self.runtime.model.logits)
        # Every prefill chunk may be sent at once (one row each at least), then the layers
        # in flight: nothing legitimate is numbered further ahead.
        st.order.window = capacity + 64
        st.order.max_pending_bytes = self._pending_bytes(capacity)
        self._requests[rid] = st
        self.aligner.opened(rid, joins=request.fills_pipeline, first=self.runtime.is_first)
        self.metrics.requests.inc()
        if self.runtime.prefix_caching:
            self.metrics.prefix_cache_queried(len(request.prefix_token_ids), cached)
        return stage_pb2.OpenStageResponse(cached_tokens=cached)

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
            st.order.add_prune(request.prune.seq, prune_from_proto(request.prune))
        except (FrameError, RequestError) as e:
            return status_code(e), str(e)
        self._wake.set()
        return None

    async def Release(self, request, context) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=self._drop(request.request_id))

    async def Renew(self, request, context) -> pb.RenewResponse:
        """A router's keep-alive: only its own requests (its owner's, its epoch's, with
        its token) are renewed; a newer epoch of the same owner frees the older's."""
        try:
            claim = lease_claim(
                request.owner, request.epoch, request.token, context, self.security is not None
            )
            if claim is None:
                raise InvalidInput("Renew names no lease owner")
            unknown, stale = self.leases.renew_all(claim, request.request_ids)
        except RequestError as e:
            await context.abort(status_code(e), f"{self.name}: {e}")
        self._free_stale(stale)
        return pb.RenewResponse(unknown_ids=unknown)

    def _free_stale(self, request_ids: list[str]) -> None:
        """Requests of a router process that was replaced (it restarted): free them now."""
        for rid in request_ids:
            self._drop(rid)
        if request_ids:
            log.warning(
                "%s: freed %d requests of a router that restarted", self.name, len(request_ids)
            )

    def _expire(self, rid: str) -> None:
        rlog.warning("lease", "%s: a request expired (no word from its router for %.0f s): freed",
                     self.name, self.leases.seconds)  # fmt: skip
        log.debug("request %s expired", rid)
        self._drop(rid)

    def _not_open(self, rid: str) -> str:
        return f"request {rid!r} is not open on {self.name}"

    # -- data plane ----------------------------------------------------------------------
    def _check_hop(self, address: str) -> None:
        """A next hop or report address must be a data-plane address of this deployment's
        transport on one of this stage's peers (--peers; loopback by default), in every
        mode: nobody makes a stage send frames elsewhere."""
        try:
            addr = Address.parse(address)
        except ValueError as e:
            raise InvalidInput(str(e)) from None
        if addr.scheme != self.transport.scheme:
            raise InvalidInput(
                f"{address}: this deployment's data plane is {self.transport.scheme}"
            )
        if not self.peers.allows(addr.host):
            raise InvalidInput(
                f"{address}: {addr.host} is not one of this stage's peers ({self.peers}; "
                "see --peers)"
            )

    def _rows_of(self, st: _Request) -> int:
        """The most rows one activation of `st` may carry here."""
        return min(st.capacity, self.max_step_rows)

    def _bound_frames(self) -> None:
        """No frame larger than the largest batch of activations a peer sends is read
        (each part is then held to its request's rows by `_admit`)."""
        if self.model is not None:
            lim = self.limits
            self.transport.max_payload_bytes = MAX_ROWS * lim.row_bytes(lim.hidden_size)

    def _admit(self, h: pb.FrameHeader) -> bool:
        """Whether to read a frame's payload (the header is all there is yet): frames of
        requests open here, hidden states of this stage's dtype and width, one row per
        position and at most the request's capacity. A frame refused here fails its
        request (a well-behaved peer never sends one); frames of unknown requests
        (released already) are dropped."""
        st = self._requests.get(h.request_id)
        if st is None or self.model is None:
            return False
        if h.kind != Kind.PAYLOAD_KIND_HIDDEN:
            return not h.dtype  # empty and error frames carry no payload
        rows, lim, most = len(h.rows.positions), self.limits, self._rows_of(st)
        dtype = str(lim.dtype).removeprefix("torch.")
        if rows <= most and h.dtype == dtype and list(h.shape) == [rows, lim.hidden_size]:
            return True
        why = (
            f"hidden states {h.dtype or '?'} {list(h.shape)} for {rows} rows; this stage takes "
            f"{dtype} [rows, {lim.hidden_size}], at most {most} rows"
        )
        rlog.warning("bad-frame", "%s: bad frame from %s: %s", self.name, h.sender, why)
        log.debug("bad frame for %s", st.request_id)
        self._report(st, f"{self.name}: bad frame from {h.sender}: {why}")
        return False

    def _on_frame(self, frame: Frame) -> None:
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
            act = decode(frame)
            if not empty:
                check_input(act, self.limits, first=False)
            self._enqueue(st, h.seq, Pending(act, h.after_prune, empty))
        except (FrameError, RequestError) as e:
            rlog.warning("bad-frame", "%s: bad frame from %s: %s", self.name, h.sender, e)
            log.debug("bad frame for %s", st.request_id)
            self._report(st, f"{self.name}: bad frame from {h.sender}: {e}")

    def _enqueue(self, st: _Request, seq: int, item: Pending) -> None:
        st.order.add_activation(seq, item)
        self.aligner.arrived(st.request_id)
        self._wake.set()

    # -- the compute loop ------------------------------------------------------------------
    async def _compute_loop(self) -> None:
        """Each round: collect every request's ready work, run it on the compute thread as
        one batch, send the outputs; sleep while nothing is ready. A round that the
        aligner holds (requests of the same step expected shortly) waits for them or for
        its window; prunes that arrive meanwhile are applied at once (a prune may release
        a root the router waits for)."""
        held_since: float | None = None
        while True:
            hold = self._hold()
            if hold is None:  # nothing ready
                self.aligner.started()
                held_since = None
                self._wake.clear()
                await self._wake.wait()
                continue
            if hold > 0:
                held_since = held_since or time.perf_counter()
                self._wake.clear()
                if work := self._collect(turns=False):
                    await self._run(work)
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), hold)
                continue
            if held_since is not None:
                self.metrics.batch_wait.observe(time.perf_counter() - held_since)
                held_since = None
            work = self._collect()
            self.aligner.started([w.st.request_id for w in work if w.turns])
            if work:
                await self._run(work)

    def _stopped_computing(self) -> None:
        """The compute loop ended (see `Server.supervise`): refuse new requests, fail open ones."""
        self.draining = True
        for st in list(self._requests.values()):
            if not st.closed:
                self._fail(st, f"{self.name}: its compute loop ended")

    def _hold(self) -> float | None:
        """How long the next round should still wait (0: start it; None: nothing ready)."""
        active, ready, blocked, prunes = [], set(), set(), False
        for st in self._requests.values():
            if st.closed:
                continue
            active.append(st.request_id)
            order = st.order
            if order.turn_ready():
                ready.add(st.request_id)
            elif order.blocked():
                blocked.add(st.request_id)
            prunes = prunes or order.next_prune() is not None
        if not ready:
            return 0.0 if prunes else None
        return self.aligner.hold(ready, active, blocked)

    async def _run(self, work: list[_Work]) -> None:
        """One round; a round that fails other than in its forward (a bug) fails its own
        requests, with the traceback in the log, and the loop goes on serving the rest."""
        try:
            await self._round(work)
        except Exception as e:
            log.exception("%s: a round of %d requests failed", self.name, len(work))
            for w in work:
                if not w.st.closed:
                    self._fail(w.st, f"{self.name} failed: {type(e).__name__}: {e}")

    async def _round(self, work: list[_Work]) -> None:
        """One round on the compute thread, then its outputs sent."""
        loop = asyncio.get_running_loop()
        try:
            seconds = await loop.run_in_executor(self._executor, self._compute, work)
        except Exception as e:  # the batched forward itself failed: every request in it
            rlog.error("batch", "%s: a batched forward of %d requests failed: %s: %s",
                       self.name, len(work), type(e).__name__, e)  # fmt: skip
            log.debug("the batch failed", exc_info=True)
            for w in work:
                self._fail(w.st, f"{self.name} failed: {e}")
            return
        if seconds is not None:
            self.aligner.computed(seconds)
        await self._deliver(work)

    def _collect(self, turns: bool = True) -> list[_Work]:
        """Every request's prunes that can be applied and (with `turns`) activations whose
        turn it is."""
        work = []
        for st in self._requests.values():
            if st.closed:
                continue
            order, prunes, taken = st.order, [], []
            root_seq = order.next_seq
            while (ready := order.next_prune()) is not None:
                prunes.append(ready)
                order.prune_applied(ready[0])
            while turns and (turn := order.next_activation()) is not None:
                taken.append(turn)
            if prunes or taken:
                work.append(_Work(st, prunes, taken, root_seq))
        return work

    def _compute(self, work: list[_Work]) -> float | None:
        """On the compute thread: the round's prunes, then one forward over every ready
        activation; outputs made ready to send. Returns the forward's seconds (None
        without rows: a round of prunes only)."""
        runtime = self.runtime
        for w in work:
            try:
                for _, prune in w.prunes:
                    root = runtime.prune(w.st.request_id, prune)
                    if w.st.verifier is not None:
                        w.st.verifier.on_prune(prune)
                    if root is not None:  # last stage: a held row became the root
                        w.released.append(self._for_wire(root))
            except RequestError as e:
                w.error = e
        batch = [(w, i) for w in work if w.error is None for i, (_, p) in enumerate(w.turns)]
        taken = [(w, w.turns[i][1].act) for w, i in batch if not w.turns[i][1].empty]
        acts = [a for _, a in taken]
        rows = sum(len(a) for a in acts)
        start = time.perf_counter()
        with self.metrics.forward(rows), paced(self.pacer, acts):
            outs = runtime.forward_many(acts)
            # the last stage's verification is part of its step (LM head and draws)
            results = iter([self._output(w, a, o) for (w, a), o in zip(taken, outs, strict=True)])
        seconds = time.perf_counter() - start if rows else None
        if rows:
            self.metrics.batch_requests.observe(len({a.request_id for a in acts}))
        for w in work:
            w.outputs = [None] * len(w.turns)
        for w, i in batch:
            if w.turns[i][1].empty:
                continue
            out = next(results)
            if isinstance(out, RequestError):
                w.error = w.error or out
            else:
                w.outputs[i] = out if isinstance(out, list) else self._for_wire(out)
        return seconds

    def _output(self, w: _Work, inp: Activation, out):
        """One request's forward output: its rows' token ids carried on; on the last
        stage, what its verifier drew (a request that fails here fails alone)."""
        if out is None or isinstance(out, RequestError):
            return out
        out.row_tokens = row_tokens_of(out, inp)
        verifier = w.st.verifier
        if verifier is None or not self.runtime.is_last:
            return out
        try:
            return verifier.on_output(out)
        except ValueError as e:
            return InvalidInput(str(e))

    async def _deliver(self, work: list[_Work]) -> None:
        """Send a round's outputs: every request's frames in its order, and the frames of
        all requests that share a next hop together, as one frame where they fit
        (`Transport.send_many`). A hop that cannot be reached fails its requests alone."""
        by_hop: dict[str, list[tuple[_Request, tuple]]] = {}
        for w in work:
            for hop, frame in self._frames_of(w):
                by_hop.setdefault(hop, []).append((w.st, frame))
        await asyncio.gather(*(self._send_hop(hop, items) for hop, items in by_hop.items()))

    def _frames_of(self, w: _Work) -> list[tuple[str, tuple]]:
        """(next hop, (header, payload)) of a request's outputs this round, in order."""
        st = w.st
        if st.closed:
            return []
        if w.error is not None:
            self._fail(st, f"{self.name} failed: {w.error}")
            return []
        outs = [(w.root_seq, st.order.applied, root) for root in w.released]
        for (seq, item), out in zip(w.turns, w.outputs, strict=True):
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "%s seq %d after prune %d: nodes %s",
                    st.request_id, seq, item.after_prune, item.act.node_ids.tolist(),
                )  # fmt: skip
            if isinstance(out, list):  # verifications (last stage)
                outs += [(seq, item.after_prune, v) for v in out]
            else:
                outs.append((seq, item.after_prune, out))
        try:
            frames = [self._frame(st, seq, after, out) for seq, after, out in outs]
        except Exception as e:  # a payload the data plane cannot carry: this request only
            log.debug("request %s failed", st.request_id, exc_info=True)
            self._fail(st, f"{self.name} failed: {type(e).__name__}: {e}")
            return []
        return [(st.next_hop, f) for f in frames if f is not None]

    def _frame(self, st: _Request, seq: int, after_prune: int, out: Activation | Verified | None):
        """The frame of one output for the next hop, or None: the last stage sends only
        verifications (or logits; prefill chunks and pruned rows bring the router
        nothing); the others keep the order of `seq` with an empty frame for a fully
        pruned activation."""
        if isinstance(out, Verified):
            header = pb.FrameHeader(
                request_id=st.request_id,
                seq=seq,
                after_prune=after_prune,
                kind=Kind.PAYLOAD_KIND_VERIFIED,
                sender=self.name,
                verified=verified_to_proto(out),
            )
            header.verified.sent_at_ns = time.time_ns()
            return header, None
        if self.runtime.is_last:
            if out is not None and out.logits is not None:
                return encode(out, seq, after_prune, self.name)
            return None
        if out is None:
            return empty_header(st.request_id, seq, self.name), None
        return encode(out, seq, after_prune, self.name)

    async def _send_hop(self, hop: str, items: list[tuple[_Request, tuple]]) -> None:
        try:
            await self.transport.send_many(hop, [f for _, f in items], self.name)
        except Exception as e:
            unavailable = isinstance(e, TransportError)
            why = "cannot reach the next hop" if unavailable else f"failed: {type(e).__name__}"
            for st in {st.request_id: st for st, _ in items}.values():
                if not st.closed:
                    self._fail(st, f"{self.name} {why}: {e}", unavailable=unavailable)

    def _fail(self, st: _Request, message: str, unavailable: bool = False) -> None:
        """This request takes no more work here; the router hears why (and releases it)."""
        st.closed = True
        redacted = message.replace(st.request_id, "<request id>")
        rlog.error("compute", "%s: a request failed: %s", self.name, redacted)
        log.debug("request %s failed: %s", st.request_id, message)
        self._report(st, message, unavailable)

    def _for_wire(self, out: Activation | None) -> Activation | None:
        """Put device outputs where the transport sends from, still on the compute thread
        (a device-to-host copy waits for the GPU; the event loop must not). TCP, and UCX
        without a CUDA transport, send host memory; UCX with one reads the device buffer
        itself, once the stream has finished writing it."""
        if out is None:
            return None
        for name in ("hidden", "logits"):
            t = getattr(out, name)
            if t is None or t.device.type == "cpu":
                continue
            if self.transport.host_payloads:
                setattr(out, name, t.cpu())
            elif t.device.type == "cuda":
                torch.cuda.current_stream(t.device).synchronize()
        return out

    def _report(self, st: _Request, message: str, unavailable: bool = False) -> None:
        """Tell the router this request failed here (it fails the request for the client)."""
        header = error_header(st.request_id, message, self.name)
        header.error_code = (
            grpc.StatusCode.UNAVAILABLE if unavailable else grpc.StatusCode.INTERNAL
        ).value[0]

        async def send() -> None:
            try:
                await self.transport.send_frame(st.report_to, header)
            except TransportError as e:
                rlog.warning("report", "%s: cannot report a request's failure: %s", self.name, e)
                log.debug("cannot report failure of %s", st.request_id)

        if st.report_to:
            task = asyncio.ensure_future(send())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _drop(self, rid: str) -> bool:
        self.leases.end(rid)
        self.aligner.forget(rid)
        st = self._requests.pop(rid, None)
        if st is not None:
            st.closed = True
        released = self.model is not None and self.runtime.release(rid)
        return st is not None or released
