"""The network executor of one request: the request controller's commands carried out
over gRPC and the data plane (docs/architecture.md, "5. The request controller and its
executors").

There is no global step. Stage 1 receives feeds from here over gRPC; each stage computes
as soon as its input is ready and pushes it to the request's next hop; the last stage
verifies (draws the tokens and walks down the tree: common/runtime/verifier.py) and its
`Verification`s come back through the router's data-plane inbox (a last stage that
predates verification sends logits, which the controller walks the same way). Events
(verifications, draft answers, failures) are handled one at a time from one queue, so the controller is never touched
concurrently. Draft calls of a request run in one ordered lane, so the draft sees prunes
and layers in the order the controller created them; prunes for the draft ride on the
next `Propose`. Every decision is the controller's: this module only moves commands and
events, keeps deadlines and maps failures to statuses.

Faults: when a replica on the request's path dies or stops answering (a call fails
UNAVAILABLE / NOT_FOUND / past its timeout, a stage reports its next hop unreachable,
the health monitor reports it down, the request has waited `Backends.stall_seconds`
for its path while a replica of it answers no health check (stalled: SIGSTOP, a frozen
host), or the path goes silent for `stall_timeout` however healthy it looks), the
driver picks another path of the same model version from `Backends`, opens the request
there under a new wire id (`<id>~<attempt>`: nothing of the old path can reach the new
one) and executes `Controller.replay`. A draft that fails only makes the controller go on
without it (`Controller.drop_draft`). With no path left after `replay_timeout`, the
request fails UNAVAILABLE.

A late draft (`late_draft_wait`): when the last stage's verification of a root arrives
before the draft has answered for a layer that lockstep would have grown by then
(`Controller.draft_is_late_for`), the driver may hold it up to that long for
the answer, so the tree keeps the layer (lockstep's schedule: the step waits for the
draft) instead of the verification passing it by (a miss or a regrowth, and no wait).
Either way the tokens are the same; which is faster depends on how late drafts are.

One module: every command and event of one request goes through one object and one
queue, so that the controller is never touched concurrently (a path session and a
command executor apart are issue 25).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
import torch
from specpipe.common.runtime.errors import InvalidInput
from specpipe.common.runtime.validation import check_payload
from specpipe.common.spec.commands import (
    BroadcastPrune,
    Command,
    DraftOpen,
    DraftPrefill,
    DraftPrune,
    Emit,
    Feed,
    Finish,
    Propose,
)
from specpipe.common.spec.controller import Controller
from specpipe.common.spec.messages import Candidates, Verified
from specpipe.common.spec.stats import DecodeStats
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, stage_pb2

from ..control import (
    prune_to_proto,
    rows_to_proto,
    verified_from_proto,
    verify_spec_to_proto,
)
from ..grpc_util import code_from_number
from ..transport import FrameError, Inbox, decode
from ..transport.codec import Kind
from .backends import Backend, Backends, NoPath, RequestPath

log = logging.getLogger(__name__)
LOGIT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

# Codes of a backend call that mean "this replica is gone or lost the request" (a
# restarted stage answers NOT_FOUND): the request is replayed on another path.
REPLAYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.NOT_FOUND,
)
# Open refusals after which another path is tried.
RETRY_OPEN = (*REPLAYABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class DriverError(Exception):
    """The request failed; `code` is the gRPC status the client receives."""

    def __init__(self, code: grpc.StatusCode, message: str, replayable: bool = False) -> None:
        super().__init__(message)
        self.code, self.message, self.replayable = code, message, replayable


@dataclass
class _Proposal:
    attempt: int
    ticket: int
    cand: Candidates


@dataclass
class _Failure:
    attempt: int
    code: grpc.StatusCode
    message: str
    backend: Backend | None = None  # which replica failed, when known
    replayable: bool = False


def backend_error(b: Backend, what: str, e: BaseException) -> DriverError:
    """A failed call to a backend, as the status the client should see."""
    if isinstance(e, DriverError):
        return e
    if isinstance(e, grpc.aio.AioRpcError):
        code = e.code()
        replayable = code in REPLAYABLE
        passthrough = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return DriverError(
                grpc.StatusCode.UNAVAILABLE,
                f"{b.label} is unavailable ({what}): {e.details()}",
                replayable,
            )
        if code in passthrough:
            return DriverError(code, f"{b.label}: {e.details()}")
        return DriverError(
            grpc.StatusCode.INTERNAL,
            f"{b.label} failed {what}: {code.name}: {e.details()}",
            replayable,
        )
    return DriverError(grpc.StatusCode.INTERNAL, f"{b.label} failed {what}: {e!r}")


class RequestDriver:
    def __init__(
        self,
        controller: Controller,
        backends: Backends,
        path: RequestPath,
        router_address: str,
        inbox: Inbox,
        rpc_timeout: float = 60.0,
        deadline: float | None = None,
        replay_timeout: float = 10.0,
        max_replays: int = 8,
        open_timeout: float = 10.0,
        stall_timeout: float = 60.0,
        on_replay: Callable[[RequestDriver, float], None] | None = None,
        vocab_size: int | None = None,
        lease: tuple[str, int, bytes] = ("", 0, b""),
        late_draft_wait: float = 0.0,
    ) -> None:
        self.controller, self.backends = controller, backends
        self.request_id = controller.request_id
        self.router_address = router_address
        self.inbox = inbox
        self.max_rpc_timeout = rpc_timeout
        self.deadline = deadline  # the client's, on time.monotonic(); None: no deadline
        self.replay_timeout, self.max_replays = replay_timeout, max_replays
        self.open_timeout, self.stall_timeout = open_timeout, stall_timeout
        self.on_replay = on_replay
        self.version = path.version  # a request stays on one model version
        self.path: RequestPath = path
        self._first_path: RequestPath | None = path
        self.draft: Backend | None = None
        self.attempt = 0
        self.wire_id = self.request_id  # the request's id on the current path
        self.events: asyncio.Queue = inbox.open(self.wire_id, controller.tree_rows)
        self._holding = False  # the current path's backends count this request
        self._rows = 0  # rows in flight counted on the current path's stages
        self.vocab_size = vocab_size  # the width of every logits frame
        # The router's name, process epoch and lease token (common/runtime/lease.py).
        self.lease_owner, self.lease_epoch, self.lease_token = lease
        # A replica of the path being opened went down: (replica, message); see backend_down.
        self._opening_path: RequestPath | None = None
        self._opening: asyncio.Future | None = None
        self._down_while_opening: tuple[Backend, str] | None = None
        self._tasks: set[asyncio.Task] = set()
        self._background: set[asyncio.Task] = set()
        self._draft_q: asyncio.Queue = asyncio.Queue()
        self._draft_prunes: list[pb.PruneSignal] = []  # for the draft, sent with the next layer
        self._lane: asyncio.Task | None = None
        self.t_start = time.monotonic()
        self.token_times: list[float] = []
        self.replay_seconds: list[float] = []  # time from each fault to the re-opened path
        self.waiting = True  # opening a path (first or replayed), not producing tokens
        # Logits held for a late draft answer (in arrival order) and until when.
        self.late_draft_wait = late_draft_wait
        self._parked: list = []
        self._parked_until = 0.0
        # The step's service overhead and the router's CPU per step (metrics): when the
        # last stage sent the verification being handled (unix ns; 0: none), which
        # stage 1 gets with the feeds it gives; the thread CPU time its handling began.
        self._verified_at = 0
        self._step_cpu: float | None = None
        self.on_step_cpu: Callable[[float], None] | None = None

    @property
    def stats(self) -> DecodeStats:
        return self.controller.stats

    @property
    def finish_reason(self) -> str:
        return self.controller.out.finish_reason

    @property
    def rpc_timeout(self) -> float:
        """Timeout of the next backend call: what is left of the client's deadline, at
        most `max_rpc_timeout`. A call that outlives the client only keeps a stage busy."""
        if self.deadline is None:
            return self.max_rpc_timeout
        return min(self.max_rpc_timeout, max(self.deadline - time.monotonic(), 0.01))

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline - 0.05

    def _error(self, b: Backend, what: str, e: BaseException) -> DriverError:
        """A backend call's failure; a call cut short by the client's deadline says so."""
        err = backend_error(b, what, e)
        if (
            isinstance(e, grpc.aio.AioRpcError)
            and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            and self._past_deadline()
        ):
            return DriverError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"the deadline passed while {what} on {b.label}"
            )
        return err

    # -- public ------------------------------------------------------------------------
    async def run(self) -> AsyncIterator[list[int]]:
        """Open the request on its path, then yield verified tokens as they come."""
        ctrl = self.controller
        await self._open(set(), first=True)
        if ctrl.uses_draft and self.draft is None:
            ctrl.drop_draft()  # no draft is up: the request runs as pp
        cmds = ctrl.start()
        while True:
            for cmd in cmds:
                if isinstance(cmd, Emit):
                    self.token_times.extend([time.monotonic()] * len(cmd.tokens))
                    yield cmd.tokens
                elif isinstance(cmd, Finish):
                    return
                else:
                    self._execute(cmd)
            self._count_rows()
            if self._step_cpu is not None:  # a verification handled: its decisions and calls
                if self.on_step_cpu is not None:
                    self.on_step_cpu(time.thread_time() - self._step_cpu)
                self._step_cpu = None
            self._verified_at = 0
            ev = await self._next_event()
            cpu = time.thread_time()
            cmds = await self._handle(ev)
            if self._verified_at:
                self._step_cpu = cpu

    def logprobs_of(self, index: int, tokens: list[int]) -> list:
        """The logprobs of the output's tokens from `index` (none without them)."""
        return self.controller.out.logprobs[index : index + len(tokens)]

    def backend_down(self, b: Backend, message: str) -> None:
        """The health monitor found `b` down, or `b` no longer holds this request (its
        lease): replay if it is on this request's path. A path still being opened is
        given up at once (an Open may wait long on a stage that froze)."""
        if b in self.path.backends and self._holding:
            self.events.put_nowait(
                _Failure(self.attempt, grpc.StatusCode.UNAVAILABLE, f"{b.label} went down: {message}",
                         b, replayable=True)
            )  # fmt: skip
        elif (
            self._opening is not None
            and self._opening_path is not None
            and b in self._opening_path.stages
            and not self._opening.done()
        ):
            self._down_while_opening = (b, message)
            self._opening.cancel()

    def _verification(self, frame) -> Verified | None:
        """What a last stage's frame verified, checked: a `Verification`, or logits
        ([rows, vocab] floats, finite; a last stage that predates verification) walked
        by the controller. None: logits of no current root (stale)."""
        ctrl = self.controller
        if frame.kind == Kind.PAYLOAD_KIND_VERIFIED:
            return verified_from_proto(
                self.wire_id,
                frame.header.verified,
                ctrl.tree_rows,
                self.vocab_size,
                ctrl.opts.logprobs is not None,
            )
        act = decode(frame) if frame.kind == Kind.PAYLOAD_KIND_LOGITS else None
        if act is None or act.logits is None:
            raise FrameError(f"the router takes verifications, not frames of kind {frame.kind}")
        x = act.logits
        vocab = self.vocab_size or (x.shape[-1] if x.ndim else 0)
        check_payload(x, len(act), vocab, LOGIT_DTYPES, "logits")
        return ctrl.verification_of(act)

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """Called from outside (router shutdown): fail the request at the next event."""
        self.events.put_nowait(_Failure(self.attempt, code, message))

    async def release(self) -> None:
        """Free the request's state on every stage and the draft (best effort)."""
        self._stop_tasks()
        self.inbox.close(self.wire_id)
        if self._holding:
            await self._release_path(self.path, self.draft, self.wire_id)
            self._let_go()
        if self._background:
            await asyncio.wait(self._background, timeout=5.0)

    @property
    def holding(self) -> bool:
        """Whether the request is open on its current path (what the backends hold)."""
        return self._holding

    def timing(self) -> tuple[float, float]:
        """(time to first token, mean time between tokens), in milliseconds."""
        if not self.token_times:
            return 0.0, 0.0
        ttft = (self.token_times[0] - self.t_start) * 1e3
        n = len(self.token_times)
        tbt = (self.token_times[-1] - self.token_times[0]) * 1e3 / (n - 1) if n > 1 else 0.0
        return ttft, tbt

    # -- events ----------------------------------------------------------------------------
    async def _next_event(self):
        """The next event; or, while none comes, a failure once a replica of the path
        is stalled or the path was silent for `stall_timeout`; or None once logits held
        for a late draft may wait no longer."""
        started = time.monotonic()
        stall = self.backends.stall_seconds
        while True:
            now = time.monotonic()
            wait = min(started + self.stall_timeout - now, max(stall / 4, 0.01))
            if self._parked:
                wait = min(wait, self._parked_until - now)
            try:
                return await asyncio.wait_for(self.events.get(), max(wait, 0.0))
            except TimeoutError:
                pass
            now = time.monotonic()
            if self._parked and now >= self._parked_until:
                return None  # the late-draft wait is over: verify without the answer
            if now - started >= stall:
                stalled = self._stalled_replica(now)
                if stalled is not None:
                    return stalled
            if now - started >= self.stall_timeout:
                return _Failure(
                    self.attempt,
                    grpc.StatusCode.UNAVAILABLE,
                    f"the path ({', '.join(b.label for b in self.path.stages)}) did not "
                    f"answer for {self.stall_timeout:.0f} s",
                    replayable=True,
                )

    def _stalled_replica(self, now: float) -> _Failure | None:
        """A replica of the path that answers nothing while the request waits on it:
        dead for this request (replayed elsewhere, or the draft dropped, as on a kill)."""
        if not self._holding:
            return None
        for b in self.path.backends:
            quiet = self.backends.stalled_for(b, now)
            if quiet >= self.backends.stall_seconds:
                return _Failure(
                    self.attempt,
                    grpc.StatusCode.UNAVAILABLE,
                    f"{b.label} stalled: no answer for {quiet:.1f} s",
                    b,
                    replayable=True,
                )
        return None

    async def _handle(self, ev) -> list[Command]:
        cmds = await self._handle_event(ev)
        if self._parked and (
            ev is None
            or time.monotonic() >= self._parked_until
            or not self.controller.draft_is_late_for(self._parked[0])
        ):
            cmds += self._unpark()
        return cmds

    def _verify(self, v: Verified) -> list[Command]:
        """A verification to the controller, or held while the draft is late (see the
        module docstring); verifications that come while others are held queue behind."""
        ctrl = self.controller
        if self._parked:
            self._parked.append(v)
            return []
        if self.late_draft_wait > 0 and ctrl.draft_is_late_for(v):
            self._parked, self._parked_until = [v], time.monotonic() + self.late_draft_wait
            return []
        return ctrl.on_verified(v)

    def _unpark(self) -> list[Command]:
        parked, self._parked = self._parked, []
        return [cmd for v in parked for cmd in self.controller.on_verified(v)]

    async def _handle_event(self, ev) -> list[Command]:
        ctrl = self.controller
        if ev is None:
            return []  # the late-draft wait ran out
        if isinstance(ev, _Proposal):
            return ctrl.on_candidates(ev.ticket, ev.cand) if ev.attempt == self.attempt else []
        if isinstance(ev, _Failure):
            if ev.attempt != self.attempt:
                return []  # from an earlier path
            if ev.backend is not None and ev.backend.kind == "draft":
                if ev.backend is not self.draft:
                    return []
                if self._past_deadline():
                    raise DriverError(grpc.StatusCode.DEADLINE_EXCEEDED, ev.message)
                return self._lose_draft(ev.message)
            if ev.replayable and not self._past_deadline():
                return await self._replay(ev.backend, ev.message)
            ctrl.on_failure(ev.message)
            raise DriverError(ev.code, ev.message)
        if ev.request_id != self.wire_id:
            return []  # a frame of an earlier path
        if ev.kind == Kind.PAYLOAD_KIND_ERROR:
            code = code_from_number(ev.header.error_code or grpc.StatusCode.INTERNAL.value[0])
            message = ev.header.error or f"{ev.header.sender} failed"
            if code == grpc.StatusCode.UNAVAILABLE and not self._past_deadline():
                return await self._replay(None, message)  # a next hop is unreachable
            ctrl.on_failure(message)
            raise DriverError(code, message)
        if ev.kind == Kind.PAYLOAD_KIND_VERIFIED:
            self._verified_at = ev.header.verified.sent_at_ns or 0
        try:
            v = self._verification(ev)
        except (FrameError, InvalidInput, ValueError) as e:
            raise DriverError(
                grpc.StatusCode.INTERNAL, f"bad frame from {ev.header.sender}: {e}"
            ) from None
        return [] if v is None else self._verify(v)

    # -- faults ----------------------------------------------------------------------------
    async def _replay(self, failed: Backend | None, message: str) -> list[Command]:
        """Re-open the request on another path of its version; the controller's replay."""
        t0 = time.monotonic()
        if len(self.replay_seconds) >= self.max_replays:
            self.controller.on_failure(message)
            raise DriverError(
                grpc.StatusCode.UNAVAILABLE,
                f"{message} (given up after {self.max_replays} replays of this request)",
            )
        log.warning("%s: %s; replaying on another path", self.request_id, message)
        if failed is not None:
            self.backends.suspect(failed, message)
        self._abandon()
        try:
            await self._open({failed} if failed is not None else set(), first=False)
        except DriverError as e:
            self.controller.on_failure(e.message)
            raise DriverError(e.code, f"{message}; {e.message}") from None
        cmds = self.controller.replay(uses_draft=self.draft is not None)
        self.replay_seconds.append(time.monotonic() - t0)
        if self.on_replay is not None:
            self.on_replay(self, self.replay_seconds[-1])
        log.info(
            "%s replayed on %s (%d tokens so far)",
            self.request_id, ", ".join(b.label for b in self.path.backends),
            len(self.controller.tokens),
        )  # fmt: skip
        return cmds

    def _lose_draft(self, message: str) -> list[Command]:
        """The draft failed: release it and let the controller go on without it."""
        draft, self.draft = self.draft, None
        log.warning("%s: %s; going on without the draft", self.request_id, message)
        if draft is not None:
            self.backends.suspect(draft, message)
            self._restart_lane()
            self._in_background(self._release_path(RequestPath([], None), draft, self.wire_id))
            self.backends.release([draft])
            self.path = RequestPath(self.path.stages, None)
        return self.controller.drop_draft()

    def _abandon(self) -> None:
        """Leave the current path: stop its calls, release it in the background (logits
        held for its draft are from it: dropped)."""
        self._stop_tasks()
        self._parked = []
        if self._holding:
            self._in_background(self._release_path(self.path, self.draft, self.wire_id))
            self._let_go()

    # -- paths -----------------------------------------------------------------------------
    async def _open(self, excluded: set[Backend], first: bool) -> None:
        """Open the request on a path (the given one first, then others of the same
        version), under a fresh wire id per try. The first open takes what is there now;
        a replay waits up to `replay_timeout` for a path (a replica coming back or a new
        one joining)."""
        self.waiting = True
        try:
            await self._open_path(excluded, first)
        finally:
            self.waiting = False

    async def _open_path(self, excluded: set[Backend], first: bool) -> None:
        wait_until = time.monotonic() + (0.0 if first else self.replay_timeout)
        if self.deadline is not None:
            wait_until = min(wait_until, self.deadline)
        need_draft = self.controller.mode.uses_draft
        last: DriverError | None = None
        path, self._first_path = self._first_path, None
        while True:
            if path is None:
                try:
                    path = self.backends.path(self.version, need_draft, excluded)
                except NoPath as e:
                    if time.monotonic() < wait_until:
                        await asyncio.sleep(0.1)
                        continue
                    if last is not None and last.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise last from None
                    why = f" ({last.message})" if last is not None else ""
                    raise DriverError(
                        grpc.StatusCode.UNAVAILABLE, f"no path left{why}: {e}"
                    ) from None
            self._new_wire_id()
            failure = await self._open_watched(path)
            if failure is None:
                self.path, self.draft = path, path.draft if need_draft else None
                if not need_draft:
                    self.path = RequestPath(path.stages, None)
                self.backends.acquire(self.path)
                self._holding = True
                self._restart_lane()
                return
            b, err = failure
            if err.code == grpc.StatusCode.DEADLINE_EXCEEDED and self._past_deadline():
                raise err
            if not (err.replayable or err.code == grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise err
            if err.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.backends.suspect(b, err.message)
            excluded.add(b)
            last, path = err, None

    async def _open_watched(self, path: RequestPath) -> tuple[Backend, DriverError] | None:
        """`_open_stages`, given up as a refusal of the replica that went down meanwhile."""
        self._opening_path, self._down_while_opening = path, None
        self._opening = asyncio.ensure_future(self._open_stages(path))
        try:
            return await self._opening
        except asyncio.CancelledError:
            down, me = self._down_while_opening, asyncio.current_task()
            if down is None or (me is not None and me.cancelling()):
                raise
            b, message = down
            return b, DriverError(
                grpc.StatusCode.UNAVAILABLE, f"{b.label} went down: {message}", replayable=True
            )
        finally:
            self._opening = self._opening_path = self._down_while_opening = None

    def _new_wire_id(self) -> None:
        """Every try after the first gets its own id (and inbox queue): late frames, call
        failures and draft answers of an earlier path cannot reach this one."""
        if self.attempt:
            self.inbox.close(self.wire_id)
            self.wire_id = f"{self.request_id}~{self.attempt}"
            self.events = self.inbox.open(self.wire_id, self.controller.tree_rows)
        self.attempt += 1

    async def _open_stages(self, path: RequestPath) -> tuple[Backend, DriverError] | None:
        """Open the request on every stage of `path`; (replica, error) of a refusal."""
        ctrl, stages = self.controller, path.stages
        hops = [s.desc.data_address for s in stages[1:]] + [self.router_address]
        timeout = min(self.rpc_timeout, self.open_timeout)
        verify = verify_spec_to_proto(ctrl.verify_spec)  # the last stage verifies
        prefix = ctrl.committed_before_root  # looked up in each stage's prefix cache
        calls = [
            s.stub.Open(
                stage_pb2.OpenStageRequest(
                    request_id=self.wire_id,
                    capacity=ctrl.capacity,
                    next_hop=hop,
                    report_to=self.router_address,
                    root_logits_only=ctrl.root_logits_only,
                    fills_pipeline=ctrl.fills_pipeline,
                    lease_owner=self.lease_owner,
                    lease_epoch=self.lease_epoch,
                    lease_token=self.lease_token,
                    verify=verify if s is stages[-1] else None,
                    prefix_token_ids=prefix,
                ),
                timeout=timeout,
            )
            for s, hop in zip(stages, hops, strict=True)
        ]
        try:
            results = await asyncio.gather(*calls, return_exceptions=True)
        except asyncio.CancelledError:  # the client went away while this path opened
            self._in_background(self._release_path(path, None, self.wire_id))
            raise
        failed = [
            (s, r) for s, r in zip(stages, results, strict=True) if isinstance(r, BaseException)
        ]
        if not failed:
            # The prefill starts after the prefix every stage of the path holds cached.
            ctrl.cached_prefix = min(int(getattr(r, "cached_tokens", 0)) for r in results)
            return None
        opened = [
            s for s, r in zip(stages, results, strict=True) if not isinstance(r, BaseException)
        ]
        if opened:
            self._in_background(self._release_path(RequestPath(opened, None), None, self.wire_id))
        s, e = failed[0]
        return s, self._error(s, "opening the request", e)

    async def _release_path(self, path: RequestPath, draft: Backend | None, wire_id: str) -> None:
        calls = [
            b.stub.Release(pb.RequestRef(request_id=wire_id), timeout=5.0)
            for b in [*path.stages, *([draft] if draft else [])]
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.debug("release of %s failed: %s", wire_id, r)

    def _let_go(self) -> None:
        for b in self.path.stages:
            b.rows -= self._rows
        self._rows = 0
        self.backends.release(self.path.backends)
        self._holding = False

    def _count_rows(self) -> None:
        rows = self.controller.rows_in_flight
        if rows != self._rows and self._holding:
            for b in self.path.stages:
                b.rows += rows - self._rows
            self._rows = rows

    # -- commands --------------------------------------------------------------------------
    def _execute(self, cmd: Command) -> None:
        rid = self.wire_id
        if isinstance(cmd, Feed):
            stage1 = self.path.stages[0]
            req = stage_pb2.FeedRequest(
                request_id=rid,
                seq=cmd.seq,
                after_prune=cmd.after_prune,
                rows=rows_to_proto(cmd.act),
                token_ids=cmd.act.tokens.tolist(),
                verified_at_ns=self._verified_at,
            )
            assert stage1.feeds is not None
            self._spawn(stage1, "receiving rows", stage1.feeds.call(req, self.rpc_timeout))
        elif isinstance(cmd, BroadcastPrune):
            sig = prune_to_proto(cmd.prune, cmd.seq)
            req = pb.PruneRequest(request_id=rid, prune=sig)
            for s in self.path.stages:
                assert s.prunes is not None
                self._spawn(s, "applying a prune", s.prunes.call(req, self.rpc_timeout))
        elif isinstance(cmd, DraftPrune):
            self._draft_prunes.append(prune_to_proto(cmd.prune, cmd.seq))
        elif isinstance(cmd, Propose):
            self._propose(cmd)
        elif isinstance(cmd, DraftOpen):
            req = draft_pb2.OpenDraftRequest(
                request_id=rid,
                capacity=cmd.capacity,
                prompt_ids=cmd.prompt,
                prefill_chunk=cmd.prefill_chunk,
                lease_owner=self.lease_owner,
                lease_epoch=self.lease_epoch,
                lease_token=self.lease_token,
            )
            self._draft_call(
                "opening the request", lambda stub: stub.Open(req, timeout=self.rpc_timeout)
            )
        elif isinstance(cmd, DraftPrefill):
            req = draft_pb2.PrefillDraftRequest(
                request_id=rid,
                token_ids=cmd.tokens,
                start_position=cmd.start_position,
                prefill_chunk=cmd.prefill_chunk,
            )
            self._draft_call("prefilling", lambda stub: stub.Prefill(req, timeout=self.rpc_timeout))
        else:
            raise TypeError(f"unknown command {cmd!r}")

    def _propose(self, cmd: Propose) -> None:
        req = draft_pb2.ProposeRequest(
            request_id=self.wire_id,
            rows=rows_to_proto(cmd.layer),
            token_ids=cmd.layer.tokens.tolist(),
            top_k=cmd.top_k,
            temperature=cmd.temperature,
            prunes=self._draft_prunes,
        )
        self._draft_prunes = []
        attempt = self.attempt

        async def call(stub) -> None:
            resp = await stub.Propose(req, timeout=self.rpc_timeout)
            cand = Candidates(
                torch.tensor(resp.parent_ids, dtype=torch.int64),
                torch.tensor(resp.token_ids, dtype=torch.int64),
                torch.tensor(resp.probs, dtype=torch.float32),
            )
            self.events.put_nowait(_Proposal(attempt, cmd.ticket, cand))

        self._draft_call("proposing a tree layer", call, flush_prunes=False)

    def _draft_call(
        self, what: str, call: Callable[[object], Awaitable], flush_prunes: bool = True
    ) -> None:
        """Queue a draft call in the request's lane; prunes not yet sent go first."""
        if flush_prunes:
            rid = self.wire_id
            for sig in self._draft_prunes:
                req = pb.PruneRequest(request_id=rid, prune=sig)
                self._draft_q.put_nowait(
                    ("applying a prune", lambda s, req=req: s.Prune(req, timeout=self.rpc_timeout))
                )
            self._draft_prunes = []
        self._draft_q.put_nowait((what, call))

    # -- plumbing ------------------------------------------------------------------------
    def _spawn(self, b: Backend, what: str, call: Awaitable) -> None:
        """Fire a control call; its failure is an event (replayed or fatal)."""
        attempt = self.attempt

        async def run() -> None:
            try:
                await call
            except asyncio.CancelledError:
                raise
            except Exception as e:
                err = self._error(b, what, e)
                self.events.put_nowait(_Failure(attempt, err.code, err.message, b, err.replayable))

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _in_background(self, call: Awaitable) -> None:
        task = asyncio.ensure_future(call)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _restart_lane(self) -> None:
        """A fresh lane (and queue) for the current draft; the old lane's calls are dropped."""
        if self._lane is not None:
            self._lane.cancel()
        self._draft_q = asyncio.Queue()
        self._draft_prunes = []
        self._lane = None
        if self.draft is not None:
            self._lane = asyncio.create_task(
                self._draft_lane(self.draft, self._draft_q, self.attempt),
                name=f"draft-lane-{self.wire_id}",
            )

    def _stop_tasks(self) -> None:
        for t in [*self._tasks, *([self._lane] if self._lane else [])]:
            t.cancel()
        self._tasks.clear()
        self._lane = None

    async def _draft_lane(self, draft: Backend, queue: asyncio.Queue, attempt: int) -> None:
        """Run the draft calls of this request one after another, in creation order."""
        while True:
            what, call = await queue.get()
            try:
                await call(draft.stub)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                err = self._error(draft, what, e)
                self.events.put_nowait(_Failure(attempt, err.code, err.message, draft))
                return
