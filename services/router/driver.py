"""Drives one request over the network: the asynchronous counterpart of
`runtime.lockstep.Generation`, using the same tree managers (`SpecPipeManager`,
`SpecInferManager`) for every decision.

There is no global step. Stage 1 receives tree layers from here over gRPC; each stage
computes as soon as its input arrives and pushes it to the next hop of this request;
the last stage's logits come back through the router's data-plane inbox. Events are
handled one at a time from one queue (logits, draft proposals, failures), so the
manager is never touched concurrently:

- logits containing the root: verify, emit, broadcast the prune (numbered: stages
  apply prunes in order, and compute a layer only after the prunes it was created
  after), then feed the restart root on a miss or grow the next layer on a hit;
- draft candidates for the frontier: grow the next layer if the tree is shallower
  than `max_depth` (about one layer per stage in flight), otherwise keep them until
  the next verification makes room.

Draft calls of a request run in one ordered lane, so the draft sees prunes and layers
in the order the router created them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
import torch
from specpipe.common.spec.messages import Activation, Candidates, Prune
from specpipe.common.spec.options import DecodeOptions, Mode, tree_capacity
from specpipe.common.spec.stats import DecodeStats
from specpipe.common.spec.tree_manager import (
    OutputState,
    SpecInferManager,
    SpecPipeManager,
    Verdict,
    prefill_chunks,
)
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, stage_pb2

from ..control import prune_to_proto, rows_to_proto
from ..grpc_util import code_from_number
from ..transport import Frame, FrameError, decode
from ..transport.codec import Kind
from .backends import Backend, RequestPath

log = logging.getLogger(__name__)


class DriverError(Exception):
    """The request failed; `code` is the gRPC status the client receives."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Plan:
    """A validated request."""

    prompt: list[int]
    mode: Mode  # SPECPIPE, PP or SPECINFER (AUTOREGRESSIVE runs as PP on a pipeline)
    mode_name: str  # as requested, for the stats
    opts: DecodeOptions


