"""Relayed prunes on a stage (services/compute_round.py, stage_service.py): a prune that
came relayed (the router's `PruneRequest.relay`, or on a frame) is applied and passed on
to the next stage on the request's frame there, or on a frame of prunes only where the
round sends it none; the next stage applies it before that frame's activation and frees
the blocks it drops. And the deferred-prune edge: Describe counts the blocks a waiting
prune frees, and an Open that finds no free block has the waiting prunes applied first.
A frame's relayed prunes (every part's of a batch frame), and a control message's
prunes, are queued before any of its activations; relayed prunes for a request the
stage lost tell its router NOT_FOUND."""

from __future__ import annotations

import asyncio

import grpc
import torch
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime.loader import LoadedModel
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation
from specpipe.services.control import rows_to_proto
from specpipe.services.router.frames import failure_of
from specpipe.services.stage_service import StageService
from specpipe.services.transport import Frame, Inbox, encode, make_transport
from specpipe.services.transport.batch import pack
from specpipe.services.transport.codec import empty_header
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import stage_pb2

from ..conftest import greedy_verify
from .test_compute_round_prunes import PROMPT, _hidden, _layer, _prefilled, _prune


def _stage(llama_dir, a: int, b: int) -> StageService:
    model = load_stage(llama_dir, LayerRange(a, b, 5), torch.float64)
    return StageService(LoadedModel(StageRuntime(model), "m", "h", 256, ()))


def _arrive(svc: StageService, frame: Frame) -> None:
    """`frame` received as the transport receives it: its header admitted (the relayed
    prunes it carries are queued then), then delivered."""
    keep = svc.transport._admitted(frame.header)
    if keep:
        svc.transport._deliver(frame, keep)


def _relayed(seq: int) -> pb.PruneRequest:
    req = _prune(seq)
    req.relay = True
    return req


def _round(svc: StageService, turns: bool = True) -> list[tuple[str, tuple]]:
    """One round computed here; the frames it sends, (hop, (header, payload))."""
    (work,) = svc.rounds._collect(turns=turns)
    svc.rounds.compute([work])
    assert work.error is None
    failures: list = []
    frames = svc.rounds._frames_of(work, failures)
    assert failures == []
    return frames


def _rows(svc: StageService) -> int:
    """Rows request "a" holds in the stage's KV cache."""
    return svc.runtime._caches["a"].length


def _used(svc: StageService) -> int:
    return svc.runtime.pool.used_blocks


def test_a_relayed_prune_rides_the_next_frame_and_frees_blocks_at_every_stage(llama_dir) -> None:
    async def main() -> None:
        first, second, last = (
            _stage(llama_dir, 1, 2),
            _stage(llama_dir, 2, 3),
            _stage(llama_dir, 3, 5),
        )
        try:
            for svc in (first, second):
                await _prefilled(svc)
            assert first._take_prune(_relayed(1)) is None  # the router's, to stage 1 only
            first._on_frame(_layer(2, 1))
            ((_, (header, payload)),) = _round(first)
            assert [p.seq for p in header.prunes] == [1] and not header.prunes_only
            assert _rows(first) == PROMPT + 1 + 4  # layer 1's other rows gone, layer 2 in
            # the next stage: the prune with the activation it comes with, applied first
            _arrive(second, Frame(header, payload))
            order = second._requests["a"].order
            assert 1 in order.prunes and order.next_activation() is None  # the prune first
            ((_, (header2, _)),) = _round(second)
            assert [p.seq for p in header2.prunes] == [1]
            assert order.applied == 1 and _rows(second) == PROMPT + 1 + 4
            # the last stage applies it and keeps nothing to pass on
            await last.Open(stage_pb2.OpenStageRequest(request_id="a", capacity=64,
                next_hop="tcp://127.0.0.1:9", verify=greedy_verify(PROMPT)), None)  # fmt: skip
            assert last._take_prune(_relayed(1)) is None
            st = last._requests["a"]
            assert 1 in st.order.prunes and st.to_relay == {}
            caches = [s.runtime._caches["a"] for s in (first, second)]
            assert {c.n_committed for c in caches} == {PROMPT + 1}  # and layer 1's root
        finally:
            for svc in (first, second, last):
                await svc.stop()

    asyncio.run(main())


