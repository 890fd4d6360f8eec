"""A stage's compute rounds (SpecPipe-DB): one loop serves every request open on it.

Each round takes whatever is ready, across all requests: the prunes that can be applied
and the activations whose turn it is (`RequestOrder`, common/runtime/ordering.py). The
rounds run on a compute thread of their own, which takes each round straight from the
requests' orders (the inbox: the event loop adds activations and prunes as they arrive,
under `ComputeRounds.inbox`, and wakes the thread), so a round whose input is already
there never waits for a turn of the event loop. A prune that no waiting activation
needs does not wake it: the next round applies it (`prune_arrived`). A round is:

- *prepared*: its prunes applied, the hidden states checked finite (one read for all),
  every ready activation's cache rows, positions and attention metadata built and queued
  for the device (`StageRuntime.prepare_step`);
- *launched*: one batched forward (`StageRuntime.run_step`; on an accelerator the
  launches return before the device is done, and an emulated device, `--emulate-costs`,
  is waited for only at hand-off: `Pacer.launch`);
- *handed off*: the one wait for the device (the last stage verifies: `RequestVerifier`,
  `verify_many`; outputs put where the transport sends from, `for_wire`), then the
  round's frames made (`_outgoing`): each output to its request's next hop, the frames
  of all requests that share a hop together, with the prunes the round applied that
  came relayed (`_relayed`: on the request's frame there, or a frame of prunes only;
  docs/architecture.md, "6. Control plane and data plane"). The compute thread sends
  them itself where the transport keeps every frame's order (`_send_now`,
  `Transport.send_now`: no wake of the event loop, no turn); otherwise, or for what is
  left (a request that failed, a hop without a connection yet), the round is posted to
  the event loop (`HandOffs`: at most one wake per batch of rounds; a round of prunes
  only, all applied, has nothing to post), which sends it, and later rounds follow it
  there until it is delivered.

Where launches are asynchronous the next round is prepared between a round's launch
and its hand-off, so its host work overlaps the device's; on a CPU (the forward done at
launch) a round is handed off at once. A round that would miss requests expected within
a few milliseconds waits for them first, a bounded window (`StepAligner`,
common/runtime/alignment.py; `--batch-wait-ms`), which learns from the forward's device
time (`clock.device_timer`). A request that fails fails alone.

The stage service (`stage_service.py`) owns the requests, takes their work in (RPCs and
frames) and fails them; this module only computes and sends. It is one module because a
round's collection, its computation and its delivery share the round's `Work` (which
turns it took, sliced prefill included, and what each gave).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from specpipe.common.perf.clock import Elapsed, device_timer
from specpipe.common.perf.emulate import Deadline, Pacer, launched
from specpipe.common.runtime.alignment import StepAligner
from specpipe.common.runtime.errors import InvalidInput, RequestError
from specpipe.common.runtime.ordering import Pending, RequestOrder
from specpipe.common.runtime.stage import PreparedStep, StageRuntime
from specpipe.common.runtime.validation import (
    MAX_ROWS,
    host_finite,
    nonfinite,
    nonfinite_message,
)
from specpipe.common.runtime.verifier import RequestVerifier, row_tokens_of, verify_many
from specpipe.common.spec.messages import Activation, Prune, Verified
from specpipe.v1 import dataplane_pb2 as pb

from .control import verified_to_proto
from .metrics import StageMetrics
from .prefill_slices import Slice, joined, next_is_prefill, prefill_cells, rows_within, split_chunk
from .ratelog import RateLimitedLog
from .thread_handoff import HandOffs, ThreadInbox
from .transport import Transport, TransportError, encode
from .transport.codec import Kind, empty_header

log = logging.getLogger(__name__)
rlog = RateLimitedLog(log)
PROGRESS_SECONDS = 1.0  # a request's progress reports, at most one per this long
# Rounds computed and not yet delivered, at most: beyond, the compute thread waits for the
# event loop (a next hop that reads slowly holds the stage back, not its memory).
MAX_UNDELIVERED = 4
# A prune with no turn due waits for its request's next round, unless the KV pool's free
# blocks are below this share of it: then the blocks it drops may be needed (a request's
# next rows, another's admission), and it gets a round of its own at once.
PRUNE_RESERVE = 1 / 8


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
    # Relayed prunes (StageDescription.relay_prunes): each prune as received, until a
    # round applies it and passes it on to the next stage on the request's frames there
    # (under `inbox`; none on the last stage).
    to_relay: dict[int, pb.PruneSignal] = field(default_factory=dict)


@dataclass
class Work:
    """What one round does for one request: prunes to apply, then activations to run."""

    st: StageRequest
    prunes: list[tuple[int, Prune]]
    turns: list[tuple[int, Pending]]
    # one per turn: the next hop's activation, or (last stage, verifying) what it verified
    outputs: list[Activation | list[Verified] | None] = field(default_factory=list)
    error: RequestError | None = None
    relayed: list[pb.PruneSignal] = field(default_factory=list)  # its prunes, passed on
    # applied ahead of their turn for room someone waits for: the next stage does so too
    relay_now: bool = False


@dataclass
class Round:
    """One round on the compute thread, from its preparation to its hand-off."""

    work: list[Work]
    batch: list[tuple[Work, int]]  # (work, turn index) of every request not failed
    taken: list[tuple[Work, Activation]]  # the turns computed, in the forward's order
    step: PreparedStep | None = None
    outs: list | None = None  # the runtime's outputs, once launched
    elapsed: Elapsed = field(default_factory=Elapsed)  # the forward's, on its device
    done: Deadline | None = None  # an emulated device: when the forward ends
    failed: Exception | None = None  # the round failed as a whole (its forward)

    @property
    def acts(self) -> list[Activation]:
        return [a for _, a in self.taken]


# A round's hidden states up to this many values are checked as one tensor (`_all_finite`).
JOINED_CHECK_VALUES = 1 << 18


def _all_finite(hidden: list[torch.Tensor]) -> bool:
    """Whether a round's hidden states are all finite: host tensors each read through
    numpy (`host_finite`), else one reduction over them joined (a few tensor operations
    whatever the requests, against three per request for `nonfinite`, which then finds
    the request a failure belongs to). False where it cannot tell so cheaply: several
    devices or dtypes, or more than JOINED_CHECK_VALUES."""
    if not hidden:
        return True
    host = [host_finite(h) for h in hidden]
    if None not in host:
        return all(host)
    first = hidden[0]
    if len(hidden) > 1 and (
        sum(h.numel() for h in hidden) > JOINED_CHECK_VALUES
        or any(h.device != first.device or h.dtype != first.dtype for h in hidden)
    ):
        return False
    joined = first if len(hidden) == 1 else torch.cat([h.reshape(-1) for h in hidden])
    return bool(torch.isfinite(joined).all())


@dataclass
class Outgoing:
    """A round's frames by next hop, and the requests that failed making theirs (the
    event loop fails them: `StageService.fail` is the loop's)."""

    hops: dict[str, list[tuple[StageRequest, tuple]]] = field(default_factory=dict)
    failures: list[tuple[StageRequest, str]] = field(default_factory=list)


