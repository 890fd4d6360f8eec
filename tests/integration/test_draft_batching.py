"""The draft's batched forward takes prefill chunks beside proposals: a prompt that
arrives while running requests wait for their answers costs them no forward of its
own, and what it caches is what a prefill alone caches."""

from __future__ import annotations

import asyncio

import grpc
import torch
from specpipe.common.perf.emulate import EmulatedCosts, Pacer
from specpipe.common.runtime.loader import load_draft
from specpipe.common.spec.messages import Activation
from specpipe.services import draft_service
from specpipe.services.control import rows_to_proto
from specpipe.services.draft_service import DraftService
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, draft_pb2_grpc

FORWARD_SECONDS = 0.3  # every draft forward, paced: long enough for calls to queue


def _layer(rid: str, position: int, token: int) -> Activation:
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return Activation(rid, t([position]), node_ids=t([0]), parent_ids=t([-1]), tokens=t([token]))


def _propose(rid: str, position: int, token: int) -> draft_pb2.ProposeRequest:
    rows = rows_to_proto(_layer(rid, position, token))
    return draft_pb2.ProposeRequest(request_id=rid, rows=rows, token_ids=[token], top_k=3)


def test_prompts_join_the_proposals_forward_and_cache_the_same(llama_dir) -> None:
    prompts = {"a": [5, 9, 2, 7], "b": [3, 1, 4, 1, 5, 9], "c": [2, 7, 1, 8], "d": [6, 2, 8]}
    pacer = Pacer(EmulatedCosts.flat(FORWARD_SECONDS, FORWARD_SECONDS).draft(), "draft")

    async def main() -> dict[str, draft_pb2.ProposeResponse]:
        draft = DraftService(llama_dir, dtype="float64", pacer=pacer)
        port = await draft.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = draft_pb2_grpc.DraftStub(channel)

        def propose(rid: str):
            p = prompts[rid]
            return stub.Propose(_propose(rid, len(p) - 1, p[-1]))

        def prefill(rid: str):
            p = prompts[rid]
            req = draft_pb2.PrefillDraftRequest(request_id=rid, token_ids=p[:-1])
            return stub.Prefill(req)

        try:
            for rid, p in prompts.items():  # b and c open with their first token only
                ids = p if rid in "ad" else p[:1]
                await stub.Open(
                    draft_pb2.OpenDraftRequest(request_id=rid, capacity=32, prompt_ids=ids)
                )
            before = _count(draft.metrics.forward_seconds.collect()[0])
            # a's ask computes; meanwhile d's ask and b's and c's prompts arrive: one
            # forward takes all three (not one each)
            first = asyncio.ensure_future(propose("a"))
            await asyncio.sleep(FORWARD_SECONDS / 3)
            answers = await asyncio.gather(first, propose("d"), prefill("b"), prefill("c"))
            assert _count(draft.metrics.forward_seconds.collect()[0]) - before == 2
            got = {"a": answers[0], "d": answers[1]}
            for rid in ("b", "c"):
                got[rid] = await propose(rid)
            return got
        finally:
            await channel.close()
            await draft.stop()

    got = asyncio.run(main())
    alone = load_draft(llama_dir, torch.float64)  # each request prefilled on its own
    for rid, p in prompts.items():
        alone.open(rid, 32)
        alone.prefill(rid, torch.tensor(p[:-1]), 0, 64)
        want = alone.propose(_layer(rid, len(p) - 1, p[-1]), 3)
        assert list(got[rid].token_ids) == want.tokens.tolist()
        torch.testing.assert_close(
            torch.tensor(list(got[rid].probs), dtype=want.probs.dtype), want.probs
        )


def _count(metric) -> float:
    return next(s.value for s in metric.samples if s.name.endswith("_count"))


def test_a_bad_prune_fails_its_request_alone_in_a_shared_forward(llama_dir) -> None:
    """One control message, two proposals: one forward (its prunes in one pass); the
    request whose prune commits a node it never cached fails, the other is answered as a
    draft alone answers it."""
    prompts = {"a": [5, 9, 2, 7], "b": [3, 1, 4, 1, 5, 9]}

    async def main() -> dict[str, draft_pb2.DraftAnswer]:
        draft = DraftService(llama_dir, dtype="float64")
        port = await draft.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = draft_pb2_grpc.DraftStub(channel)
        try:
            for rid, p in prompts.items():
                req = draft_pb2.OpenDraftRequest(request_id=rid, capacity=32, prompt_ids=p)
                await stub.Open(req)
            before = _count(draft.metrics.forward_seconds.collect()[0])
            bad = pb.PruneSignal(seq=1, commit_ids=[77], horizon=77)
            calls = [
                draft_pb2.DraftCall(call_id=1, propose=_propose("a", 3, 7)),
                draft_pb2.DraftCall(call_id=2, propose=_propose("b", 5, 9)),
            ]
            calls[0].propose.prunes.append(bad)
            stream = stub.Control()
            await stream.write(draft_pb2.DraftControl(calls=calls))
            answers: dict[int, draft_pb2.DraftAnswer] = {}
            while len(answers) < 2:
                for answer in (await stream.read()).answers:
                    answers[answer.call_id] = answer
            await stream.done_writing()
            assert _count(draft.metrics.forward_seconds.collect()[0]) - before == 1
            return {"a": answers[1], "b": answers[2]}
        finally:
            await channel.close()
            await draft.stop()

    got = asyncio.run(main())
    assert got["a"].code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "cannot commit node ids [77]" in got["a"].message
    assert got["b"].code == 0
    alone = load_draft(llama_dir, torch.float64)
    alone.open("b", 32)
    alone.prefill("b", torch.tensor(prompts["b"][:-1]), 0, 64)
    want = alone.propose(_layer("b", 5, 9), 3)
    assert list(got["b"].proposal.token_ids) == want.tokens.tolist()
    assert list(got["b"].proposal.parent_ids) == want.parent_ids.tolist()
    torch.testing.assert_close(
        torch.tensor(list(got["b"].proposal.probs), dtype=want.probs.dtype), want.probs
    )


