"""The command executor of one opened path: a controller's commands turned into calls.

`Feed` rows go to stage 1 and `BroadcastPrune`s to every stage on each stage's control
stream (control_stream.py: one long-lived gRPC stream per replica, shared with the
router's other requests), or to stage 1 only where every stage of the path relays them
(`StageStream.relays`: each passes them on to the next on the request's frames); the
draft's calls (`DraftOpen` as a unary call, `DraftPrefill` and `Propose` on its
stream) run in one ordered lane (draft_lane.py: each call sent once the one before it
was answered, chained by callbacks), so the draft sees prunes and layers in the order
the controller created them, and prunes for the draft (`DraftPrune`) ride on the next
`Propose`. Each refusal, broken stream and draft answer becomes an event
(events.py) tagged with the path's attempt: the driver ignores those of a path it
abandoned. Nothing here decides anything: the commands are the controller's.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

import numpy as np
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
from specpipe.common.spec.messages import Candidates, RowArrays
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, stage_pb2

from ..control import array_of, cache_scope_to_proto, prune_to_proto, rows_to_proto
from .backends import Backend, RequestPath
from .batched import refusal
from .calls import Deadline, LeaseClaim
from .control_stream import DraftStream, StageStream, release_confirmed
from .draft_lane import DraftLane, OnAnswer, Start
from .events import Event, Failure, Proposal


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
        for s in path.stages:  # refusals and broken streams of this request
            self._stream(s).attach(wire_id, self._on_fault(s))
        # prunes to stage 1 only, passed on stage to stage (StageStream.relays)
        self.relay = all(self._stream(s).relays for s in path.stages)
        self._draft_prunes: list[pb.PruneSignal] = []  # for the draft, with the next layer
        # the last rows sent, as messages take them: a layer goes to stage 1 (`Feed`) and
        # to the draft (`Propose`) as the same `RowArrays`, converted once (issue 34)
        self._rows_sent: tuple[RowArrays, pb.Rows, list[int]] | None = None
        self._lane: DraftLane | None = None
        if path.draft is not None:
            self._lane = DraftLane(
                path.draft, deadline, functools.partial(self._draft_failed, path.draft)
            )

    def execute(self, cmd: Command, verified_at_ns: int = 0) -> None:
        """Start the calls of `cmd`. `verified_at_ns`: when the last stage sent the
        verification this command follows from (unix ns, 0: none; stage 1 measures the
        step's service overhead with it)."""
        rid, timeout = self.wire_id, self.deadline.timeout
        if isinstance(cmd, Feed):
            stage1 = self.path.stages[0]
            rows, tokens = self._rows_of(cmd.rows)
            req = stage_pb2.FeedRequest(
                request_id=rid,
                seq=cmd.seq,
                after_prune=cmd.after_prune,
                rows=rows,
                token_ids=tokens,
                verified_at_ns=verified_at_ns,
            )
            self._stream(stage1).feed(req, timeout())
        elif isinstance(cmd, BroadcastPrune):
            req = pb.PruneRequest(
                request_id=rid, prune=prune_to_proto(cmd.ids, cmd.seq), relay=self.relay
            )
            for s in self.path.stages[:1] if self.relay else self.path.stages:
                self._stream(s).prune(req, timeout())
        elif isinstance(cmd, DraftPrune):
            self._draft_prunes.append(prune_to_proto(cmd.ids, cmd.seq))
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
            self._draft_call(
                "opening the request",
                lambda d: asyncio.ensure_future(d.stub.Open(req, timeout=timeout())),
            )
        elif isinstance(cmd, DraftPrefill):
            req = draft_pb2.PrefillDraftRequest(
                request_id=rid,
                token_ids=cmd.tokens,
                start_position=cmd.start_position,
                prefill_chunk=cmd.prefill_chunk,
            )
            self._draft_call("prefilling", lambda d: self._on_stream(d, prefill=req))
        else:
            raise TypeError(f"unknown command {cmd!r}")

    def drop_draft(self) -> None:
        """The draft is lost: its lane stops, and no call goes to it any more."""
        if self._lane is not None:
            self._lane.close()
        self._lane = None
        self._draft_prunes = []
        self.path = RequestPath(self.path.stages, None)

    def stop(self) -> None:
        """The path is abandoned or released: its calls stop."""
        for s in self.path.stages:
            self._stream(s).detach(self.wire_id)
        if self._lane is not None:
            self._lane.close()
        self._lane = None

    def _rows_of(self, rows: RowArrays) -> tuple[pb.Rows, list[int]]:
        """`rows` as a message's `rows` and `token_ids` (the message copies both where it
        takes them: they are never written here, so the next command may take them too)."""
        sent = self._rows_sent
        if sent is not None and sent[0] is rows:
            return sent[1], sent[2]
        converted = (rows, rows_to_proto(rows), rows.tokens.tolist())
        self._rows_sent = converted
        return converted[1], converted[2]

    # -- the draft -----------------------------------------------------------------------
    def _propose(self, cmd: Propose) -> None:
        rows, tokens = self._rows_of(cmd.rows)
        req = draft_pb2.ProposeRequest(
            request_id=self.wire_id,
            rows=rows,
            token_ids=tokens,
            top_k=cmd.top_k,
            temperature=cmd.temperature,
            prunes=self._draft_prunes,
        )
        self._draft_prunes = []
        attempt, post, ticket = self.attempt, self.post, cmd.ticket

        def answered(resp: draft_pb2.ProposeResponse) -> None:
            post(Proposal(attempt, ticket, answer_candidates(resp)))

        self._draft_call(
            "proposing a tree layer",
            lambda d: self._on_stream(d, propose=req),
            answered,
            flush_prunes=False,
        )

    def _draft_call(
        self,
        what: str,
        start: Start,
        on_answer: OnAnswer | None = None,
        flush_prunes: bool = True,
    ) -> None:
        """A draft call in the request's lane (after the ones before it were answered);
        prunes not yet sent go first."""
        lane = self._lane
        if lane is None:
            return  # the draft was dropped: the controller sends it nothing more
        if flush_prunes:
            for sig in self._draft_prunes:
                req = pb.PruneRequest(request_id=self.wire_id, prune=sig)
                lane.add("applying a prune", lambda d, r=req: self._on_stream(d, prune=r))
            self._draft_prunes = []
        lane.add(what, start, on_answer)

    def _draft_failed(self, draft: Backend, what: str, error: BaseException) -> None:
        """A draft call failed or went unanswered: the lane stopped; the driver is told."""
        err = self.deadline.error(draft, what, error)
        self.post(Failure(self.attempt, err.code, err.message, draft))

    def _on_stream(self, draft: Backend, **call) -> asyncio.Future:
        """One call on the draft's control stream (its answer: the lane's deadline
        sweep gives up on a draft that answers nothing, as on a unary call past its
        deadline)."""
        stream = draft.control
        assert isinstance(stream, DraftStream)
        return stream.call(self.deadline.timeout(), **call)

    # -- the stages ----------------------------------------------------------------------
    @staticmethod
    def _stream(b: Backend) -> StageStream:
        assert isinstance(b.control, StageStream)
        return b.control

    def _on_fault(self, b: Backend) -> Callable[[int, str], None]:
        """What a refusal of this request's item on `b`'s stream, or its break, posts:
        a failure event, as a failed unary call's (replayed or fatal)."""

        def told(code: int, message: str) -> None:
            err = self.deadline.error(b, "taking control messages", refusal(code, message))
            self.post(Failure(self.attempt, err.code, err.message, b, err.replayable))

        return told


def answer_candidates(resp: draft_pb2.ProposeResponse) -> Candidates:
    """The draft's answer as the controller takes it: numpy arrays, no tensor (the
    router makes none: common/spec/messages.py)."""
    return Candidates(
        array_of(resp.parent_ids), array_of(resp.token_ids), array_of(resp.probs, np.float32)
    )


async def release_on(b: Backend, wire_id: str, timeout: float) -> bool:
    """Free a request on a replica: on its control stream (a unary Release where it has
    none), within `timeout` seconds. Whether the replica confirmed it holds no copy (a
    replay leaves out those that did not: path_session.leave_for_replay)."""
    ref = pb.RequestRef(request_id=wire_id)
    if isinstance(b.control, StageStream):
        try:
            return await asyncio.wait_for(b.control.release(wire_id), timeout)
        except TimeoutError:
            return False
    if isinstance(b.control, DraftStream):
        call = asyncio.ensure_future(b.control.call(timeout, release=ref))
    else:
        call = asyncio.ensure_future(b.stub.Release(ref, timeout=timeout))
    await asyncio.wait([call], timeout=timeout)
    if not call.done():
        call.cancel()
    return release_confirmed(call)
