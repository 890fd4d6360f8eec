"""A stage's compute rounds (SpecPipe-DB): one loop serves every request open on it.

Each round takes whatever is ready, across all requests: the prunes that can be applied
and the activations whose turn it is (`RequestOrder`, common/runtime/ordering.py). On
the compute thread it applies the prunes, checks that the round's hidden states are
finite (one read of the device for all), runs every ready activation in one batched
forward (`StageRuntime.forward_many`; the last stage also verifies, `RequestVerifier`)
and puts the outputs where the transport sends from; back on the event loop it sends
each output to its request's next hop, the frames of all requests that share a hop
together. A round that would miss requests expected within a few milliseconds waits
for them first, a bounded window (`StepAligner`, common/runtime/alignment.py;
`--batch-wait-ms`), which learns from the forward's device time (`clock.device_timer`).
A request that fails fails alone.

The stage service (`stage_service.py`) owns the requests, takes their work in (RPCs and
frames) and fails them; this module only computes and sends. It is one module because a
round's collection, its computation and its delivery share the round's `Work` (which
turns it took, sliced prefill included, and what each gave).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Protocol

import torch
from specpipe.common.perf.clock import device_timer
from specpipe.common.perf.emulate import Pacer, paced
from specpipe.common.runtime.alignment import StepAligner
from specpipe.common.runtime.errors import InvalidInput, RequestError
from specpipe.common.runtime.ordering import Pending, RequestOrder
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.runtime.validation import MAX_ROWS, nonfinite, nonfinite_message
from specpipe.common.runtime.verifier import RequestVerifier, row_tokens_of, verify_many
from specpipe.common.spec.messages import Activation, Prune, Verified
from specpipe.v1 import dataplane_pb2 as pb

from .control import verified_to_proto
from .metrics import StageMetrics
from .prefill_slices import Slice, joined, next_is_prefill, prefill_cells, rows_within, split_chunk
from .ratelog import RateLimitedLog
from .transport import Transport, TransportError, encode
from .transport.codec import Kind, empty_header

log = logging.getLogger(__name__)
rlog = RateLimitedLog(log)
PROGRESS_SECONDS = 1.0  # a request's progress reports, at most one per this long


@dataclass
class StageRequest:
    """One request's routing and ordering state on a stage."""

    request_id: str
    next_hop: str
    report_to: str
    capacity: int = MAX_ROWS
    order: RequestOrder = field(default_factory=RequestOrder)
    closed: bool = False  # released, or failed here: takes no more work
    verifier: RequestVerifier | None = None  # last stage: verifies the request here
    # Tell `report_to` that its rows were computed here (at most every PROGRESS_SECONDS):
    # the router's stall check follows progress, which a long prefill shows no other way.
    report_progress: bool = False
    progress_at: float = 0.0  # when it was last told (time.monotonic)
    sliced: list[Activation] = field(default_factory=list)  # a chunk's slices' outputs


@dataclass
class Work:
    """What one round does for one request: prunes to apply, then activations to run."""

    st: StageRequest
    prunes: list[tuple[int, Prune]]
    turns: list[tuple[int, Pending]]
    root_seq: int  # seq to send a root released by a prune under
    released: list[Activation] = field(default_factory=list)  # roots the prunes released
    # one per turn: the next hop's activation, or (last stage, verifying) what it verified
    outputs: list[Activation | list[Verified] | None] = field(default_factory=list)
    error: RequestError | None = None


class Stage(Protocol):
    """What the rounds read of their stage (it may load another model between them)."""

    @property
    def name(self) -> str: ...
    @property
    def runtime(self) -> StageRuntime: ...

    pacer: Pacer | None
    aligner: StepAligner
    metrics: StageMetrics
    transport: Transport

    def fail(self, st: StageRequest, message: str, unavailable: bool = False) -> None:
        """`st` takes no more work; its router hears why."""