def test_a_relayed_prune_with_no_frame_to_its_hop_goes_on_a_frame_of_its_own(llama_dir) -> None:
    async def main() -> None:
        first, second = _stage(llama_dir, 1, 2), _stage(llama_dir, 2, 3)
        try:
            for svc in (first, second):
                await _prefilled(svc)
            assert first._take_prune(_relayed(1)) is None
            ((hop, (header, payload)),) = _round(first, turns=False)  # prunes only
            assert header.prunes_only and payload is None and [p.seq for p in header.prunes] == [1]
            assert hop == first._requests["a"].next_hop
            before = _used(second)
            _arrive(second, Frame(header, payload))
            order = second._requests["a"].order
            assert 1 in order.prunes and order.next_seq == 2  # no turn taken
            _round(second, turns=False)
            assert order.applied == 1 and _used(second) < before
            # a prune that did not come relayed is not passed on
            third = _stage(llama_dir, 1, 2)
            await _prefilled(third)
            assert third._take_prune(_prune(1)) is None
            (work,) = third.rounds._collect(turns=False)
            third.rounds.compute([work])
            assert work.relayed == [] and third.rounds._frames_of(work, []) == []
            await third.stop()
        finally:
            for svc in (first, second):
                await svc.stop()

    asyncio.run(main())


def test_describe_counts_the_blocks_a_waiting_prune_frees(llama_dir) -> None:
    async def main() -> None:
        svc = _stage(llama_dir, 1, 3)
        try:
            await _prefilled(svc)
            before = await svc.Describe(pb.DescribeRequest(), None)
            assert svc._take_prune(_prune(1)) is None
            assert svc._requests["a"].order.applied == 0  # deferred: the pool is mostly free
            desc = await svc.Describe(pb.DescribeRequest(), None)
            assert desc.cache_blocks_free > before.cache_blocks_free
            assert desc.cache_blocks_free == svc.runtime.pool.free_blocks
        finally:
            await svc.stop()

    asyncio.run(main())


def test_an_open_with_no_free_block_has_the_waiting_prunes_applied_first(llama_dir) -> None:
    async def main() -> None:
        svc = _stage(llama_dir, 1, 3)
        try:
            await _prefilled(svc)
            pool = svc.runtime.pool
            assert svc._take_prune(_prune(1)) is None  # deferred, then the pool fills up
            pool.max_blocks = pool.used_blocks
            assert svc._requests["a"].order.applied == 0
            await svc.Open(stage_pb2.OpenStageRequest(
                request_id="b", capacity=64, next_hop="tcp://127.0.0.1:9"), None)  # fmt: skip
            assert "b" in svc._requests and svc._requests["a"].order.applied == 1
        finally:
            await svc.stop()

    asyncio.run(main())


def test_the_compute_thread_applies_waiting_prunes_when_asked(llama_dir) -> None:
    """With the compute thread running, `apply_prunes` has it apply them between its
    rounds (never on the event loop) and returns once they are."""

    async def main() -> None:
        svc = _stage(llama_dir, 1, 3)
        await _prefilled(svc)
        task = asyncio.ensure_future(svc.rounds.run_forever())
        try:
            await asyncio.sleep(0.05)
            free = svc.runtime.pool.free_blocks
            assert svc._take_prune(_prune(1)) is None
            assert svc._requests["a"].order.applied == 0
            await asyncio.wait_for(svc.rounds.apply_prunes(5.0), 10)
            assert svc._requests["a"].order.applied == 1 and svc.runtime.pool.free_blocks > free
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await svc.stop()

    asyncio.run(main())


def _rounds_at_once(svc: StageService) -> list[dict[str, object]]:
    """Make every queued activation start a round at once (what the compute thread may
    do whenever it finds one in the inbox); each round's errors by request."""
    rounds: list[dict[str, object]] = []

    def now() -> None:
        work = svc.rounds._collect()
        svc.rounds.compute(work)
        rounds.append({w.st.request_id: w.error for w in work})

    svc.rounds.wake = now  # type: ignore[method-assign]
    return rounds


def _prompt_of(rid: str) -> Frame:
    act = Activation(rid, torch.arange(PROMPT), committed=True, hidden=_hidden(PROMPT, 5))
    return Frame(*encode(act, 0))


