"""The network executor of one request: the request controller's commands carried out
over gRPC and the data plane (docs/architecture.md, "5. The request controller and its
executors").

There is no global step. Stage 1 receives feeds from here over gRPC; each stage computes
as soon as its input is ready and pushes it to the request's next hop; the last stage's
logits come back through the router's data-plane inbox. Events (logits, draft answers,
failures) are handled one at a time from one queue, so the controller is never touched
concurrently. Draft calls of a request run in one ordered lane, so the draft sees prunes
and layers in the order the controller created them; prunes for the draft ride on the
next `Propose`. Every decision is the controller's: this module only moves commands and
events, keeps deadlines and maps failures to statuses.
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
from specpipe.common.spec.messages import Candidates
from specpipe.common.spec.stats import DecodeStats
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, stage_pb2

from ..control import prune_to_proto, rows_to_proto
from ..grpc_util import code_from_number
from ..transport import Frame, FrameError, decode
from ..transport.codec import Kind
from .backends import Backend, RequestPath

log = logging.getLogger(__name__)
LOGIT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class DriverError(Exception):
    """The request failed; `code` is the gRPC status the client receives."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class _Proposal:
    ticket: int
    cand: Candidates


@dataclass
class _Failure:
    code: grpc.StatusCode
    message: str


def backend_error(b: Backend, what: str, e: BaseException) -> DriverError:
    """A failed call to a backend, as the status the client should see."""
    if isinstance(e, DriverError):
        return e
    if isinstance(e, grpc.aio.AioRpcError):
        code = e.code()
        passthrough = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return DriverError(
                grpc.StatusCode.UNAVAILABLE, f"{b.label} is unavailable ({what}): {e.details()}"
            )
        if code in passthrough:
            return DriverError(code, f"{b.label}: {e.details()}")
        return DriverError(
            grpc.StatusCode.INTERNAL, f"{b.label} failed {what}: {code.name}: {e.details()}"
        )
    return DriverError(grpc.StatusCode.INTERNAL, f"{b.label} failed {what}: {e!r}")


