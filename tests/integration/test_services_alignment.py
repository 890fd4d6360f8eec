"""Step alignment in the stage service (StepAligner in its compute loop): a round waits
for a request expected shortly and computes both in one forward, which without
alignment take two; a request that never comes holds a round only for its window; and
concurrent requests through a 3-stage deployment that waits long still get exactly
their single-request tokens."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families
from specpipe.common.runtime.alignment import StepAligner
from specpipe.services.stage_service import StageService
from specpipe.services.transport import Inbox, make_transport
from specpipe.v1 import stage_pb2, stage_pb2_grpc

from specpipe.client import Client

from .conftest import reference, start
from .test_services_stage import _chain, _chain_drawn, _drawn, _feed, _open_last, _rows, _stage

RIDS = ("r0", "r1")


@contextlib.asynccontextmanager
async def _one_stage(llama_dir, aligner: StepAligner):
    """All 5 layers in one stage service (first and last), requests r0 and r1 open on
    it, and the router-side inbox of their verifications."""
    inbox = Inbox()
    queues = {rid: inbox.open(rid) for rid in RIDS}
    router = make_transport("tcp", inbox)
    router_addr = await router.start()
    svc = StageService(_stage(llama_dir, 0, 5, 5))
    svc.aligner = aligner
    port = await svc.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = stage_pb2_grpc.StageStub(ch)
            for rid in RIDS:
                await stub.Open(_open_last(rid, router_addr))
            yield svc, stub, queues
    finally:
        await svc.stop()
        await router.close()


def _feeds(llama_dir, rid: str) -> list[stage_pb2.FeedRequest]:
    """The request of `_chain`: prompt [5, 9] (seq 0), then its tree (seq 1)."""
    prefill = _feed(0, 0, _rows([0, 1], [], [], committed=True), [5, 9])
    tree = _feed(1, 0, *_chain(llama_dir))
    for f in (prefill, tree):
        f.request_id = rid
    return [prefill, tree]


def _samples(svc: StageService) -> dict[str, float]:
    """The stage's metrics, as its /metrics page would serve them."""
    from prometheus_client import generate_latest

    text = generate_latest(svc.metrics.registry).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _forwards(svc: StageService) -> tuple[int, int]:
    """(forwards with rows, requests summed over them)."""
    m = _samples(svc)
    return int(m["specpipe:stage_batch_requests_count"]), int(
        m["specpipe:stage_batch_requests_sum"]
    )


def _run_aligned_or_not(llama_dir, wait: float) -> tuple[int, int]:
    """r1's tree reaches the stage before its prompt (r1 is then expected: its prompt is
    in flight); r0's prompt comes next, r1's prompt last. Both requests get the
    engine's greedy tokens; returns the stage's forwards."""

    async def main() -> tuple[int, int]:
        aligner = StepAligner(1.0)
        aligner.wait = wait  # a window no loaded machine reaches (past the flag's bound)
        async with _one_stage(llama_dir, aligner) as (svc, stub, queues):
            r0, r1 = _feeds(llama_dir, "r0"), _feeds(llama_dir, "r1")
            await stub.Feed(r1[1])
            await stub.Feed(r0[0])
            await stub.Feed(r0[1])
            if wait:
                await asyncio.sleep(0.2)
                assert queues["r0"].empty()  # held: r1 is expected
            else:
                await asyncio.wait_for(queues["r0"].get(), 30)  # computed alone
            await stub.Feed(r1[0])
            for rid in RIDS if wait else ("r1",):
                got = _drawn(await asyncio.wait_for(queues[rid].get(), 30))
                assert got == _chain_drawn(llama_dir)
            return _forwards(svc)

    return asyncio.run(main())


def test_a_round_waits_for_an_expected_request_and_shares_its_forward(llama_dir) -> None:
    forwards, requests = _run_aligned_or_not(llama_dir, 0.0)
    assert forwards >= 2 and requests == forwards  # without alignment: one request each
    assert _run_aligned_or_not(llama_dir, 60.0) == (1, 2)  # with: one forward of both


def test_a_request_that_never_comes_holds_a_round_only_for_its_window(llama_dir) -> None:
    """r1's prompt never arrives: r0 is computed once r1's window is over (in one round,
    or two if its tree came after the first window), and rounds are counted as waited."""

    async def main() -> None:
        async with _one_stage(llama_dir, StepAligner(0.2)) as (svc, stub, queues):
            r0, r1 = _feeds(llama_dir, "r0"), _feeds(llama_dir, "r1")
            await stub.Feed(r1[1])
            for f in r0:
                await stub.Feed(f)
            got = _drawn(await asyncio.wait_for(queues["r0"].get(), 30))
            assert got == _chain_drawn(llama_dir)
            forwards, requests = _forwards(svc)
            assert forwards in (1, 2) and requests == forwards
            assert _samples(svc)["specpipe:stage_batch_wait_seconds_count"] >= 1
            assert queues["r1"].empty()

    asyncio.run(main())


def scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_concurrent_requests_through_aligning_stages_are_exact(llama_dir) -> None:
    """Four concurrent specpipe requests and two pp ones through 3 stages and the draft,
    every one waiting up to 100 ms a round for the others: each gets exactly its
    single-request tokens, and the stages computed them in batched forwards."""
    dep = start(llama_dir, "oracle", 3, "tcp", metrics=True, batch_wait=0.1)
    try:
        asks = [([1, 2, 3], "specpipe"), ([7, 5], "specpipe"), ([11, 4, 9, 2], "specpipe"),
                ([3, 3], "specpipe"), ([6, 1, 8], "pp"), ([2, 9], "pp")]  # fmt: skip
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            prompt, mode = asks[i]
            with Client(dep.router_address, timeout=120) as c:
                out = c.generate(prompt_ids=prompt, mode=mode, max_new_tokens=10, ignore_eos=True)
            results[i] = out.token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(asks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        for i, (prompt, mode) in enumerate(asks):
            assert results[i] == reference(dep.target, "oracle", 3, prompt, mode, 10), asks[i]
        for child in dep.children.values():  # `specpipe up` passes the flag through
            if child.kind in ("stage", "draft"):
                i = child.argv.index("--batch-wait-ms")
                assert child.argv[i + 1] == "100", child.argv
        feeds = []  # (calls, feeds) per stage
        for name, address in dep.metrics_addresses().items():
            if name.startswith("stage"):
                m = scrape(address)
                n = m["specpipe:stage_batch_requests_count"]
                assert n > 0 and m["specpipe:stage_batch_requests_sum"] >= n
                feeds.append((m["specpipe:stage_feeds_per_call_count"],
                              m["specpipe:stage_feeds_per_call_sum"]))  # fmt: skip
        # Only stage 1 takes feeds, and the router sends several in one FeedMany (at
        # least a request's prompt and root, which it feeds at once).
        fed = [(calls, n) for calls, n in feeds if calls]
        assert len(fed) == 1 and fed[0][1] > fed[0][0], feeds
    finally:
        dep.stop()