def _prunes_only(seq: int) -> pb.FrameHeader:
    """Request "a"'s prune `seq` relayed on a frame of its own."""
    header = empty_header("a", 0, "upstream")
    header.prunes_only = True
    header.prunes.append(_prune(seq).prune)
    return header


def test_a_batch_frames_prunes_are_applied_before_any_of_its_activations(llama_dir) -> None:
    """Request b's activation and a's prunes-only frame in one batch frame, b's first: a
    round that starts as soon as b's activation is queued applies a's prune first, so b
    gets the blocks it frees (taken before it, b failed: KV cache pool exhausted)."""

    async def main() -> None:
        svc = _stage(llama_dir, 1, 3)
        try:
            await _prefilled(svc)
            await svc.Open(stage_pb2.OpenStageRequest(
                request_id="b", capacity=64, next_hop="tcp://127.0.0.1:9"), None)  # fmt: skip
            pool = svc.runtime.pool
            pool.max_blocks = pool.used_blocks  # full: only a's prune frees a block
            rounds = _rounds_at_once(svc)
            b = _prompt_of("b")
            _arrive(svc, Frame(*pack([(b.header, b.payload), (_prunes_only(1), None)])))
            assert rounds == [{"a": None, "b": None}]
            assert svc._requests["a"].order.applied == 1
            assert svc.runtime._caches["b"].length == PROMPT
        finally:
            await svc.stop()

    asyncio.run(main())


def test_a_control_messages_prunes_are_taken_before_its_feeds(llama_dir) -> None:
    """The first stage takes a router's control message's prunes before its feeds, so a
    round started by b's feed applies a's prune first and b gets the block it frees."""

    async def main() -> None:
        svc = _stage(llama_dir, 0, 2)
        try:
            for rid in ("a", "b"):
                await svc.Open(stage_pb2.OpenStageRequest(
                    request_id=rid, capacity=64, next_hop="tcp://127.0.0.1:9"), None)  # fmt: skip
            prompt = Activation("a", torch.arange(PROMPT), committed=True)
            assert svc._take_feed(_token_feed(0, 0, prompt)) is None
            svc.rounds.compute(svc.rounds._collect())
            t = torch.tensor
            layer = Activation("a", t([PROMPT, PROMPT + 1, PROMPT + 1, PROMPT + 2]),
                               node_ids=t([4, 5, 6, 7]), parent_ids=t([-1, 4, 4, 5]))  # fmt: skip
            assert svc._take_feed(_token_feed(1, 0, layer)) is None
            svc.rounds.compute(svc.rounds._collect())
            pool = svc.runtime.pool
            pool.max_blocks = pool.used_blocks
            rounds = _rounds_at_once(svc)
            b = Activation("b", torch.arange(PROMPT), committed=True)
            msg = stage_pb2.StageControl(feeds=[_token_feed(0, 0, b)], prunes=[_prune(1)])
            assert svc._take_control(msg) is None
            assert rounds == [{"a": None, "b": None}]
            assert svc.runtime._caches["b"].length == PROMPT
        finally:
            await svc.stop()

    asyncio.run(main())


def _token_feed(seq: int, after: int, act: Activation) -> stage_pb2.FeedRequest:
    tokens = [3 + int(p) for p in act.positions]
    return stage_pb2.FeedRequest(request_id=act.request_id, seq=seq, after_prune=after,
                                 rows=rows_to_proto(act), token_ids=tokens)  # fmt: skip


def test_relayed_prunes_for_a_request_lost_here_tell_its_router(llama_dir) -> None:
    """A stage that no longer holds a request (its lease expired) and gets its relayed
    prunes answers the router they name (`reply_to`) NOT_FOUND, as it would have
    refused the router's prune; frames without prunes, or naming no router, are dropped
    as before."""

    async def main() -> None:
        inbox = Inbox()
        queue = inbox.open("a")
        router = make_transport("tcp", inbox)
        address = await router.start()
        svc = _stage(llama_dir, 1, 3)
        try:
            await _prefilled(svc)
            svc._drop("a")  # what an expired lease does
            _arrive(svc, _layer(2, 0))  # no prunes: dropped, nobody told
            silent = _prunes_only(1)
            _arrive(svc, Frame(silent, None))  # no router named
            told = _prunes_only(1)
            told.reply_to = address
            _arrive(svc, Frame(told, None))
            frame = await asyncio.wait_for(queue.get(), 10)
            assert failure_of(frame) == (
                grpc.StatusCode.NOT_FOUND,
                "request 'a' is not open on stage layers 1:3/5",
            )
            await asyncio.sleep(0.1)
            assert queue.empty()
        finally:
            await svc.stop()
            await router.close()

    asyncio.run(main())