class ComputeRounds:
    """The loop of a stage's rounds over its open requests (`requests`, the stage's own
    dict), computing on `executor`, its one compute thread."""

    def __init__(self, stage: Stage, requests: dict[str, StageRequest], executor: Executor) -> None:
        self.stage = stage
        self.requests = requests
        self.executor = executor
        self._wake = asyncio.Event()  # new work for the loop
        self._prefill_turn = 0  # rounds so far: whose prefill goes first (`_take_prefill`)

    def wake(self) -> None:
        """New work arrived (an activation or a prune)."""
        self._wake.set()

    async def run_forever(self) -> None:
        """Each round: collect every request's ready work, run it on the compute thread as
        one batch, send the outputs; sleep while nothing is ready. A round that the
        aligner holds (requests of the same step expected shortly) waits for them or for
        its window; prunes that arrive meanwhile are applied at once (a prune may release
        a root the router waits for)."""
        held_since: float | None = None
        while True:
            hold = self._hold()
            if hold is None:  # nothing ready
                self.stage.aligner.started()
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
                self.stage.metrics.batch_wait.observe(time.perf_counter() - held_since)
                held_since = None
            work = self._collect()
            self.stage.aligner.started([w.st.request_id for w in work if w.turns])
            if work:
                await self._run(work)

    def _hold(self) -> float | None:
        """How long the next round should still wait (0: start it; None: nothing ready)."""
        active, ready, blocked, prunes = [], set(), set(), False
        for st in self.requests.values():
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
        return self.stage.aligner.hold(ready, active, blocked)

    def _collect(self, turns: bool = True) -> list[Work]:
        """Every request's prunes that can be applied and (with `turns`) activations whose
        turn it is: every tree feed, and prefill chunks up to the step's prefill budget
        (`StepBudget.prefill_cells`, rows x keys; the first chunk always), taken from
        the requests in turn, so a long prompt's chunks interleave with the others'
        decodes instead of filling a round (docs/architecture.md, "5. The request
        controller and its executors", "Bounded memory per step")."""
        work: dict[str, Work] = {}
        live = [st for st in self.requests.values() if not st.closed]
        for st in live:
            order, prunes, taken = st.order, [], []
            root_seq = order.next_seq
            while (ready := order.next_prune()) is not None:
                prunes.append(ready)
                order.prune_applied(ready[0])
            while turns and not next_is_prefill(order) and (turn := order.next_activation()):
                taken.append(turn)
            if prunes or taken:
                work[st.request_id] = Work(st, prunes, taken, root_seq)
        if turns and live:
            self._take_prefill(live, work)
        return list(work.values())

    def _take_prefill(self, live: list[StageRequest], work: dict[str, Work]) -> None:
        """Prefill chunks into the round within its budget (beside requests that decode,
        about what their step costs: `PrefillPace`), starting one request further each
        round (several long prompts share the budget in turn)."""
        runtime = self.stage.runtime
        # Beside requests that decode (ready now, due, or lately: a decode that arrives
        # during a long round waits for all of it), what costs about as much as their
        # step; with every request prefilling for a while, the memory bound.
        decodes = runtime.prefill_pace.decoding() or any(
            not next_is_prefill(st.order) for st in live
        )
        budget = runtime.prefill_pace.cells if decodes else runtime.step_budget.prefill_cells
        spent = 0
        self._prefill_turn += 1
        start = self._prefill_turn % len(live)
        for st in live[start:] + live[:start]:
            order = st.order
            while order.pending.get(order.next_seq) is not None:
                if not next_is_prefill(order):  # a feed after its prompt: in the same round
                    if (turn := order.next_activation()) is None:
                        break
                    self._take(work, st, turn)
                    continue
                seq, item = order.next_seq, order.pending[order.next_seq]
                cells = prefill_cells(item.act)
                if spent and spent + cells > budget:
                    return
                ready = item.after_prune <= order.applied and order.next_prune() is None
                if cells > budget and decodes and ready and len(item.act) > 1:
                    # the chunk's first rows alone: the rest waits for the next rounds
                    rows = rows_within(item.act, budget)
                    if rows < len(item.act):
                        head, rest = split_chunk(item.act, rows)
                        order.pending[seq] = Pending(rest, item.after_prune)
                        self._take(work, st, (seq, Slice(head, item.after_prune)))
                        return
                turn = order.next_activation()
                if turn is None:
                    break
                spent += cells
                self._take(work, st, turn)

    @staticmethod
    def _take(work: dict[str, Work], st: StageRequest, turn: tuple[int, Pending]) -> None:
        w = work.get(st.request_id)
        if w is None:
            w = work[st.request_id] = Work(st, [], [], st.order.next_seq)
        w.turns.append(turn)

    async def _run(self, work: list[Work]) -> None:
        """One round; a round that fails other than in its forward (a bug) fails its own
        requests, with the traceback in the log, and the loop goes on serving the rest."""
        try:
            await self._round(work)
        except Exception as e:
            log.exception("%s: a round of %d requests failed", self.stage.name, len(work))
            for w in work:
                if not w.st.closed:
                    self.stage.fail(w.st, f"{self.stage.name} failed: {type(e).__name__}: {e}")

    async def _round(self, work: list[Work]) -> None:
        """One round on the compute thread, then its outputs sent."""
        loop = asyncio.get_running_loop()
        name = self.stage.name
        try:
            seconds = await loop.run_in_executor(self.executor, self.compute, work)
        except Exception as e:  # the batched forward itself failed: every request in it
            rlog.error("batch", "%s: a batched forward of %d requests failed: %s: %s",
                       name, len(work), type(e).__name__, e)  # fmt: skip
            log.debug("the batch failed", exc_info=True)
            for w in work:
                self.stage.fail(w.st, f"{name} failed: {e}")
            return
        if seconds is not None:
            self.stage.aligner.computed(seconds)
        await self._deliver(work)

    # -- on the compute thread ---------------------------------------------------------------
    def compute(self, work: list[Work]) -> float | None:
        """On the compute thread: the round's prunes, then one forward over every ready
        activation; outputs made ready to send. Returns the forward's seconds on the
        device, pacing included (None without rows: a round of prunes only)."""
        stage = self.stage
        runtime = stage.runtime
        # every request's prunes in one pass (one K/V copy for all)
        pruned = iter(runtime.prune_many([(w.st.request_id, p) for w in work for _, p in w.prunes]))
        for w in work:
            for _, prune in w.prunes:
                error = next(pruned)
                if error is not None:
                    w.error = w.error or error
                    continue
                if w.st.verifier is not None:
                    w.st.verifier.on_prune(prune)
        self._check_finite(work)
        batch = [(w, i) for w in work if w.error is None for i in range(len(w.turns))]
        taken = [(w, w.turns[i][1].act) for w, i in batch if not w.turns[i][1].empty]
        acts = [a for _, a in taken]
        rows = sum(len(a) for a in acts)
        device = runtime.model.device
        with (
            stage.metrics.forward(rows),
            device_timer(device) as elapsed,
            paced(stage.pacer, acts, device),
        ):
            outs = runtime.forward_many(acts)
            # the last stage's verification is part of its step (LM head and draws)
            results = iter(self._outputs(taken, outs))
        if rows:
            stage.metrics.batch_requests.observe(len({a.request_id for a in acts}))
            cells = sum(prefill_cells(a) for a in acts if a.committed)
            decode_rows = sum(len(a) for a in acts if not a.committed)
            runtime.prefill_pace.observe(decode_rows, cells, elapsed.seconds)
        for w in work:
            w.outputs = [None] * len(w.turns)
        for w, i in batch:
            if w.turns[i][1].empty:
                continue
            out = next(results)
            if isinstance(out, RequestError):
                w.error = w.error or out
            elif isinstance(w.turns[i][1], Slice):  # held until the chunk's rest is done
                if isinstance(out, Activation) and out.hidden is not None:
                    w.st.sliced.append(out)
            elif isinstance(out, list):
                w.outputs[i] = out
            else:
                if w.st.sliced and out is not None and out.committed:
                    out, w.st.sliced = joined([*w.st.sliced, out]), []
                w.outputs[i] = self.for_wire(out)
        return elapsed.seconds if rows else None

    def _check_finite(self, work: list[Work]) -> None:
        """Hidden states that arrived with a NaN or an infinity fail their request alone
        (checked here, all at once, not on arrival: reading a device tensor's values on
        the event loop would wait for the device)."""
        mine = [
            (w, p.act.hidden)
            for w in work
            if w.error is None
            for _, p in w.turns
            if not p.empty and p.act.hidden is not None
        ]
        for (w, _), bad in zip(mine, nonfinite([h for _, h in mine]), strict=True):
            if bad and w.error is None:
                w.error = InvalidInput(f"a bad frame: {nonfinite_message('hidden states')}")
                rlog.warning("bad-frame", "%s: %s", self.stage.name, w.error)

    def _outputs(self, taken: list[tuple[Work, Activation]], outs: list) -> list:
        """The round's forward outputs, each with its rows' token ids carried on; on the
        last stage, what each request's verifier drew (`verify_many`: one LM head call
        for the round's roots). A request that fails here fails alone."""
        done, verifying = [], []
        runtime = self.stage.runtime
        for (w, inp), out in zip(taken, outs, strict=True):
            if out is not None and not isinstance(out, RequestError):
                out.row_tokens = row_tokens_of(out, inp)
                if w.st.verifier is not None and runtime.is_last:
                    verifying.append((len(done), w.st.verifier, out))
            done.append(out)
        drawn = verify_many([(v, out) for _, v, out in verifying], runtime.model.logits)
        for (k, _, _), found in zip(verifying, drawn, strict=True):
            done[k] = InvalidInput(str(found)) if isinstance(found, ValueError) else found
        return done

    def for_wire(self, out: Activation | None) -> Activation | None:
        """Put device outputs where the transport sends from, still on the compute thread
        (a device-to-host copy waits for the GPU; the event loop must not). TCP, and UCX
        without a CUDA transport, send host memory; UCX with one reads the device buffer
        itself, on its own stream: the buffer is made contiguous here (no copy kernel
        later on the event loop) and the compute stream has finished writing it when
        this returns (`transport.batch.settled` orders what the event loop adds)."""
        if out is None:
            return None
        for name in ("hidden", "logits"):
            t = getattr(out, name)
            if t is None or t.device.type == "cpu":
                continue
            if self.stage.transport.host_payloads:
                setattr(out, name, t.cpu())
                continue
            setattr(out, name, t.contiguous())
            if t.device.type == "cuda":
                torch.cuda.current_stream(t.device).synchronize()
        return out

    # -- back on the event loop --------------------------------------------------------------
    async def _deliver(self, work: list[Work]) -> None:
        """Send a round's outputs: every request's frames in its order, and the frames of
        all requests that share a next hop together, as one frame where they fit
        (`Transport.send_many`). A hop that cannot be reached fails its requests alone."""
        by_hop: dict[str, list[tuple[StageRequest, tuple]]] = {}
        for w in work:
            for hop, frame in self._frames_of(w):
                by_hop.setdefault(hop, []).append((w.st, frame))
        await asyncio.gather(*(self._send_hop(hop, items) for hop, items in by_hop.items()))

    def _frames_of(self, w: Work) -> list[tuple[str, tuple]]:
        """(next hop, (header, payload)) of a request's outputs this round, in order."""
        st, name = w.st, self.stage.name
        if st.closed:
            return []
        if w.error is not None:
            self.stage.fail(st, f"{name} failed: {w.error}")
            return []
        outs = [(w.root_seq, st.order.applied, root) for root in w.released]
        for (seq, item), out in zip(w.turns, w.outputs, strict=True):
            if isinstance(item, Slice):
                continue  # its output goes with the chunk's rest
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
            self.stage.fail(st, f"{name} failed: {type(e).__name__}: {e}")
            return []
        sent = [(st.next_hop, f) for f in frames if f is not None]
        return sent + self._progress(st, w, reported=any(h == st.report_to for h, _ in sent))

    def _progress(self, st: StageRequest, w: Work, reported: bool) -> list[tuple[str, tuple]]:
        """An empty frame to the request's router saying this stage computed its rows,
        where it asked for one, its last is PROGRESS_SECONDS old and no other frame of
        this round goes there."""
        if not st.report_progress or not w.turns:
            return []
        now = time.monotonic()
        if reported:
            st.progress_at = now
            return []
        if now - st.progress_at < PROGRESS_SECONDS:
            return []
        st.progress_at = now
        return [
            (st.report_to, (empty_header(st.request_id, w.turns[-1][0], self.stage.name), None))
        ]

    def _frame(
        self, st: StageRequest, seq: int, after_prune: int, out: Activation | Verified | None
    ):
        """The frame of one output for the next hop, or None: the last stage sends only
        verifications (prefill chunks and pruned rows bring the router nothing); the
        others keep the order of `seq` with an empty frame for a fully pruned activation."""
        name = self.stage.name
        if isinstance(out, Verified):
            header = pb.FrameHeader(
                request_id=st.request_id,
                seq=seq,
                after_prune=after_prune,
                kind=Kind.PAYLOAD_KIND_VERIFIED,
                sender=name,
                verified=verified_to_proto(out),
            )
            header.verified.sent_at_ns = time.time_ns()
            return header, None
        if self.stage.runtime.is_last:
            return None
        if out is None:
            return empty_header(st.request_id, seq, name), None
        return encode(out, seq, after_prune, name)

    async def _send_hop(self, hop: str, items: list[tuple[StageRequest, tuple]]) -> None:
        try:
            await self.stage.transport.send_many(hop, [f for _, f in items], self.stage.name)
        except Exception as e:
            unavailable = isinstance(e, TransportError)
            why = "cannot reach the next hop" if unavailable else f"failed: {type(e).__name__}"
            for st in {st.request_id: st for st, _ in items}.values():
                if not st.closed:
                    self.stage.fail(st, f"{self.stage.name} {why}: {e}", unavailable=unavailable)