def test_a_batch_is_counted_once_and_its_waiting_rows_are_seen(llama_dir) -> None:
    """Three proposals in two forwards: the metrics of a forward are updated once for all
    its requests (two queue waits observed, not three); while two proposals wait behind
    the first forward the queued-rows gauge shows their rows; proposals of one control
    message computed together are answered in one reply."""
    prompts = {"a": [5, 9, 2, 7], "b": [3, 1, 4, 1, 5, 9], "c": [2, 7, 1, 8]}
    pacer = Pacer(EmulatedCosts.flat(FORWARD_SECONDS, FORWARD_SECONDS).draft(), "draft")

    async def main() -> None:
        draft = DraftService(llama_dir, dtype="float64", pacer=pacer)
        port = await draft.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = draft_pb2_grpc.DraftStub(channel)
        m = draft.metrics
        try:
            for rid, p in prompts.items():
                req = draft_pb2.OpenDraftRequest(request_id=rid, capacity=32, prompt_ids=p)
                await stub.Open(req)
            counts = [m.forward_seconds, m.queue_seconds, m.batch_requests]
            before = [_count(c.collect()[0]) for c in counts]
            first = stub.Propose(_propose("a", 3, 7))
            await asyncio.sleep(FORWARD_SECONDS / 3)  # a's forward runs
            calls = [
                draft_pb2.DraftCall(call_id=i, propose=_propose(rid, len(p) - 1, p[-1]))
                for i, (rid, p) in enumerate(prompts.items())
                if rid != "a"
            ]
            stream = stub.Control()
            await stream.write(draft_pb2.DraftControl(calls=calls))
            await asyncio.sleep(FORWARD_SECONDS / 6)
            assert draft._queued_rows() == 2  # b's and c's one node each
            await first
            reply = await stream.read()
            assert sorted(a.call_id for a in reply.answers) == [1, 2]
            assert all(a.code == 0 and len(a.proposal.token_ids) == 3 for a in reply.answers)
            await stream.done_writing()
            assert draft._queued_rows() == 0
            after = [_count(c.collect()[0]) for c in counts]
            assert [x - y for x, y in zip(after, before, strict=True)] == [2, 2, 2]
        finally:
            await channel.close()
            await draft.stop()

    asyncio.run(main())


def test_an_answer_that_fails_to_be_made_fails_its_call_alone(llama_dir, monkeypatch) -> None:
    """A bug making one proposal's answer (here `_proposal`, made where the batch's
    results are delivered) answers that call INTERNAL; the batch's other call is
    answered and the draft serves on."""
    prompts = {"a": [5, 9, 2, 7], "b": [3, 1, 4, 1, 5, 9]}
    made = draft_service._proposal
    calls_made: list[object] = []

    def proposal(cand):
        calls_made.append(cand)
        if len(calls_made) == 1:
            raise ValueError("a bug")
        return made(cand)

    monkeypatch.setattr(draft_service, "_proposal", proposal)

    async def main() -> None:
        draft = DraftService(llama_dir, dtype="float64")
        port = await draft.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = draft_pb2_grpc.DraftStub(channel)
        try:
            for rid, p in prompts.items():
                req = draft_pb2.OpenDraftRequest(request_id=rid, capacity=32, prompt_ids=p)
                await stub.Open(req)
            calls = [
                draft_pb2.DraftCall(call_id=1, propose=_propose("a", 3, 7)),
                draft_pb2.DraftCall(call_id=2, propose=_propose("b", 5, 9)),
            ]
            stream = stub.Control()
            await stream.write(draft_pb2.DraftControl(calls=calls))
            answers: dict[int, draft_pb2.DraftAnswer] = {}
            while len(answers) < 2:
                for answer in (await asyncio.wait_for(stream.read(), 10)).answers:
                    answers[answer.call_id] = answer
            await stream.done_writing()
            assert answers[1].code == grpc.StatusCode.INTERNAL.value[0]
            assert "a bug" in answers[1].message
            assert answers[2].code == 0 and len(answers[2].proposal.token_ids) == 3
            await stub.Open(draft_pb2.OpenDraftRequest(request_id="c", capacity=32,
                                                       prompt_ids=[2, 7, 1, 8]))  # fmt: skip
            again = await asyncio.wait_for(stub.Propose(_propose("c", 3, 8)), 10)
            assert len(again.token_ids) == 3
        finally:
            await channel.close()
            await draft.stop()

    asyncio.run(main())