# What the compute thread posts to the event loop per round: its work, what failed it,
# and its frames where the thread made them (those it could not send itself).
Posted = tuple[list[Work], Exception | None, Outgoing | None]


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
    dict), on a compute thread of its own. `inbox` guards the requests, their orders and
    the stage's aligner: the event loop holds it to add work (then `wake`), the thread to
    take a round."""

    def __init__(self, stage: Stage, requests: dict[str, StageRequest]) -> None:
        self.stage = stage
        self.requests = requests
        self.inbox = ThreadInbox()
        self._stopped = True
        self._halt = threading.Event()  # set with `_stopped`: ends a wait in `_gather`
        self._held_since: float | None = None  # when the aligner began holding a round
        # a round's host work before its launch and at its hand-off, running means
        self._host_seconds = {"prepare": 0.0, "complete": 0.0}
        self._prefill_turn = 0  # rounds so far: whose prefill goes first (`_take_prefill`)
        # `apply_prunes` callers, told once a round applied every prune waiting now
        self._prunes_wanted: list[Callable[[], None]] = []
        self._prunes_taken: list[Callable[[], None]] = []  # the compute thread's, in hand
        self._thread: threading.Thread | None = None
        # rounds posted to the event loop (by the compute thread), delivered by the loop:
        # while one is undelivered, the thread sends nothing itself (`_send_now`,
        # `HandOffs.settled`, the draft's rule too)
        self._rounds: HandOffs[Posted | BaseException] | None = None
        # called on the compute thread before each forward (cpu_threads.stage_share: the
        # torch threads while the draft of this host works or idles)
        self.before_forward: Callable[[], object] = _nothing

    def wake(self) -> None:
        """New work arrived (an activation): the compute thread is told
        (`ThreadInbox.wake`: once per callback of the event loop)."""
        self.inbox.wake()

    def prune_arrived(self, st: StageRequest, now: bool = False) -> None:
        """A prune of `st` was queued (under `inbox`). The thread is told only where the
        prune changes what it can do now: `st`'s next activation was waiting for it, or
        the pool is short of blocks (`_prunes_due`), or it came relayed to be applied
        at once (`now`: a stage downstream waits for the room it frees). Otherwise the
        prune waits in `st`'s order and the request's next round applies it first (its
        next activation comes within a pipeline step, and every round applies every
        request's waiting prunes): a pipeline step then costs a stage one round, not a
        round of its prunes as well (at one client about 2 rounds in 5 were prunes only)."""
        if now and not self._stopped:  # (no thread to take it: a later `apply_prunes` does)
            self._prunes_wanted.append(_nothing)  # a round applies it, and relays it so
        if now or st.order.turn_ready() or self._prunes_due():
            self.inbox.wake()

    def relay_waiting_prunes(self) -> None:
        """Have the compute thread apply, between its rounds, the relayed prunes waiting
        here and pass them on to be applied at once at every later stage (`relay_now`),
        without waiting for it: a request is being opened on the stages after this one
        at the same time, and there those prunes free the room it needs (a later stage
        cannot ask this one: it does not know it). Not only while this stage's own pool is
        short (`_prunes_due`): a short pool applies its prunes as they arrive anyway, and
        a later stage can be full while this one has room; the cost is a round of prunes
        only per later stage, once per Open that finds relayed prunes waiting here."""
        with self.inbox:
            if self._stopped or not any(
                st.to_relay and st.order.next_prune() is not None
                for st in self.requests.values()
                if not st.closed
            ):
                return
            self._prunes_wanted.append(_nothing)
            self.inbox.notify()

    def _prunes_due(self) -> bool:
        """Whether waiting prunes should be applied without waiting for a turn: the KV
        pool has less than PRUNE_RESERVE of its blocks free, or someone waits for the
        blocks they free (`apply_prunes`)."""
        pool = self.stage.runtime.pool
        return bool(self._prunes_wanted) or pool.free_blocks < PRUNE_RESERVE * pool.max_blocks

    def prunes_waiting(self) -> bool:
        """Whether a prune that can be applied waits (under `inbox`)."""
        return any(
            st.order.next_prune() is not None for st in self.requests.values() if not st.closed
        )

    async def apply_prunes(self, timeout: float) -> None:
        """Apply every prune waiting now (a deferred prune holds its rows' KV blocks
        until then), on the compute thread, between its rounds as it applies any
        (a prune moves K/V rows, which a prepared round's inputs point at); waits at most
        `timeout` seconds for it. Without a compute thread (stopped), here."""
        with self.inbox:
            if not self.prunes_waiting():
                return
            if self._stopped:
                if self._thread is not None and self._thread.is_alive():
                    return  # stopping: its last round may still run
                work = self._collect(turns=False)
            else:
                loop = asyncio.get_running_loop()
                done = loop.create_future()
                self._prunes_wanted.append(lambda: loop.call_soon_threadsafe(_settled, done))
                self.inbox.notify()
        if self._stopped:  # a round of prunes only, here
            self.compute(work)
            await self._deliver(work)  # relayed prunes
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(done), timeout)

    async def run_forever(self) -> None:
        """Start the compute thread and deliver each round it posts, in order, until
        cancelled (the thread then stops after its round); a compute thread that died
        (a bug) ends this too, and the stage fails what it holds."""
        rounds = self._rounds = HandOffs(asyncio.get_running_loop())
        room = threading.Semaphore(MAX_UNDELIVERED)

        def post(item: Posted | BaseException) -> None:
            while not isinstance(item, BaseException) and not room.acquire(timeout=0.1):
                if self._stopped:
                    return
            rounds.put(item)

        self._stopped = False
        self._halt.clear()
        self._thread = threading.Thread(
            target=self._serve, args=(post,), name=f"{self.stage.name} rounds", daemon=True
        )
        self._thread.start()
        try:
            while True:
                item = await rounds.get()
                if isinstance(item, BaseException):
                    raise RuntimeError(f"{self.stage.name}: its compute thread died") from item
                await self._delivered(*item)
                rounds.delivered()
                room.release()
        finally:
            with self.inbox:
                self._stopped = True
                self._halt.set()
                self.inbox.notify()

    # -- on the compute thread ---------------------------------------------------------------
    def _serve(self, post: Callable[[Posted | BaseException], None]) -> None:
        """The compute thread: each round taken from the inbox as soon as it is ready;
        where launches are asynchronous, the next round prepared before the current one
        is handed off (module docstring)."""
        inflight: Round | None = None
        ready: Round | None = None
        try:
            while True:
                work = self._next_round(inflight is None, self._gather(inflight))
                if work is None and inflight is None:
                    return  # stopped
                ready = self._prepare(work) if work is not None else None
                self._prunes_applied()
                if inflight is not None:
                    self._hand_off(inflight, post)
                inflight, ready = ready and self._launch(ready), None
                if inflight is not None and not self.asynchronous:
                    self._hand_off(inflight, post)
                    inflight = None
        except BaseException as e:  # a bug: the stage fails every request it holds
            log.exception("%s: the compute thread failed", self.stage.name)
            if ready is not None and ready.step is not None:  # prepared, never launched
                self.stage.runtime.abandon_step(ready.step)
            post(e)

    @property
    def asynchronous(self) -> bool:
        """Whether a forward's launch returns before its device is done (an accelerator,
        or a device emulated by the pacer): then there is host work to overlap."""
        return self.stage.pacer is not None or self.stage.runtime.device.type != "cpu"

    def _gather(self, r: Round | None) -> float:
        """While round `r` runs on its device: let the next round's input gather until
        just before `r` ends (its preparation's time before, twice the recent mean), so
        the next round is as full as it would be taken after `r` and still prepared (and
        `r` completed) by then; returns how long `r` still runs."""
        rest = self._running_for(r)
        if (early := rest - 2 * sum(self._host_seconds.values())) > 0:
            self._halt.wait(early)  # the device is busy: nothing could start sooner
            rest = self._running_for(r)
        return rest

    def _took(self, part: str, start: float) -> None:
        mean = self._host_seconds[part]
        self._host_seconds[part] = mean + 0.2 * (time.perf_counter() - start - mean)

    @staticmethod
    def _running_for(r: Round | None) -> float:
        """How much longer round `r` runs on its device, as far as the host knows without
        waiting: an emulated device's rest of its modelled time; 0 otherwise (an
        accelerator's next round is taken if its input is there when this one launched)."""
        if r is None or r.done is None:
            return 0.0
        return max(r.done.at - r.done.clock(), 0.0)

    def _next_round(self, wait: bool, patience: float = 0.0) -> list[Work] | None:
        """The next round, from the inbox: None when stopped, or when none is ready within
        `patience` seconds and not `wait` (the round in flight is done by then). A round
        that the aligner holds (requests of the same step expected shortly) waits for
        them or for its window. Prunes alone make a round only while the pool is short
        of blocks (`prune_arrived`); otherwise the next round with a turn applies them."""
        until = time.perf_counter() + patience
        with self.inbox:
            while not self._stopped:
                hold = self._hold()
                if hold is None:  # nothing ready
                    self.stage.aligner.started()
                    self._held_since = None
                    if wait:
                        self.inbox.wait()
                    elif (rest := until - time.perf_counter()) > 0:
                        self.inbox.wait(rest)
                    else:
                        return None
                    continue
                if hold > 0:
                    self._held_since = self._held_since or time.perf_counter()
                    if self._prunes_due() and (work := self._collect(turns=False)):
                        return work
                    if wait:
                        self.inbox.wait(hold)
                    elif (rest := until - time.perf_counter()) > 0:
                        self.inbox.wait(min(hold, rest))
                    else:
                        return None
                    continue
                if self._held_since is not None:
                    self.stage.metrics.batch_wait.observe(time.perf_counter() - self._held_since)
                    self._held_since = None
                work = self._collect()
                self.stage.aligner.started([w.st.request_id for w in work if w.turns])
                if work:
                    return work
            return None

    def _prunes_applied(self) -> None:
        """Tell the `apply_prunes` callers whose prunes the round just prepared applied."""
        told, self._prunes_taken = self._prunes_taken, []
        for tell in told:
            tell()

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
        if not ready:  # prunes alone wait for a turn, unless blocks run short
            return 0.0 if prunes and self._prunes_due() else None
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
        wanted = bool(self._prunes_wanted)  # room is waited for: relayed prunes go on at once
        self._prunes_taken += self._prunes_wanted  # this round applies what they wait for
        self._prunes_wanted = []
        for st in live:
            order, prunes, taken = st.order, [], []
            while (ready := order.next_prune()) is not None:
                prunes.append(ready)
                order.prune_applied(ready[0])
            while turns and not next_is_prefill(order) and (turn := order.next_activation()):
                taken.append(turn)
            if prunes or taken:
                w = work[st.request_id] = Work(st, prunes, taken)
                if st.to_relay:
                    w.relayed = [p for seq, _ in prunes if (p := st.to_relay.pop(seq, None))]
                    w.relay_now = wanted
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
            w = work[st.request_id] = Work(st, [], [])
        w.turns.append(turn)

    def compute(self, work: list[Work]) -> float | None:
        """One round prepared, launched and completed on the calling thread (no event
        loop: tests, and callers that time a round); the forward's seconds on the device,
        pacing included (None without rows: a round of prunes only). Raises what failed
        the round as a whole."""
        return self._complete(self._launch(self._prepare(work)))

    def _prepare(self, work: list[Work]) -> Round:
        """A round's host work before its forward: the runtime's prunes (the verifier's
        wait for the hand-off, after the previous round's draws), the inputs' values
        checked, and the forward's inputs built (`StageRuntime.prepare_step`)."""
        start = time.perf_counter()
        runtime = self.stage.runtime
        # every request's prunes in one pass (one K/V copy for all)
        pruned = iter(runtime.prune_many([(w.st.request_id, p) for w in work for _, p in w.prunes]))
        for w in work:
            for _ in w.prunes:
                error = next(pruned)
                if error is not None:
                    w.error = w.error or error
        self._check_finite(work)
        batch = [(w, i) for w in work if w.error is None for i in range(len(w.turns))]
        r = Round(
            work, batch, [(w, w.turns[i][1].act) for w, i in batch if not w.turns[i][1].empty]
        )
        try:
            r.step = runtime.prepare_step(r.acts)
        except Exception as e:  # the batched forward itself failed: every request in it
            r.failed = e
        self._took("prepare", start)
        return r

    def _launch(self, r: Round) -> Round:
        """The round's forward, launched (on a CPU: computed)."""
        if r.step is None:
            return r
        stage = self.stage
        acts = r.acts
        device = stage.runtime.device
        try:
            self.before_forward()
            with stage.metrics.forward(sum(len(a) for a in acts)):
                if stage.pacer is None:
                    with device_timer(device) as r.elapsed:
                        r.outs = stage.runtime.run_step(r.step)
                else:  # the pacer times the forward itself (`_complete` reads its time)
                    with launched(stage.pacer, acts, device) as r.done:
                        r.outs = stage.runtime.run_step(r.step)
        except Exception as e:
            r.failed = e
        return r

    def _hand_off(self, r: Round, post: Callable[[Posted | BaseException], None]) -> None:
        """The round completed (`_complete`) and posted for the event loop to deliver,
        unless it has nothing to deliver: a round of prunes only that all applied (the
        rounds of a step's prunes, which arrive apart from its activations: at 1 client
        about 2 rounds in 5), which then costs the event loop no wake and no turn."""
        try:
            self._complete(r)
        except Exception as e:
            r.failed = e
        if r.failed is not None:
            post((r.work, r.failed, None))
            return
        if all(not w.turns and not w.relayed and w.error is None for w in r.work):
            return
        try:
            out = self._outgoing(r.work)
            left = self._send_now(out)
        except Exception as e:  # a bug making or sending its frames: this round's requests
            post((r.work, e, None))
            return
        if left:
            post((r.work, None, out))

    def _send_now(self, out: Outgoing) -> bool:
        """Send a round's frames from the compute thread where the transport can do that
        in order (`Transport.send_now`: every earlier round delivered, the connection
        idle), sparing the event loop a wake, a turn and the write (issue 34 point 4);
        whether anything is left for the loop (the hops not sent, failures)."""
        if not out.failures and (self._rounds is None or self._rounds.settled):
            transport, name = self.stage.transport, self.stage.name
            for hop in [h for h, items in out.hops.items() if items]:
                if not transport.send_now(hop, [f for _, f in out.hops[hop]], name):
                    break  # this hop and the rest by the loop, in order
                del out.hops[hop]
        return bool(out.failures or any(out.hops.values()))

    def _complete(self, r: Round) -> float | None:
        """The round's one wait for the device: the verifier's prunes and draws (last
        stage) and the outputs made ready to send (on an accelerator these wait for its
        work; an emulated device's modelled time, which covers them, is waited for
        after), then the forward's time learned (aligner, prefill pace)."""
        if r.failed is not None:
            raise r.failed
        start = time.perf_counter()
        stage = self.stage
        runtime = stage.runtime
        for w in r.work:
            if w.st.verifier is not None and w.error is None:
                try:
                    for _, prune in w.prunes:
                        w.st.verifier.on_prune(prune)
                except RequestError as e:
                    w.error = e
        assert r.outs is not None
        # the last stage's verification is part of its step (LM head and draws)
        results = iter(self._outputs(r.taken, r.outs))
        acts = r.acts
        rows = sum(len(a) for a in acts)
        seconds = r.done.seconds if r.done is not None and rows else r.elapsed.seconds
        if rows:
            stage.metrics.batch_requests.observe(len({a.request_id for a in acts}))
            cells = sum(prefill_cells(a) for a in acts if a.committed)
            decode_rows = sum(len(a) for a in acts if not a.committed)
            runtime.prefill_pace.observe(decode_rows, cells, seconds)
        for w in r.work:
            w.outputs = [None] * len(w.turns)
        for w, i in r.batch:
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
        if r.done is not None:  # the emulated device's work (verification included) ends
            self._took("complete", start)
            r.done.wait()
        if not rows:
            return None
        with self.inbox:
            stage.aligner.computed(seconds)
        return seconds

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
        if _all_finite([h for _, h in mine]):
            return
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
        t = out.hidden
        if t is None or t.device.type == "cpu":
            return out
        if self.stage.transport.host_payloads:
            out.hidden = t.cpu()
            return out
        out.hidden = t.contiguous()
        if t.device.type == "cuda":
            torch.cuda.current_stream(t.device).synchronize()
        return out

    # -- back on the event loop --------------------------------------------------------------
    async def _delivered(
        self, work: list[Work], failed: Exception | None, out: Outgoing | None = None
    ) -> None:
        """A round the compute thread handed off: its outputs sent (the frames the thread
        made, `out`, or else made here), or, where it failed as a whole (its forward, or a
        bug), every request in it failed, the others served on."""
        name = self.stage.name
        if failed is None:
            try:
                await self._send(out if out is not None else self._outgoing(work))
                return
            except Exception as e:
                failed = e
        rlog.error("batch", "%s: a round of %d requests failed: %s: %s",
                   name, len(work), type(failed).__name__, failed)  # fmt: skip
        log.debug("the round failed", exc_info=failed)
        for w in work:
            if not w.st.closed:
                self.stage.fail(w.st, f"{name} failed: {failed}")

    async def _deliver(self, work: list[Work]) -> None:
        """Send a round's outputs (made here)."""
        await self._send(self._outgoing(work))

    def _outgoing(self, work: list[Work]) -> Outgoing:
        """A round's frames: every request's in its order, by next hop (on the compute
        thread, or the loop)."""
        out = Outgoing()
        for w in work:
            for hop, frame in self._frames_of(w, out.failures):
                out.hops.setdefault(hop, []).append((w.st, frame))
        return out

    async def _send(self, out: Outgoing) -> None:
        """On the event loop: the requests that failed making their frames failed, then
        the frames of all requests that share a next hop sent together, as one frame where
        they fit (`Transport.send_many`). A hop that cannot be reached fails its requests
        alone. One hop (a stage's next, or the last stage's router: almost every round) is
        sent to without a task of its own."""
        for st, message in out.failures:
            self.stage.fail(st, message)
        by_hop = {hop: items for hop, items in out.hops.items() if items}
        if len(by_hop) == 1:
            ((hop, items),) = by_hop.items()
            await self._send_hop(hop, items)
            return
        await asyncio.gather(*(self._send_hop(hop, items) for hop, items in by_hop.items()))

    def _frames_of(
        self, w: Work, failures: list[tuple[StageRequest, str]]
    ) -> list[tuple[str, tuple]]:
        """(next hop, (header, payload)) of a request's outputs this round, in order; a
        request that fails instead goes to `failures`, with why (the event loop fails
        it: `_send`)."""
        st, name = w.st, self.stage.name
        if st.closed:
            return []
        if w.error is not None:
            failures.append((st, f"{name} failed: {w.error}"))
            return []
        outs: list[tuple[int, int, Activation | Verified | None]] = []
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
            failures.append((st, f"{name} failed: {type(e).__name__}: {e}"))
            return []
        sent = [(st.next_hop, f) for f in frames if f is not None]
        if w.relayed:
            sent = self._relayed(st, w, sent)
        return sent + self._progress(st, w, reported=any(h == st.report_to for h, _ in sent))

    def _relayed(
        self, st: StageRequest, w: Work, sent: list[tuple[str, tuple]]
    ) -> list[tuple[str, tuple]]:
        """The prunes this round applied for `st`, passed on to its next stage in this
        round's write there: on the request's first frame of the round (the receiver
        applies them before its activation, as here), else on a frame of their own
        (`prunes_only`, no turn), which joins the other requests' frames to that hop;
        with the router's address, which a stage that lost the request tells
        (`reply_to`), and applied there at once where room is waited for (`prunes_now`)."""
        if sent:
            header = sent[0][1][0]
        else:
            header = empty_header(st.request_id, 0, self.stage.name)
            header.prunes_only = True
            sent = [(st.next_hop, (header, None))]
        header.prunes.extend(w.relayed)
        header.prunes_now = w.relay_now
        header.reply_to = st.report_to
        return sent

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


def _nothing() -> None:
    """An `apply_prunes` caller that waits for nothing (`prune_arrived`, `now`)."""


def _settled(done: asyncio.Future) -> None:
    if not done.done():
        done.set_result(None)
