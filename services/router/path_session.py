"""One request's path through the deployment, with one owner: which replicas serve it
(chosen by `Backends.path`, on one model version for the request's life), its id there,
its claim on their load, opening it on every stage, abandoning it for another after a
fault, and releasing it. The commands of the current path run through its
`CommandExecutor` (executor.py).

Every try gets its own wire id (`<id>~<attempt>` after the first) and its own executor:
late frames, call failures and draft answers of an earlier path cannot reach the next
one. A path being opened is given up at once when one of its replicas is reported down
(an Open may wait long on a stage that froze).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc
from specpipe.common.runtime.prefix_hash import NO_SCOPE, CacheScope
from specpipe.common.spec.controller import Controller, needs_draft
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.v1 import stage_pb2

from ..config import DEFAULT_REPLAY_SECONDS
from ..control import cache_scope_to_proto, verify_spec_to_proto
from ..transport import Inbox
from .backends import Backend, Backends, Claim, NoPath, RequestPath
from .calls import NO_LEASE, Deadline, DriverError, LeaseClaim
from .events import Event, Failure
from .executor import CommandExecutor, release_on

log = logging.getLogger(__name__)
RELEASE_TIMEOUT = 5.0  # seconds a Release may take (best effort)


def first_path(
    backends: Backends,
    mode: Mode,
    opts: DecodeOptions,
    prompt: Sequence[int],
    cache_scope: CacheScope = NO_SCOPE,
) -> RequestPath:
    """The path a new request tries first: the newest complete version, replicas that
    were sent its prompt's prefix in its cache scope preferred (prefix_affinity.py), a
    draft when it needs one (`needs_draft`). NoPath when there is none."""
    return backends.path(
        need_draft=needs_draft(mode, opts), prompt=prompt, cache_salt=cache_scope.salt
    )


class PathSession:
    def __init__(
        self,
        controller: Controller,
        backends: Backends,
        path: RequestPath,
        router_address: str,
        inbox: Inbox,
        post: Callable[[Event], None],
        deadline: Deadline,
        lease: LeaseClaim = NO_LEASE,
        open_timeout: float = 10.0,
        replay_timeout: float = DEFAULT_REPLAY_SECONDS,
        cache_scope: CacheScope = NO_SCOPE,
    ) -> None:
        """`controller`: read for what `Open` tells the stages; `post`: where the
        request's events go (frames of its current wire id, its calls' failures);
        `cache_scope`: the prefix-cache scope of its blocks on every replica."""
        self.cache_scope = cache_scope
        self.controller, self.backends = controller, backends
        self.request_id = controller.request_id
        self.router_address, self.inbox, self.post = router_address, inbox, post
        self.deadline, self.lease = deadline, lease
        self.open_timeout, self.replay_timeout = open_timeout, replay_timeout
        self.version = path.version  # a request stays on one model version
        self.path = path
        self._first: RequestPath | None = path  # tried first by the first open
        self.attempt = 0
        self.wire_id = self.request_id  # the request's id on the current path
        self.inbox.route(self.wire_id, post, controller.tree_rows)
        self.executor: CommandExecutor | None = None  # of the current path, once open
        self._claim: Claim | None = None  # the load counted on the current path
        self.waiting = True  # opening a path (first or replayed), not producing tokens
        # The path being opened, and a replica of it that went down meanwhile.
        self._opening_path: RequestPath | None = None
        self._opening: asyncio.Future | None = None
        self._down_while_opening: tuple[Backend, str] | None = None
        self._background: set[asyncio.Task] = set()

    @property
    def holding(self) -> bool:
        """Whether the request is open on its current path (what the backends hold)."""
        return self._claim is not None

    @property
    def draft(self) -> Backend | None:
        return self.path.draft

    def holds(self, b: Backend) -> bool:
        """Whether `b` is on the path the request is open on."""
        return self.holding and b in self.path.backends

    # -- opening -------------------------------------------------------------------------
    async def open(self, excluded: set[Backend] | None = None, first: bool = False) -> int:
        """Open the request on a path (the first one given, then others of the same
        version) under a fresh wire id per try; the prefix every stage of it holds
        cached (tokens). The first open takes what is there now; a replay waits up to
        `replay_timeout` for a path (a replica coming back or a new one joining)."""
        self.waiting = True
        try:
            return await self._open(set(excluded or ()), first)
        finally:
            self.waiting = False

    async def _open(self, excluded: set[Backend], first: bool) -> int:
        wait_until = time.monotonic() + (0.0 if first else self.replay_timeout)
        if self.deadline.at is not None:
            wait_until = min(wait_until, self.deadline.at)
        wants_draft = needs_draft(self.controller.mode, self.controller.opts)
        last: DriverError | None = None
        path, self._first = self._first, None
        if path is not None and not wants_draft:
            path = RequestPath(path.stages, None)
        went_down: set[Backend] = set()  # excluded replicas seen unusable since
        while True:
            if path is None:
                try:
                    path = self.backends.path(self.version, wants_draft, excluded)
                except NoPath as e:
                    # A replica excluded because it went down (a link lost) that serves
                    # again may take the request back: a fresh open, under a new wire id.
                    went_down |= {b for b in excluded if not b.eligible}
                    back = {b for b in went_down & excluded if b.eligible}
                    if back:
                        excluded -= back
                        continue
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
            opened = await self._open_watched(path)
            if isinstance(opened, int):
                self.path = path
                self._claim = self.backends.acquire(path)
                self.executor = CommandExecutor(
                    path, self.wire_id, self.attempt, self.post, self.deadline, self.lease,
                    self.cache_scope,
                )  # fmt: skip
                return opened
            b, err = opened
            if err.code == grpc.StatusCode.DEADLINE_EXCEEDED and self.deadline.passed():
                raise err
            if not (err.replayable or err.code == grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise err
            if err.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.backends.suspect(b, err.message)
            excluded.add(b)
            last, path = err, None

    def _new_wire_id(self) -> None:
        """Every try after the first gets its own id: late frames, call failures and
        draft answers of an earlier path cannot reach this one."""
        if self.attempt:
            self.inbox.close(self.wire_id)
            self.wire_id = f"{self.request_id}~{self.attempt}"
            self.inbox.route(self.wire_id, self.post, self.controller.tree_rows)
        self.attempt += 1

    async def _open_watched(self, path: RequestPath) -> int | tuple[Backend, DriverError]:
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

    def lost_while_opening(self, b: Backend, message: str) -> bool:
        """`b` went down: give up the path being opened if `b` is on it."""
        if (
            self._opening is None
            or self._opening_path is None
            or b not in self._opening_path.stages
            or self._opening.done()
        ):
            return False
        self._down_while_opening = (b, message)
        self._opening.cancel()
        return True

    async def _open_stages(self, path: RequestPath) -> int | tuple[Backend, DriverError]:
        """Open the request on every stage of `path`: the prefix they all hold cached,
        or (replica, error) of a refusal (the others are released)."""
        ctrl, stages, wire_id = self.controller, path.stages, self.wire_id
        hops = [s.desc.data_address for s in stages[1:]] + [self.router_address]
        timeout = self.deadline.timeout(self.open_timeout)
        verify = verify_spec_to_proto(ctrl.verify_spec)  # the last stage verifies
        prefix = ctrl.committed_before_root  # looked up in each stage's prefix cache
        scope = cache_scope_to_proto(self.cache_scope)
        calls = [
            s.stub.Open(
                stage_pb2.OpenStageRequest(
                    request_id=wire_id,
                    capacity=ctrl.capacity,
                    next_hop=hop,
                    report_to=self.router_address,
                    fills_pipeline=ctrl.fills_pipeline,
                    lease_owner=self.lease.owner,
                    lease_epoch=self.lease.epoch,
                    lease_token=self.lease.token,
                    verify=verify if s is stages[-1] else None,
                    prefix_token_ids=prefix,
                    cache_scope=scope,
                    report_progress=True,  # the stall check follows progress (driver.py)
                ),
                timeout=timeout,
            )
            for s, hop in zip(stages, hops, strict=True)
        ]
        try:
            results = await asyncio.gather(*calls, return_exceptions=True)
        except asyncio.CancelledError:  # the client went away while this path opened
            self._in_background(self._release(stages, wire_id))
            raise
        failed = [
            (s, r) for s, r in zip(stages, results, strict=True) if isinstance(r, BaseException)
        ]
        if not failed:
            # The prefill starts after the prefix every stage of the path holds cached.
            return min(int(getattr(r, "cached_tokens", 0)) for r in results)
        opened = [
            s for s, r in zip(stages, results, strict=True) if not isinstance(r, BaseException)
        ]
        if opened:
            self._in_background(self._release(opened, wire_id))
        s, e = failed[0]
        return s, self.deadline.error(s, "opening the request", e)

    # -- while open ----------------------------------------------------------------------
    def count_rows(self, rows: int) -> None:
        """The request's tree rows in flight now (its load on the path's stages)."""
        if self._claim is not None:
            self._claim.count_rows(rows)

    def stalled_replica(self, now: float) -> Failure | None:
        """A replica of the open path that answers nothing while the request waits on it:
        dead for this request (replayed elsewhere, or the draft dropped, as on a kill)."""
        if not self.holding:
            return None
        for b in self.path.backends:
            quiet = self.backends.stalled_for(b, now)
            if quiet >= self.backends.stall_seconds:
                self.backends.mark_stalls(now)  # stalled for new requests too, from now
                return Failure(
                    self.attempt,
                    grpc.StatusCode.UNAVAILABLE,
                    f"{b.label} stalled: no answer for {quiet:.1f} s",
                    b,
                    replayable=True,
                )
        return None

    def drop_draft(self, message: str) -> None:
        """The draft failed: no new requests go to it until its health says otherwise;
        this request's calls to it stop, and it is released."""
        draft = self.path.draft
        if draft is None:
            return
        self.backends.suspect(draft, message)
        if self.executor is not None:
            self.executor.drop_draft()
        self._in_background(self._release([draft], self.wire_id))
        if self._claim is not None:
            self._claim.leave(draft)
        self.path = RequestPath(self.path.stages, None)

    async def leave_for_replay(self, failed: Backend | None, message: str) -> set[Backend]:
        """Leave the current path after a fault, its copy released before the request
        opens anywhere again: every replica of the path but `failed` and stalled ones is
        asked to release it, and the call waits for their answers. A replica that is only
        slow is not dead: a copy left running there beside its replay computed the same
        prefill twice and doubled that stage's memory (issue 35, F1). Returns the
        replicas that did not confirm (failed, stalled, unreachable, too slow to
        answer): the replay's path leaves them out. `failed` (suspected) and stalled ones
        are released in the background."""
        if failed is not None:
            self.backends.suspect(failed, message)
        if self.executor is not None:
            self.executor.stop()
            self.executor = None
        claim, self._claim = self._claim, None
        if claim is None:
            return set()
        replicas = self.path.backends
        asked = [b for b in replicas if b is not failed and not b.stalled]
        gone = [b for b in replicas if b not in asked]
        if gone:
            self._in_background(self._release(gone, self.wire_id))
        try:
            answers = await self._release(asked, self.wire_id)
        finally:
            claim.release()
        kept = {b for b, ok in zip(asked, answers, strict=True) if not ok}
        for b in kept:
            log.warning("%s: %s did not confirm the release of %s: the replay leaves it out",
                        self.request_id, b.label, self.wire_id)  # fmt: skip
        return set(gone) | kept

    async def release(self) -> None:
        """Free the request's state on every replica of its path (best effort)."""
        self.inbox.close(self.wire_id)
        self._let_go()
        if self._background:
            await asyncio.wait(self._background, timeout=RELEASE_TIMEOUT)

    def _let_go(self) -> None:
        if self.executor is not None:
            self.executor.stop()
            self.executor = None
        if self._claim is not None:
            self._in_background(self._release(self.path.backends, self.wire_id))
            self._claim.release()
            self._claim = None

    async def _release(self, replicas: list[Backend], wire_id: str) -> list[bool]:
        """Release `wire_id` on `replicas`; whether each confirmed it holds no copy (it
        released one, or had none)."""
        calls = [release_on(b, wire_id, RELEASE_TIMEOUT) for b in replicas]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.debug("release of %s failed: %s", wire_id, r)
        return [r is True for r in results]

    def _in_background(self, call: Awaitable) -> None:
        task = asyncio.ensure_future(call)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