def test_a_prune_to_apply_at_once_queues_no_wish_without_a_compute_thread(llama_dir) -> None:
    """A relayed prune that asks to be applied at once (`prunes_now`) while no compute
    thread runs (stopped) queues no wish for a round: none would take it."""

    async def main() -> None:
        svc = _stage(llama_dir, 1, 2)
        rounds = svc.rounds
        try:
            await _prefilled(svc)
            assert svc._take_prune(_relayed(1)) is None
            for _ in range(3):
                rounds.prune_arrived(svc._requests["a"], now=True)
            assert rounds._prunes_wanted == []
        finally:
            await svc.stop()

    asyncio.run(main())


def test_relayed_prunes_riding_an_activation_keep_apply_at_once(llama_dir) -> None:
    """Relayed prunes applied for room someone waits for (`relay_now`) tell the next
    stage to apply them at once (`prunes_now`) on the request's activation frame too,
    not only on a frame of prunes only."""

    async def main() -> None:
        svc = _stage(llama_dir, 1, 2)
        try:
            await _prefilled(svc)
            assert svc._take_prune(_relayed(1)) is None
            svc.rounds._prunes_wanted.append(lambda: None)  # an Open waits for room
            svc._on_frame(_layer(2, 1))
            ((_, (header, _)),) = _round(svc)
            assert [p.seq for p in header.prunes] == [1] and not header.prunes_only
            assert header.prunes_now
        finally:
            await svc.stop()

    asyncio.run(main())


def test_relayed_prunes_for_a_lost_request_tell_no_address_outside_the_peers(llama_dir) -> None:
    """The NOT_FOUND answer to relayed prunes for a request not open here goes only to
    a `reply_to` on this stage's peers (loopback by default): a frame naming another
    host makes the stage send nothing."""

    async def main() -> None:
        svc = _stage(llama_dir, 1, 3)
        sent: list[str] = []
        svc._send_later = lambda address, *_: sent.append(address)  # type: ignore[method-assign]
        try:
            await _prefilled(svc)
            svc._drop("a")
            for reply_to in ("tcp://10.20.30.40:9", "tcp://127.0.0.1:9"):
                told = _prunes_only(1)
                told.reply_to = reply_to
                _arrive(svc, Frame(told, None))
            assert sent == ["tcp://127.0.0.1:9"]  # the peer's only
        finally:
            await svc.stop()

    asyncio.run(main())


def test_an_open_gets_the_room_of_relayed_prunes_that_arrive_while_others_are_applied(
    llama_dir,
) -> None:
    """A relayed prune that arrives while an Open (after the first stage, its pool
    full) has the waiting prunes applied is applied next, without a wait for another
    arrival: the Open gets the block it frees."""

    async def main() -> None:
        svc = _stage(llama_dir, 1, 3)
        rounds = svc.rounds
        applied = rounds.apply_prunes
        arrivals = [_prunes_only(1)]

        async def apply_prunes(timeout: float) -> None:
            await applied(timeout)
            if arrivals:  # relayed from upstream meanwhile
                _arrive(svc, Frame(arrivals.pop(), None))

        rounds.apply_prunes = apply_prunes  # type: ignore[method-assign]
        try:
            await _prefilled(svc)
            pool = svc.runtime.pool
            pool.max_blocks = pool.used_blocks
            await svc.Open(stage_pb2.OpenStageRequest(
                request_id="b", capacity=64, next_hop="tcp://127.0.0.1:9"), None)  # fmt: skip
            assert "b" in svc._requests and svc._requests["a"].order.applied == 1
        finally:
            await svc.stop()

    asyncio.run(main())
