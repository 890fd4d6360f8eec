"""The command executor of one opened path: a controller's commands turned into calls.

`Feed` rows go to stage 1 and `BroadcastPrune`s to every stage over gRPC (gathered with
other requests' calls into `FeedMany` / `PruneMany`, batched.py); the draft's calls
(`DraftOpen`, `DraftPrefill`, `Propose`) run in one ordered lane, so the draft sees
prunes and layers in the order the controller created them, and prunes for the draft
(`DraftPrune`) ride on the next `Propose`. Each call's failure and each draft answer
becomes an event (events.py) tagged with the path's attempt: the driver ignores those of
a path it abandoned. Nothing here decides anything: the commands are the controller's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import torch
from specpipe.common.runtime.prefix_hash import NO_SCOPE, CacheScope
from specpipe.common.spec.commands import (
    BroadcastPrune,
    Command,
    DraftOpen,
    DraftPrefill,
    DraftPrune,
    Feed,
    Propose,
)
from specpipe.common.spec.messages import Candidates
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, stage_pb2

from ..control import cache_scope_to_proto, prune_to_proto, rows_to_proto
from .backends import Backend, RequestPath
from .calls import Deadline, LeaseClaim
from .events import Event, Failure, Proposal

DraftCall = Callable[[object], Awaitable]  # (the draft's stub) -> the call


class CommandExecutor:
    """Carries commands out on `path` for the request's `wire_id` there; `post` takes
    the events its calls produce."""

    def __init__(
        self,
        path: RequestPath,
        wire_id: str,
        attempt: int,
        post: Callable[[Event], None],
        deadline: Deadline,
        lease: LeaseClaim,
        cache_scope: CacheScope = NO_SCOPE,
    ) -> None:
        """`cache_scope`: the request's prefix-cache scope (the draft's Open)."""
        self.path, self.wire_id, self.attempt = path, wire_id, attempt
        self.post, self.deadline, self.lease = post, deadline, lease
        self.cache_scope = cache_scope
        self._tasks: set[asyncio.Task] = set()
        self._draft_q: asyncio.Queue[tuple[str, DraftCall]] = asyncio.Queue()
        self._draft_prunes: list[pb.PruneSignal] = []  # for the draft, with the next layer
        self._lane: asyncio.Task | None = None
        if path.draft is not None:
            self._lane = asyncio.create_task(
                self._draft_lane(path.draft), name=f"draft-lane-{wire_id}"
            )

    def execute(self, cmd: Command, verified_at_ns: int = 0) -> None:
        """Start the calls of `cmd`. `verified_at_ns`: when the last stage sent the
        verification this command follows from (unix ns, 0: none; stage 1 measures the
        step's service overhead with it)."""
        rid, timeout = self.wire_id, self.deadline.timeout
        if isinstance(cmd, Feed):
            stage1 = self.path.stages[0]
            req = stage_pb2.FeedRequest(
                request_id=rid,
                seq=cmd.seq,
                after_prune=cmd.after_prune,
                rows=rows_to_proto(cmd.act),
                token_ids=cmd.act.tokens.tolist(),
                verified_at_ns=verified_at_ns,
            )
            assert stage1.feeds is not None
            self._spawn(stage1, "receiving rows", stage1.feeds.call(req, timeout()))
        elif isinstance(cmd, BroadcastPrune):
            req = pb.PruneRequest(request_id=rid, prune=prune_to_proto(cmd.prune, cmd.seq))
            for s in self.path.stages:
                assert s.prunes is not None
                self._spawn(s, "applying a prune", s.prunes.call(req, timeout()))
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
                lease_owner=self.lease.owner,
                lease_epoch=self.lease.epoch,
                lease_token=self.lease.token,
                cache_scope=cache_scope_to_proto(self.cache_scope),
            )
            self._draft_call("opening the request", lambda stub: stub.Open(req, timeout=timeout()))
        elif isinstance(cmd, DraftPrefill):
            req = draft_pb2.PrefillDraftRequest(
                request_id=rid,
                token_ids=cmd.tokens,
                start_position=cmd.start_position,
                prefill_chunk=cmd.prefill_chunk,
            )
            self._draft_call("prefilling", lambda stub: stub.Prefill(req, timeout=timeout()))
        else:
            raise TypeError(f"unknown command {cmd!r}")

    def drop_draft(self) -> None:
        """The draft is lost: its lane stops, and no call goes to it any more."""
        if self._lane is not None:
            self._lane.cancel()
        self._lane = None
        self._draft_prunes = []
        self.path = RequestPath(self.path.stages, None)

    def stop(self) -> None:
        """The path is abandoned or released: its calls stop."""
        for t in [*self._tasks, *([self._lane] if self._lane else [])]:
            t.cancel()
        self._tasks.clear()
        self._lane = None

    # -- the draft -----------------------------------------------------------------------
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

        async def call(stub) -> None:
            resp = await stub.Propose(req, timeout=self.deadline.timeout())
            cand = Candidates(
                torch.tensor(resp.parent_ids, dtype=torch.int64),
                torch.tensor(resp.token_ids, dtype=torch.int64),
                torch.tensor(resp.probs, dtype=torch.float32),
            )
            self.post(Proposal(self.attempt, cmd.ticket, cand))

        self._draft_call("proposing a tree layer", call, flush_prunes=False)

    def _draft_call(self, what: str, call: DraftCall, flush_prunes: bool = True) -> None:
        """Queue a draft call in the request's lane; prunes not yet sent go first."""
        if self._lane is None:
            return  # the draft was dropped: the controller sends it nothing more
        if flush_prunes:
            for sig in self._draft_prunes:
                req = pb.PruneRequest(request_id=self.wire_id, prune=sig)
                self._draft_q.put_nowait(
                    (
                        "applying a prune",
                        lambda s, r=req: s.Prune(r, timeout=self.deadline.timeout()),
                    )
                )
            self._draft_prunes = []
        self._draft_q.put_nowait((what, call))

    async def _draft_lane(self, draft: Backend) -> None:
        """Run the draft calls of this request one after another, in creation order."""
        while True:
            what, call = await self._draft_q.get()
            try:
                await call(draft.stub)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                err = self.deadline.error(draft, what, e)
                self.post(Failure(self.attempt, err.code, err.message, draft))
                return

    # -- the stages ----------------------------------------------------------------------
    def _spawn(self, b: Backend, what: str, call: Awaitable) -> None:
        """Fire a control call; its failure is an event (replayed or fatal)."""

        async def run() -> None:
            try:
                await call
            except asyncio.CancelledError:
                raise
            except Exception as e:
                err = self.deadline.error(b, what, e)
                self.post(Failure(self.attempt, err.code, err.message, b, err.replayable))

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
