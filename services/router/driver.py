"""The network executor of one request (docs/architecture.md, "5. The request
controller and its executors"): its controller's events in, its commands out, over the
request's path.

There is no global step. Stage 1 receives feeds from here over gRPC; each stage computes
as soon as its input is ready and pushes it to the request's next hop; the last stage
verifies (draws the tokens and walks down the tree: common/runtime/verifier.py) and its
`Verification`s come back through the router's data-plane inbox. Events (frames, draft
answers, failures: events.py) are handled one at a time, in arrival order, so the
controller is never touched concurrently: while the request's task is parked waiting for
one, a verification or a draft's answer is handled at once where it arrives (the inbox's
or the draft lane's callback: no queue and no task wake-up per event, issue 34) and the
task wakes only to yield tokens, end, or raise; any other event (a failure, which may
replay), and every event that comes while one is being handled or the task is busy,
waits in its `EventQueue`. One timer per request wakes the parked task for a held
verification's end or the stall watch, moved only to an earlier time. The parts:

- `PathSession` (path_session.py) owns the path: which replicas, the wire id, the load
  claim, open, abandon, release;
- `CommandExecutor` (executor.py) turns the controller's commands into calls on it;
- `LateDraftHold` (late_draft.py) may hold a verification for a late draft answer;
- frames.py checks what a last stage sent.

This module is the loop between them, and the fault policy, as one module: both act on
the request's one serialized event order (a fault handled while a verification is, or
a replay beside an event, would break the controller), which one class keeps in one
place. Faults: when a replica on
the request's path dies or stops answering (a call fails UNAVAILABLE / NOT_FOUND / past
its timeout, a stage reports its next hop unreachable, the health monitor reports it
down, the request has waited `Backends.stall_seconds` for its path while a replica of it
answers no health check (stalled: SIGSTOP, a frozen host), or the path goes silent for
`stall_timeout` however healthy it looks, a stage that lost the request tells that
relayed prunes reached it, NOT_FOUND), the session releases it on the path and,
once the replicas confirmed (those that do not are left out), opens it on another path
of the same model version and the controller replays it (`Controller.replay`). Silence
is the absence of progress, not of tokens: each stage reports that it computed the
request at most once a second (an empty frame, `report_progress`), so a slow prefill of
a long prompt is not taken for a stall and replayed beside itself (issue 35, F1). A draft
that fails only makes the controller go on without it (`Controller.drop_draft`). With no
path left after `replay_timeout`, the request fails UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from specpipe.common.runtime.errors import InvalidInput
from specpipe.common.runtime.prefix_hash import NO_SCOPE, CacheScope
from specpipe.common.spec.commands import Command, Emit, Finish
from specpipe.common.spec.controller import Controller
from specpipe.common.spec.stats import DecodeStats

from ..config import (
    DEFAULT_LATE_DRAFT_WAIT_MS,
    DEFAULT_PATH_STALL_SECONDS,
    DEFAULT_REPLAY_SECONDS,
    RouterConfig,
)
from ..transport import FrameError, Inbox
from ..transport.codec import Frame, Kind
from .backends import Backend, Backends, RequestPath
from .calls import NO_LEASE, Deadline, DriverError, LeaseClaim
from .events import Event, EventQueue, Failure, HoldExpired, Proposal
from .frames import failure_of, verification_of
from .late_draft import LateDraftHold, StepWait
from .path_session import PathSession

log = logging.getLogger(__name__)
# Codes of a stage's failure frame after which the request is replayed: UNAVAILABLE (its
# next hop is unreachable), NOT_FOUND (relayed prunes reached a stage that lost it).
LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)


@dataclass(frozen=True)
class DriverSettings:
    """How long a request's calls and faults may take (seconds), the router's for all."""

    rpc_timeout: float = 60.0  # the longest one backend call may take
    open_timeout: float = 10.0  # the longest an Open may take (then another path)
    replay_timeout: float = DEFAULT_REPLAY_SECONDS  # how long a replay waits for a path
    max_replays: int = 8  # replays of one request before it fails
    # how long a path may make no progress (no frame: no verification, no stage's report
    # that it computed the request) before the request is replayed
    stall_timeout: float = DEFAULT_PATH_STALL_SECONDS
    # late_draft.py: seconds (0: never hold), or None: one measured step (a StepWait)
    late_draft_wait: float | StepWait | None = DEFAULT_LATE_DRAFT_WAIT_MS

    @classmethod
    def of(cls, config: RouterConfig) -> DriverSettings:
        """A router configuration's (--replay-seconds, --max-replays,
        --path-stall-seconds, --late-draft-wait-ms); the call timeouts are fixed."""
        wait_ms = config.scheduling.late_draft_wait_ms  # None: one StepWait for all requests
        return cls(
            replay_timeout=config.replay_seconds,
            stall_timeout=config.path_stall_seconds,
            max_replays=config.max_replays,
            late_draft_wait=StepWait() if wait_ms is None else wait_ms / 1e3,
        )


class RequestDriver:
    def __init__(
        self,
        controller: Controller,
        backends: Backends,
        path: RequestPath,
        router_address: str,
        inbox: Inbox,
        settings: DriverSettings = DriverSettings(),
        deadline: float | None = None,
        lease: LeaseClaim = NO_LEASE,
        vocab_size: int | None = None,
        on_replay: Callable[[RequestDriver, float], None] | None = None,
        cache_scope: CacheScope = NO_SCOPE,
    ) -> None:
        """`deadline`: the client's, on time.monotonic() (None: none); `vocab_size`: the
        vocabulary verified tokens must be in; `on_replay`: told each replay's seconds;
        `cache_scope`: the prefix-cache scope of its blocks on every replica."""
        self.controller, self.backends, self.settings = controller, backends, settings
        self.request_id = controller.request_id
        self.deadline = Deadline(deadline, settings.rpc_timeout)
        self.vocab_size = vocab_size
        self.on_replay = on_replay
        self.events = EventQueue()  # events that wait for the driver's task
        self.session = PathSession(
            controller, backends, path, router_address, inbox, self._post,
            self.deadline, lease, settings.open_timeout, settings.replay_timeout, cache_scope,
        )  # fmt: skip
        self.hold = LateDraftHold(controller, settings.late_draft_wait)
        self.t_start = time.monotonic()
        self.token_times: list[float] = []
        # Prompt tokens the first path had cached (not prefilled again): usage's
        # cached_tokens, the prefix-cache hits of the router's metrics.
        self.cached_tokens = 0
        self.replay_seconds: list[float] = []  # time from each fault to the re-opened path
        # The step's service overhead and the router's CPU per step (metrics): when the
        # last stage sent the verification being handled (unix ns; 0: none), which
        # stage 1 gets with the feeds it gives.
        self._verified_at = 0
        self.on_step_cpu: Callable[[float], None] | None = None
        # What handling events gave the task to do: tokens to yield (one list per Emit),
        # the end, an error to raise; whether an event is being handled.
        self._emitted: deque[list[int]] = deque()
        self._finished = False
        self._error: Exception | None = None
        self._handling = False
        self._quiet_since = time.monotonic()  # the last event (the stall watch)
        self._timer: asyncio.TimerHandle | None = None  # wakes the parked task
        self._timer_at = math.inf
        self.on_opened: Callable[[RequestDriver], None] | None = None  # first path open
        # Where verified tokens go as they are emitted, from the callback that handled
        # the verification (a front end that writes them there: no task wake per
        # emission, issue 34); None: `run` yields them.
        self.on_tokens: Callable[[list[int]], None] | None = None

    # -- what the service reads ----------------------------------------------------------
    @property
    def stats(self) -> DecodeStats:
        return self.controller.stats

    @property
    def finish_reason(self) -> str:
        return self.controller.out.finish_reason

    @property
    def path(self) -> RequestPath:
        return self.session.path

    @property
    def wire_id(self) -> str:
        """The request's id on its current path."""
        return self.session.wire_id

    @property
    def holding(self) -> bool:
        """Whether the request is open on its current path (what the backends hold)."""
        return self.session.holding

    @property
    def waiting(self) -> bool:
        """Opening a path (first or replayed), not producing tokens."""
        return self.session.waiting

    def logprobs_of(self, index: int, tokens: list[int]) -> list:
        """The logprobs of the output's tokens from `index` (none without them)."""
        return self.controller.out.logprobs_at(index, len(tokens))

    def timing(self) -> tuple[float, float]:
        """(time to first token, mean time between tokens), in milliseconds."""
        if not self.token_times:
            return 0.0, 0.0
        ttft = (self.token_times[0] - self.t_start) * 1e3
        n = len(self.token_times)
        tbt = (self.token_times[-1] - self.token_times[0]) * 1e3 / (n - 1) if n > 1 else 0.0
        return ttft, tbt

    # -- public ------------------------------------------------------------------------
    async def run(self) -> AsyncIterator[list[int]]:
        """Open the request on its path, then yield verified tokens as they come (or
        hand them to `on_tokens`: then it yields none)."""
        ctrl = self.controller
        ctrl.cached_prefix = await self.session.open(first=True)
        self.cached_tokens = ctrl.cached_prompt_tokens
        if self.on_opened is not None:
            self.on_opened(self)
        if ctrl.uses_draft and self.session.draft is None:
            ctrl.drop_draft()  # no draft is up: the request runs as pp
        try:
            self._apply(ctrl.start())
            while True:
                if self.on_tokens is not None:
                    self._hand_on()
                while self._emitted:
                    yield self._emitted.popleft()
                if self._finished:
                    return
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                ev = await self._next_event()
                if ev is None:
                    continue  # woken for what events handled at once gave
                cpu = self._cpu_now(ev)
                self._handling = True
                try:
                    self._apply(await self._handle(ev), cpu)
                finally:
                    self._handling = False
        finally:
            self._stop_timer()

    def backend_down(self, b: Backend, message: str) -> None:
        """The health monitor found `b` down, or `b` no longer holds this request (its
        lease): replay if it is on this request's path; a path being opened with `b` on
        it is given up at once."""
        if self.session.holds(b):
            self.events.put_nowait(
                Failure(self.session.attempt, grpc.StatusCode.UNAVAILABLE,
                        f"{b.label} went down: {message}", b, replayable=True)
            )  # fmt: skip
        else:
            self.session.lost_while_opening(b, message)

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """Called from outside (router shutdown): fail the request at the next event."""
        self.events.put_nowait(Failure(self.session.attempt, code, message))

    async def release(self) -> None:
        """Free the request's state on every stage and the draft (best effort)."""
        await self.session.release()

    # -- events ----------------------------------------------------------------------------
    def _post(self, ev: Event) -> None:
        """Where the request's frames, draft answers and call failures go: handled at
        once where the task is parked waiting for an event and none needs an await (a
        verification, a progress report, a draft's answer), else queued for the task.
        Either way one at a time and in arrival order: the task is parked only while no
        event is being handled or waits."""
        if (
            self.events.parked
            and not self._handling
            and not self._finished
            and self._error is None
            and _at_once(ev)
        ):
            self._handle_now(ev)
        else:
            self.events.put_nowait(ev)

    def _handle_now(self, ev: Frame | Proposal) -> None:
        """Handle `ev` outside the task (which stays parked unless it has tokens to
        yield, the end, or an error to raise)."""
        cpu = self._cpu_now(ev)
        self._handling = True
        try:
            self._apply(self._handle_sync(ev), cpu)
        except Exception as e:  # raised by the task, as if it had handled the event
            self._error = e
        finally:
            self._handling = False
        self._quiet_since = time.monotonic()
        if self._emitted and self.on_tokens is not None and self._error is None:
            try:
                self._hand_on()
            except Exception as e:  # raised by the task, as if it had handed them on
                self._error = e
        if self._emitted or self._finished or self._error is not None:
            self.events.wake()
        elif self.hold.until is not None:
            self._arm(self.hold.until)  # a verification held: the task wakes at its end

    def _hand_on(self) -> None:
        """The tokens emitted so far, in order, to `on_tokens`."""
        assert self.on_tokens is not None
        while self._emitted:
            self.on_tokens(self._emitted.popleft())

    def _apply(self, cmds: list[Command], cpu: float | None = None) -> None:
        """Carry out the commands of one event (`cpu`: the thread time its handling
        began): tokens to yield, calls started."""
        executor = self.session.executor
        for cmd in cmds:
            if isinstance(cmd, Emit):
                self.token_times.extend([time.monotonic()] * len(cmd.tokens))
                self._emitted.append(cmd.tokens)
            elif isinstance(cmd, Finish):
                self._finished = True
                return
            else:
                assert executor is not None
                executor.execute(cmd, self._verified_at)
        self.session.count_rows(self.controller.rows_in_flight)
        if self._verified_at and cpu is not None and self.on_step_cpu is not None:
            self.on_step_cpu(time.thread_time() - cpu)  # a verification: decisions, calls
        self._verified_at = 0

    def _cpu_now(self, ev: Event) -> float | None:
        """The thread's CPU time where the step's CPU is measured: a frame (maybe a
        verification) with the metric on (a system call: not for every event)."""
        if self.on_step_cpu is None or not isinstance(ev, Frame):
            return None
        return time.thread_time()

    async def _next_event(self) -> Event | None:
        """The next queued event (None: the task was woken for what events handled at
        once while it waited gave); or, while none comes, a failure once a replica of
        the path is stalled or the path was silent for `stall_timeout`, or `HoldExpired`
        once a held verification may wait no longer."""
        events = self.events
        if events and self.hold.until is None:
            return events.get_nowait()  # the common case: no timer, no wait
        self._quiet_since = time.monotonic()
        stall = self.backends.stall_seconds
        stall_timeout = self.settings.stall_timeout
        while True:
            now, started = time.monotonic(), self._quiet_since
            # replicas are looked at once the path was quiet `stall`, then every stall/4
            look = started + stall if now < started + stall else now + max(stall / 4, 0.01)
            wake = min(look, started + stall_timeout)
            until = self.hold.until
            if until is not None:
                wake = min(wake, until)
            if wake > now:
                if not events:
                    self._arm(wake)
                    await events.wait()  # meanwhile events are handled at once (_post)
                # what an event handled at once gave goes first (tokens to the client,
                # the end, an error): a queued event comes after it, as in arrival order
                if self._emitted or self._finished or self._error is not None:
                    return None
                if events:
                    return events.get_nowait()
            now, started, until = time.monotonic(), self._quiet_since, self.hold.until
            if until is not None and now >= until:
                return HoldExpired()
            if now - started >= stall:
                stalled = self.session.stalled_replica(now)
                if stalled is not None:
                    return stalled
            if now - started >= stall_timeout:
                return Failure(
                    self.session.attempt,
                    grpc.StatusCode.UNAVAILABLE,
                    f"the path ({', '.join(b.label for b in self.path.stages)}) made no "
                    f"progress for {stall_timeout:.0f} s",
                    replayable=True,
                )

    def _arm(self, at: float) -> None:
        """Wake the parked task at `at` (time.monotonic()) at the latest: one timer per
        request, moved only to an earlier time (one armed earlier wakes the task early,
        which looks again), so that events coming steadily set none."""
        if self._timer is not None:
            if self._timer_at <= at:
                return
            self._timer.cancel()
        self._timer_at = at
        delay = max(at - time.monotonic(), 0.0)
        self._timer = asyncio.get_running_loop().call_later(delay, self._ring)

    def _ring(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self.events.wake()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, math.inf

    async def _handle(self, ev: Event) -> list[Command]:
        """A queued event (the task's)."""
        if _at_once(ev):
            return self._handle_sync(ev)  # type: ignore[arg-type]
        if isinstance(ev, Frame):
            cmds = await self._on_failed_frame(ev)
        elif isinstance(ev, Failure):
            cmds = await self._on_failure(ev)
        else:
            cmds = []  # HoldExpired: settled below
        return cmds + self.hold.settle(time.monotonic(), isinstance(ev, HoldExpired))

    def _handle_sync(self, ev: Frame | Proposal) -> list[Command]:
        """An event that needs no await: a frame that reports no failure, a draft's
        answer."""
        if isinstance(ev, Frame):
            cmds = self._on_frame(ev)
        elif ev.attempt == self.session.attempt:
            draft = self.path.draft
            if draft is not None:
                draft.progressed_at = time.monotonic()  # it answers (backends._due)
            cmds = self.controller.on_candidates(ev.ticket, ev.cand)
        else:
            cmds = []  # an answer for an earlier path
        return cmds + self.hold.settle(time.monotonic())

    def _on_frame(self, frame: Frame) -> list[Command]:
        if frame.request_id != self.session.wire_id:
            return []  # a frame of an earlier path
        if frame.kind == Kind.PAYLOAD_KIND_EMPTY:
            return []  # a stage computing the request (report_progress): not stalled
        try:
            v = verification_of(frame, self.controller, self.vocab_size)
        except (FrameError, InvalidInput, ValueError) as e:
            raise DriverError(
                grpc.StatusCode.INTERNAL, f"bad frame from {frame.header.sender}: {e}"
            ) from None
        self._verified_at = frame.header.verified.sent_at_ns or 0
        now = time.monotonic()
        for b in self.path.stages:  # each of them computed it (backends._due)
            b.progressed_at = now
        return self.hold.verified(v, now)

    async def _on_failed_frame(self, frame: Frame) -> list[Command]:
        """A stage reports that it failed the request."""
        if frame.request_id != self.session.wire_id:
            return []  # a frame of an earlier path
        code, message = failure_of(frame) or (grpc.StatusCode.INTERNAL, "failed")
        if code in LOST and not self.deadline.passed():
            return await self._replay(None, message)
        self.controller.on_failure(message)
        raise DriverError(code, message)

    async def _on_failure(self, ev: Failure) -> list[Command]:
        if ev.attempt != self.session.attempt:
            return []  # from an earlier path
        if ev.backend is not None and ev.backend.kind == "draft":
            if ev.backend is not self.session.draft:
                return []
            if self.deadline.passed():
                raise DriverError(grpc.StatusCode.DEADLINE_EXCEEDED, ev.message)
            return self._lose_draft(ev.message)
        if ev.replayable and not self.deadline.passed():
            return await self._replay(ev.backend, ev.message)
        self.controller.on_failure(ev.message)
        raise DriverError(ev.code, ev.message)

    # -- faults ----------------------------------------------------------------------------
    async def _replay(self, failed: Backend | None, message: str) -> list[Command]:
        """Re-open the request on another path of its version; the controller's replay."""
        t0 = time.monotonic()
        ctrl, max_replays = self.controller, self.settings.max_replays
        if len(self.replay_seconds) >= max_replays:
            ctrl.on_failure(message)
            raise DriverError(
                grpc.StatusCode.UNAVAILABLE,
                f"{message} (given up after {max_replays} replays of this request)",
            )
        log.warning("%s: %s; replaying on another path", self.request_id, message)
        self.hold.drop()  # held verifications are the old path's
        # Only where the first copy is released (or its replica gone): never beside it.
        excluded = await self.session.leave_for_replay(failed, message)
        try:
            ctrl.cached_prefix = await self.session.open(excluded)
        except DriverError as e:
            ctrl.on_failure(e.message)
            raise DriverError(e.code, f"{message}; {e.message}") from None
        cmds = ctrl.replay(uses_draft=self.session.draft is not None)
        self.replay_seconds.append(time.monotonic() - t0)
        if self.on_replay is not None:
            self.on_replay(self, self.replay_seconds[-1])
        log.info(
            "%s replayed on %s (%d tokens so far)",
            self.request_id, ", ".join(b.label for b in self.path.backends),
            len(ctrl.tokens),
        )  # fmt: skip
        return cmds

    def _lose_draft(self, message: str) -> list[Command]:
        """The draft failed: release it and let the controller go on without it."""
        log.warning("%s: %s; going on without the draft", self.request_id, message)
        self.session.drop_draft(message)
        return self.controller.drop_draft()


def _at_once(ev: Event) -> bool:
    """Whether handling `ev` needs no await (a replay may): a draft's answer, a frame
    that reports no failure."""
    return isinstance(ev, Proposal) or (
        isinstance(ev, Frame) and ev.kind != Kind.PAYLOAD_KIND_ERROR
    )