@dataclass
class _Proposal:
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
        request_id: str,
        path: RequestPath,
        plan: Plan,
        router_address: str,
        events: asyncio.Queue,
        rpc_timeout: float = 60.0,
        deadline: float | None = None,
    ) -> None:
        self.request_id, self.path, self.plan = request_id, path, plan
        self.router_address = router_address
        self.events = events
        self.max_rpc_timeout = rpc_timeout
        self.deadline = deadline  # the client's, on time.monotonic(); None: no deadline
        self.num_stages = len(path.stages)
        self.draft = path.draft if plan.mode in (Mode.SPECPIPE, Mode.SPECINFER) else None
        opts = plan.opts
        width = opts.width if self.draft is not None else 0
        self.stats = DecodeStats(mode=plan.mode_name, stages=self.num_stages, width=width)
        self.out = OutputState(opts.max_new_tokens, opts.sampling, opts.stop_token_ids)
        self.capacity = (
            len(plan.prompt) + opts.max_new_tokens + tree_capacity(plan.mode, self.num_stages, opts)
        )
        self._seq = 0  # activations fed to stage 1
        self._prunes = 0  # prune signals broadcast
        self._tasks: set[asyncio.Task] = set()
        self._draft_q: asyncio.Queue = asyncio.Queue()
        self._draft_prunes: list[pb.PruneSignal] = []  # for the draft, sent with the next layer
        self._lane: asyncio.Task | None = None
        # Lockstep-equivalent step numbers (see SpeculationStats.decode_steps).
        self._node_step: dict[int, int] = {}
        self._last_enter = -1
        self._last_verify = -1
        self.t_start = time.monotonic()
        self.token_times: list[float] = []
        self.failed: DriverError | None = None

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
        """Open the request everywhere, then yield verified tokens as they come."""
        for b in self.path.backends:
            b.active += 1
        self._lane = asyncio.create_task(self._draft_lane(), name=f"draft-lane-{self.request_id}")
        await self._open()
        loop = self._specinfer() if self.plan.mode == Mode.SPECINFER else self._specpipe()
        async for tokens in loop:
            now = time.monotonic()
            self.token_times.extend([now] * len(tokens))
            self.stats.new_tokens += len(tokens)
            self.stats.emit_steps += [self.stats.decode_steps] * len(tokens)
            self.stats.hits = self.out.hits
            self.stats.finish_reason = self.out.finish_reason
            yield tokens

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """Called from outside (health monitor): fail the request at the next event."""
        self.events.put_nowait(_Failure(code, message))

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
            what, make_call, fut = await self._draft_q.get()
            try:
                result = await make_call()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                err = self._error(self.path.draft, what, e)
                if fut is None:
                    self.events.put_nowait(_Failure(err.code, err.message))
                elif not fut.done():
                    fut.set_exception(err)
                continue
            if fut is not None and not fut.done():
                fut.set_result(result)

    def _draft_do(
        self, what: str, make_call: Callable[[], Awaitable], wait: bool = False
    ) -> asyncio.Future | None:
        fut = asyncio.get_running_loop().create_future() if wait else None
        self._draft_q.put_nowait((what, make_call, fut))
        return fut

    async def _next_event(self):
        ev = await self.events.get()
        self._raise_on_failure(ev)
        return ev

    # -- request lifecycle ----------------------------------------------------------------
    async def _open(self) -> None:
        stages = self.path.stages
        hops = [s.desc.data_address for s in stages[1:]] + [self.router_address]
        calls = [
            s.stub.Open(
                stage_pb2.OpenStageRequest(
                    request_id=self.request_id,
                    capacity=self.capacity,
                    next_hop=hop,
                    report_to=self.router_address,
                    # specpipe/pp verify one root at a time: no logits of other rows.
                    root_logits_only=self.plan.mode != Mode.SPECINFER,
                ),
                timeout=self.rpc_timeout,
            )
            for s, hop in zip(stages, hops, strict=True)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for s, r in zip(stages, results, strict=True):
            if isinstance(r, BaseException):
                raise self._error(s, "opening the request", r)
        if self.draft is not None:
            draft = self.draft
            req = draft_pb2.OpenDraftRequest(
                request_id=self.request_id,
                capacity=self.capacity,
                prompt_ids=self.plan.prompt,
                prefill_chunk=self.plan.opts.prefill_chunk,
            )
            # Prefilled in parallel with the stages; later draft calls queue behind it.
            self._draft_do(
                "opening the request", lambda: draft.stub.Open(req, timeout=self.rpc_timeout)
            )
        for chunk in prefill_chunks(
            self.request_id, self.plan.prompt, self.plan.opts.prefill_chunk
        ):
            self._feed(chunk)
            self.stats.prefill_steps += 1

    def _feed(self, act: Activation) -> None:
        """Send rows into stage 1, numbered, with the tree version they need."""
        stage1 = self.path.stages[0]
        req = stage_pb2.FeedRequest(
            request_id=self.request_id,
            seq=self._seq,
            after_prune=self._prunes,
            rows=rows_to_proto(act),
            token_ids=act.tokens.tolist(),
        )
        self._seq += 1
        self._spawn(
            stage1, "receiving a tree layer", stage1.stub.Feed(req, timeout=self.rpc_timeout)
        )

    def _broadcast(self, verdict: Verdict) -> None:
        self._prunes += 1
        sig = prune_to_proto(verdict.prune, self._prunes)
        for s in self.path.stages:
            req = pb.PruneRequest(request_id=self.request_id, prune=sig)
            self._spawn(s, "applying a prune", s.stub.Prune(req, timeout=self.rpc_timeout))
        if self.draft is not None:
            prune = verdict.draft_prune or verdict.prune
            if self.plan.mode == Mode.SPECPIPE:  # rides on the next Propose call
                self._draft_prunes.append(prune_to_proto(prune, self._prunes))
            else:
                self._prune_draft(prune)

    def _prune_draft(self, prune: Prune, wait: bool = False) -> asyncio.Future | None:
        draft = self.draft
        assert draft is not None
        req = pb.PruneRequest(request_id=self.request_id, prune=prune_to_proto(prune, self._prunes))
        return self._draft_do(
            "applying a prune", lambda: draft.stub.Prune(req, timeout=self.rpc_timeout), wait
        )

    def _propose(self, layer: Activation, wait: bool = False) -> asyncio.Future | None:
        draft = self.draft
        assert draft is not None
        opts = self.plan.opts
        req = draft_pb2.ProposeRequest(
            request_id=self.request_id,
            rows=rows_to_proto(layer),
            token_ids=layer.tokens.tolist(),
            top_k=min(opts.top_k_children, opts.width),
            temperature=opts.sampling.temperature,
            prunes=self._draft_prunes,
        )
        self._draft_prunes = []

        async def call() -> Candidates:
            resp = await draft.stub.Propose(req, timeout=self.rpc_timeout)
            cand = Candidates(
                torch.tensor(resp.parent_ids, dtype=torch.int64),
                torch.tensor(resp.token_ids, dtype=torch.int64),
                torch.tensor(resp.probs, dtype=torch.float32),
            )
            if not wait:
                self.events.put_nowait(_Proposal(cand))
            return cand

        return self._draft_do("proposing a tree layer", call, wait)

    # -- step accounting -----------------------------------------------------------------
    def _enter_step(self, layer: Activation) -> int:
        """Lockstep step at which `layer` enters stage 1: after its parents' layer, after the
        previous layer, and after the verification it was decided from."""
        parents = [
            self._node_step[p] for p in set(layer.parent_ids.tolist()) if p in self._node_step
        ]
        step = max([self._last_enter + 1, self._last_verify + 1, *(p + 1 for p in parents)])
        self._last_enter = step
        self._node_step.update(dict.fromkeys(layer.node_ids.tolist(), step))
        return step

    def _verify_step(self, root_id: int) -> None:
        entered = self._node_step.get(root_id, self._last_verify + 1)
        self._last_verify = max(entered + self.num_stages - 1, self._last_verify + 1)
        self.stats.decode_steps = self._last_verify + 1

    # -- decoding loops ------------------------------------------------------------------
    def _enter(self, layer: Activation) -> None:
        self._enter_step(layer)
        self._feed(layer)
        if self.draft is not None:
            self._propose(layer)

    async def _specpipe(self) -> AsyncIterator[list[int]]:
        """SpecPipe (with a draft) or PP (without): one layer enters per step at most."""
        width = self.plan.opts.width if self.draft is not None else 0
        mgr = SpecPipeManager(self.request_id, self.plan.prompt, self.out, width, self.num_stages)
        self._enter(mgr.root_layer())
        waiting: Candidates | None = None  # proposals for a frontier that was too deep to grow
        while True:
            ev = await self._next_event()
            if isinstance(ev, _Proposal):
                layer = mgr.grow(ev.cand)
                self.stats.regrowths = mgr.regrowths
                if layer is not None:
                    self._enter(layer)
                    waiting = None
                elif not mgr.can_grow:
                    waiting = ev.cand
                continue
            try:
                last = decode(ev)
            except FrameError as e:
                raise DriverError(
                    grpc.StatusCode.INTERNAL, f"bad frame from {ev.header.sender}: {e}"
                ) from None
            if last.logits is None:
                continue
            rows = (last.node_ids == mgr.tree.root_id).nonzero()
            if rows.numel() == 0:
                continue  # nodes a prune dropped after they left the stage before
            root_id = mgr.tree.root_id
            verdict = mgr.verify(last.logits[int(rows[0, 0])])
            self._verify_step(root_id)
            self.stats.verifications = mgr.verifications
            self.stats.root_children = mgr.root_children
            yield verdict.tokens
            if verdict.done:
                return
            self._broadcast(verdict)
            if verdict.restart is not None:
                waiting = None
                self._enter(verdict.restart)
            elif self.draft is not None:
                # Room for a layer again: grow from proposals that had to wait, or regrow
                # from kept proposals if the prune removed the whole newest layer.
                layer = mgr.grow(waiting if waiting is not None else Candidates.empty())
                self.stats.regrowths = mgr.regrowths
                if layer is not None:
                    waiting = None
                    self._enter(layer)

    async def _specinfer(self) -> AsyncIterator[list[int]]:
        """Per pass: the draft grows a whole tree, the tree crosses all stages, the
        longest verified path plus one token is emitted."""
        assert self.draft is not None
        opts = self.plan.opts
        mgr = SpecInferManager(
            self.request_id, self.plan.prompt, self.out, opts.width, opts.specinfer_depth
        )
        draft = self.draft
        while True:
            if mgr.unseen_by_draft:
                start = mgr.root_pos - len(mgr.unseen_by_draft)
                req = draft_pb2.PrefillDraftRequest(
                    request_id=self.request_id,
                    token_ids=mgr.unseen_by_draft,
                    start_position=start,
                    prefill_chunk=opts.prefill_chunk,
                )
                self._draft_do(
                    "prefilling", lambda req=req: draft.stub.Prefill(req, timeout=self.rpc_timeout)
                )
                mgr.unseen_by_draft = []
            while (layer := mgr.draft_layer()) is not None:
                cand = await self._await(self._propose(layer, wait=True))
                if not mgr.grow(cand):
                    break
            whole = mgr.whole_tree()
            entered = max(self._last_enter + 1, self._last_verify + 1)
            self._last_enter = entered
            root_id = int(whole.node_ids[0])
            self._node_step[root_id] = entered
            self._feed(whole)
            while True:
                ev = await self._next_event()
                if isinstance(ev, Frame):
                    last = decode(ev)
                    if last.logits is not None and torch.equal(last.node_ids, mgr.tree.ids):
                        break
            verdict = mgr.verify(last)
            self._verify_step(root_id)
            self.stats.verifications = mgr.verifications
            self.stats.root_children = mgr.root_children
            self.stats.accepted_lengths = mgr.accepted_lengths
            yield verdict.tokens
            if verdict.done:
                return
            self._broadcast(verdict)

    async def _await(self, fut: asyncio.Future | None):
        """Wait for a draft result while still noticing failures reported as events."""
        assert fut is not None
        while True:
            getter = asyncio.ensure_future(self.events.get())
            await asyncio.wait({fut, getter}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                self._raise_on_failure(getter.result())  # other events: stale, ignored
            else:
                getter.cancel()
            if fut.done():
                return fut.result()

    @staticmethod
    def _raise_on_failure(ev) -> None:
        if isinstance(ev, _Failure):
            raise DriverError(ev.code, ev.message)
        if isinstance(ev, Frame) and ev.kind == Kind.PAYLOAD_KIND_ERROR:
            code = code_from_number(ev.header.error_code or grpc.StatusCode.INTERNAL.value[0])
            raise DriverError(code, ev.header.error or f"{ev.header.sender} failed")