class RequestDriver:
    def __init__(
        self,
        controller: Controller,
        path: RequestPath,
        router_address: str,
        events: asyncio.Queue,
        rpc_timeout: float = 60.0,
        deadline: float | None = None,
        vocab_size: int | None = None,
        lease: tuple[str, str] = ("", ""),
        progress_timeout: float | None = None,
    ) -> None:
        self.controller, self.path = controller, path
        self.request_id = controller.request_id
        self.router_address = router_address
        self.events = events
        self.max_rpc_timeout = rpc_timeout
        self.deadline = deadline  # the client's, on time.monotonic(); None: no deadline
        self.vocab_size = vocab_size  # the width of every logits frame
        self.lease_owner, self.lease_epoch = lease  # the router's name and process epoch
        # Watchdog: fail the request when no event (logits, a draft answer) comes for this
        # long, or opening it takes this long (None: never).
        self.progress_timeout = progress_timeout
        self._failure: _Failure | None = None
        self._opening: asyncio.Task | None = None
        self.draft = path.draft if controller.uses_draft else None
        self._tasks: set[asyncio.Task] = set()
        self._draft_q: asyncio.Queue = asyncio.Queue()
        self._draft_prunes: list[pb.PruneSignal] = []  # for the draft, sent with the next layer
        self._lane: asyncio.Task | None = None
        self.t_start = time.monotonic()
        self.token_times: list[float] = []

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

    def _error(self, b: Backend, what: str, e: BaseException) -> DriverError:
        """A backend call's failure; a call cut short by the client's deadline says so."""
        err = backend_error(b, what, e)
        if (
            isinstance(e, grpc.aio.AioRpcError)
            and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            and self.deadline is not None
            and time.monotonic() >= self.deadline - 0.05
        ):
            return DriverError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"the deadline passed while {what} on {b.label}"
            )
        return err

    # -- public ------------------------------------------------------------------------
    async def run(self) -> AsyncIterator[list[int]]:
        """Open the request on its path, then yield verified tokens as they come."""
        for b in self.path.backends:
            b.active += 1
        self._lane = asyncio.create_task(self._draft_lane(), name=f"draft-lane-{self.request_id}")
        await self._open()
        ctrl = self.controller
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
            ev = await self._next_event()
            if isinstance(ev, _Proposal):
                cmds = ctrl.on_candidates(ev.ticket, ev.cand)
                continue
            self._raise_on_failure(ev)
            try:
                cmds = ctrl.on_logits(self._logits(ev))
            except (FrameError, InvalidInput) as e:
                raise DriverError(
                    grpc.StatusCode.INTERNAL, f"bad frame from {ev.header.sender}: {e}"
                ) from None

    def _logits(self, frame: Frame):
        """The activation of a logits frame, checked: [rows, vocab] floats, finite."""
        act = decode(frame) if frame.kind == Kind.PAYLOAD_KIND_LOGITS else None
        if act is None or act.logits is None:
            raise FrameError(f"the router takes logits, not frames of kind {frame.kind}")
        x = act.logits
        vocab = self.vocab_size or (x.shape[-1] if x.ndim else 0)
        check_payload(x, len(act), vocab, LOGIT_DTYPES, "logits")
        return act

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """Called from outside (health monitor, keep-alive): fail the request at the next
        event, or now if it is still being opened (an Open may wait a minute on a stage
        that froze)."""
        failure = _Failure(code, message)
        self._failure = self._failure or failure
        self.events.put_nowait(failure)
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()

    async def _open(self) -> None:
        """Open the request on its stages, unless it fails first (see `fail`) or the
        watchdog's time runs out."""
        self._opening = asyncio.ensure_future(self._open_stages())
        try:
            await asyncio.wait_for(asyncio.shield(self._opening), self.progress_timeout)
        except TimeoutError:
            self._opening.cancel()
            raise self._stalled("opening the request") from None
        except asyncio.CancelledError:
            if self._failure is not None and self._opening.cancelled():
                f = self._failure
                raise DriverError(f.code, f.message) from None
            self._opening.cancel()
            raise

    async def _next_event(self):
        try:
            return await asyncio.wait_for(self.events.get(), self.progress_timeout)
        except TimeoutError:
            raise self._stalled("waiting for the pipeline") from None

    def _stalled(self, what: str) -> DriverError:
        """The watchdog: no progress for `progress_timeout` seconds."""
        stages = ", ".join(b.label for b in self.path.backends)
        return DriverError(
            grpc.StatusCode.UNAVAILABLE,
            f"no progress for {self.progress_timeout:.0f} s while {what} (a stage or the "
            f"draft may be stalled: {stages}); the request was stopped, retry it",
        )

    async def release(self) -> None:
        """Free the request's state on every stage and the draft (best effort)."""
        for t in [*self._tasks, *([self._lane] if self._lane else [])]:
            t.cancel()
        calls = [
            b.stub.Release(pb.RequestRef(request_id=self.request_id), timeout=5.0)
            for b in self.path.backends
            if b is not self.path.draft or self.draft is not None
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for b, r in zip(self.path.backends, results, strict=False):
            if isinstance(r, BaseException):
                log.debug("release of %s on %s failed: %s", self.request_id, b.label, r)
        for b in self.path.backends:
            b.active -= 1

    def timing(self) -> tuple[float, float]:
        """(time to first token, mean time between tokens), in milliseconds."""
        if not self.token_times:
            return 0.0, 0.0
        ttft = (self.token_times[0] - self.t_start) * 1e3
        n = len(self.token_times)
        tbt = (self.token_times[-1] - self.token_times[0]) * 1e3 / (n - 1) if n > 1 else 0.0
        return ttft, tbt

    # -- commands --------------------------------------------------------------------------
    async def _open_stages(self) -> None:
        ctrl, stages = self.controller, self.path.stages
        hops = [s.desc.data_address for s in stages[1:]] + [self.router_address]
        calls = [
            s.stub.Open(
                stage_pb2.OpenStageRequest(
                    request_id=self.request_id,
                    capacity=ctrl.capacity,
                    next_hop=hop,
                    report_to=self.router_address,
                    root_logits_only=ctrl.root_logits_only,
                    lease_owner=self.lease_owner,
                    lease_epoch=self.lease_epoch,
                ),
                timeout=self.rpc_timeout,
            )
            for s, hop in zip(stages, hops, strict=True)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for s, r in zip(stages, results, strict=True):
            if isinstance(r, BaseException):
                raise self._error(s, "opening the request", r)

    def _execute(self, cmd: Command) -> None:
        rid = self.request_id
        if isinstance(cmd, Feed):
            stage1 = self.path.stages[0]
            req = stage_pb2.FeedRequest(
                request_id=rid,
                seq=cmd.seq,
                after_prune=cmd.after_prune,
                rows=rows_to_proto(cmd.act),
                token_ids=cmd.act.tokens.tolist(),
            )
            self._spawn(stage1, "receiving rows", stage1.stub.Feed(req, timeout=self.rpc_timeout))
        elif isinstance(cmd, BroadcastPrune):
            sig = prune_to_proto(cmd.prune, cmd.seq)
            for s in self.path.stages:
                req = pb.PruneRequest(request_id=rid, prune=sig)
                self._spawn(s, "applying a prune", s.stub.Prune(req, timeout=self.rpc_timeout))
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
            request_id=self.request_id,
            rows=rows_to_proto(cmd.layer),
            token_ids=cmd.layer.tokens.tolist(),
            top_k=cmd.top_k,
            temperature=cmd.temperature,
            prunes=self._draft_prunes,
        )
        self._draft_prunes = []

        async def call(stub) -> None:
            resp = await stub.Propose(req, timeout=self.rpc_timeout)
            cand = Candidates(
                torch.tensor(resp.parent_ids, dtype=torch.int64),
                torch.tensor(resp.token_ids, dtype=torch.int64),
                torch.tensor(resp.probs, dtype=torch.float32),
            )
            self.events.put_nowait(_Proposal(cmd.ticket, cand))

        self._draft_call("proposing a tree layer", call, flush_prunes=False)

    def _draft_call(
        self, what: str, call: Callable[[object], Awaitable], flush_prunes: bool = True
    ) -> None:
        """Queue a draft call in the request's lane; prunes not yet sent go first."""
        if flush_prunes:
            for sig in self._draft_prunes:
                req = pb.PruneRequest(request_id=self.request_id, prune=sig)
                self._draft_q.put_nowait(
                    ("applying a prune", lambda s, req=req: s.Prune(req, timeout=self.rpc_timeout))
                )
            self._draft_prunes = []
        self._draft_q.put_nowait((what, call))

    # -- plumbing ------------------------------------------------------------------------
    def _spawn(self, b: Backend, what: str, call: Awaitable) -> None:
        """Fire a control call; its failure fails the request."""

        async def run() -> None:
            try:
                await call
            except asyncio.CancelledError:
                raise
            except Exception as e:
                err = self._error(b, what, e)
                self.events.put_nowait(_Failure(err.code, err.message))

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _draft_lane(self) -> None:
        """Run the draft calls of this request one after another, in creation order."""
        while True:
            what, call = await self._draft_q.get()
            assert self.draft is not None
            try:
                await call(self.draft.stub)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                err = self._error(self.draft, what, e)
                self.events.put_nowait(_Failure(err.code, err.message))

    def _raise_on_failure(self, ev) -> None:
        if isinstance(ev, _Failure):
            self.controller.on_failure(ev.message)
            raise DriverError(ev.code, ev.message)
        if isinstance(ev, Frame) and ev.kind == Kind.PAYLOAD_KIND_ERROR:
            code = code_from_number(ev.header.error_code or grpc.StatusCode.INTERNAL.value[0])
            message = ev.header.error or f"{ev.header.sender} failed"
            self.controller.on_failure(message)
            raise DriverError(code, message)
