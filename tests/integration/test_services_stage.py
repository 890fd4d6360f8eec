"""The stage service's ordering rules, in one process: activations are computed in
`seq` order whatever order they arrive in, wait for the prunes they were created after,
late nodes a prune dropped are skipped (also after several prunes), and the last
stage's verifications draw the engine's greedy tokens."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime.loader import LoadedModel
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation, Prune
from specpipe.services.control import prune_to_proto, rows_to_proto
from specpipe.services.stage_service import StageService
from specpipe.services.transport import Inbox, make_transport
from specpipe.services.transport.codec import Kind
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import stage_pb2, stage_pb2_grpc

from ..conftest import greedy_verify

# The services compute the same rows as the in-process reference, but with other cache
# shapes (rows arrive in other groupings), and fp32 reductions differ with shape and with
# the CPU's BLAS kernels (~2e-5 seen between machines). In fp64 that noise is ~1e-13, far
# below the default fp64 tolerance of `assert_close`, so the comparisons stay exact checks.
DTYPE = torch.float64


def _stage(model_dir, a: int, b: int, n: int) -> LoadedModel:
    model = load_stage(model_dir, LayerRange(a, b, n), DTYPE)
    return LoadedModel(StageRuntime(model), "m", "h", 256, ())


def _rows(positions, node_ids, parent_ids, committed=False) -> Activation:
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return Activation(
        "r", t(positions), committed=committed, node_ids=t(node_ids), parent_ids=t(parent_ids)
    )


def _feed(seq: int, after: int, act: Activation, tokens: list[int]) -> stage_pb2.FeedRequest:
    return stage_pb2.FeedRequest(
        request_id="r", seq=seq, after_prune=after, rows=rows_to_proto(act), token_ids=tokens
    )


@dataclass
class _Pair:
    """Stages [0, 2) and [2, 5) as services, their stubs, and a router-side inbox."""

    queues: dict[str, asyncio.Queue]
    router_addr: str
    first: StageService
    last: StageService
    s0: stage_pb2_grpc.StageStub
    s1: stage_pb2_grpc.StageStub


@contextlib.asynccontextmanager
async def _stage_pair(llama_dir, rids=("r",)):
    inbox = Inbox()
    queues = {rid: inbox.open(rid) for rid in rids}
    router = make_transport("tcp", inbox)
    router_addr = await router.start()
    first, last = StageService(_stage(llama_dir, 0, 2, 5)), StageService(_stage(llama_dir, 2, 5, 5))
    p0, p1 = await first.start(), await last.start()
    ch0 = grpc.aio.insecure_channel(f"127.0.0.1:{p0}")
    ch1 = grpc.aio.insecure_channel(f"127.0.0.1:{p1}")
    try:
        s0, s1 = stage_pb2_grpc.StageStub(ch0), stage_pb2_grpc.StageStub(ch1)
        yield _Pair(queues, router_addr, first, last, s0, s1)
    finally:
        await ch0.close()
        await ch1.close()
        for svc in (first, last):
            await svc.stop()
        await router.close()


@contextlib.asynccontextmanager
async def _two_stages(llama_dir):
    async with _stage_pair(llama_dir) as p:
        yield p.queues["r"], p.router_addr, p.last, p.s0, p.s1


def _open_last(rid: str, next_hop: str) -> stage_pb2.OpenStageRequest:
    """A last stage's Open of a greedy request (it verifies it)."""
    return stage_pb2.OpenStageRequest(
        request_id=rid, capacity=64, next_hop=next_hop, verify=greedy_verify()
    )


@functools.cache
def _greedy(model_dir: Path, seq: tuple[int, ...], n: int) -> list[int]:
    """The in-process model's greedy continuation of `seq` (n tokens), each from a
    forward of the whole sequence (no cache): what a last stage must draw."""
    model = load_stage(model_dir, None, DTYPE)
    out, seq = [], list(seq)
    with torch.inference_mode():
        for _ in range(n):
            hidden = model(model.embed(torch.tensor(seq)), torch.arange(len(seq)))
            out.append(int(model.logits(hidden)[-1].argmax()))
            seq.append(out[-1])
    return out


def _chain(model_dir: Path) -> tuple[Activation, list[int]]:
    """After prompt [5, 9]: root 13 (node 0), child (node 1) and grandchild (node 3),
    their tokens the greedy continuation, so the last stage's walk goes down all three;
    the rows and their tokens."""
    g = _greedy(model_dir, (5, 9, 13), 2)
    return _rows([2, 3, 4], [0, 1, 3], [-1, 0, 1]), [13, *g]


def _chain_drawn(model_dir: Path) -> tuple[list[int], list[int], int]:
    """The verification of `_chain`: nodes drawn at, the engine's greedy tokens there,
    the root's position."""
    return [0, 1, 3], _greedy(model_dir, (5, 9, 13), 3), 2


def _drawn(frame) -> tuple[list[int], list[int], int]:
    """(nodes drawn at, tokens drawn, root position) of a last stage's Verification."""
    assert frame.kind == Kind.PAYLOAD_KIND_VERIFIED, frame.header
    v = frame.header.verified
    return list(v.node_ids), list(v.token_ids), v.position


@pytest.mark.parametrize("batched", [False, True], ids=["Prune", "PruneMany"])
def test_order_prune_gating_and_late_nodes(llama_dir, batched) -> None:
    """With PruneMany, each stage gets both prunes in one call (out of order), with a
    duplicate and one for a request it does not hold, each refused on its own."""

    async def main() -> None:
        # The tree's path (nodes 0, 1, 3) is the greedy continuation; nodes 2 and 4 are
        # off it: the last stage verifies each path row as it comes, and drops the others.
        g = _greedy(llama_dir, (5, 9, 13), 4)
        off = [(g[0] + 1) % 97, (g[1] + 1) % 97]
        async with _two_stages(llama_dir) as (out, router_addr, last, s0, s1):
            await s1.Open(_open_last("r", router_addr))
            await s0.Open(
                stage_pb2.OpenStageRequest(
                    request_id="r",
                    capacity=64,
                    next_hop=last.transport.address,
                    report_to=router_addr,
                )
            )
            # Root (node 0) and its children (1 on the path, 2 off it) arrive before the
            # prefill.
            await s0.Feed(_feed(2, 0, _rows([3, 3], [1, 2], [0, 0]), [g[0], off[0]]))
            await s0.Feed(_feed(1, 0, _rows([2], [0], [-1]), [13]))
            await asyncio.sleep(0.2)
            assert out.empty()  # nothing computed before seq 0
            await s0.Feed(_feed(0, 0, _rows([0, 1], [], [], committed=True), [5, 9]))
            root = _drawn(await asyncio.wait_for(out.get(), 10))
            kids = _drawn(await asyncio.wait_for(out.get(), 10))
            assert root == ([0], [g[0]], 2) and kids == ([1], [g[1]], 3)
            # Grandchildren 3 (under 1) and 4 (under 2), made before the first prune.
            await s0.Feed(_feed(3, 0, _rows([4, 4], [3, 4], [1, 2]), [g[1], off[1]]))
            # Prune 1: hit on node 1 (keeps 1 and 3). Prune 2: miss at node 1 (keeps
            # nothing); its horizon is the largest id ever created (4), not the largest id
            # still in the tree (3). The restart root waits for prune 2; a late copy of
            # node 4 (dropped by prune 1, parent gone) arrives after both and is skipped.
            await s0.Feed(_feed(5, 2, _rows([4], [5], [-1]), [30]))  # restart root, early
            grand = _drawn(await asyncio.wait_for(out.get(), 10))
            assert grand == ([3], [g[2]], 4)
            await asyncio.sleep(0.2)
            assert out.empty()
            prunes = [
                Prune(torch.tensor([0]), torch.tensor([1, 3]), horizon=4),
                Prune(torch.tensor([1]), torch.empty(0, dtype=torch.int64), horizon=4),
            ]
            signals = [
                pb.PruneRequest(request_id="r", prune=prune_to_proto(prunes[seq - 1], seq))
                for seq in (2, 1)  # out of order: applied in order
            ]
            for stub in (s0, s1):
                if not batched:
                    for req in signals:
                        await stub.Prune(req)
                    continue
                other = pb.PruneRequest(request_id="nobody", prune=signals[0].prune)
                call = pb.PruneManyRequest(prunes=[*signals, signals[1], other])
                reply = await stub.PruneMany(call)
                codes = [grpc.StatusCode.OK] * 2 + [grpc.StatusCode.INVALID_ARGUMENT,
                                                    grpc.StatusCode.NOT_FOUND]  # fmt: skip
                assert [o.code for o in reply.outcomes] == [c.value[0] for c in codes], reply
                assert "already" in reply.outcomes[2].message.lower(), reply
            await s0.Feed(_feed(4, 0, _rows([4], [4], [2]), [off[1]]))  # the late copy
            restart = _drawn(await asyncio.wait_for(out.get(), 10))
            # computed on the cache the prunes left: prompt, root and node 1 committed
            assert restart == ([5], _greedy(llama_dir, (5, 9, 13, g[0], 30), 1), 4)
            await asyncio.sleep(0.2)
            assert out.empty()

    asyncio.run(main())


def test_prune_horizon_is_the_largest_node_id_ever_created() -> None:
    """After a hit keeps a subtree without the newest ids, the next prune's horizon must
    still cover them, or a late copy of a dropped node would pass as newer."""
    from specpipe.common.spec.commands import BroadcastPrune, Feed, Propose
    from specpipe.common.spec.controller import make_controller
    from specpipe.common.spec.messages import Candidates, Verified
    from specpipe.common.spec.options import DecodeOptions, Mode

    def first(cmds, kind):
        return next(c for c in cmds if isinstance(c, kind))

    c = make_controller(Mode.SPECPIPE, "r", [5, 9, 13], DecodeOptions(10, width=2), 4)
    t = lambda *x: torch.tensor(x)  # noqa: E731
    out = c.on_candidates(
        first(c.start(), Propose).ticket, Candidates(t(0, 0), t(7, 8), t(0.6, 0.4))
    )
    assert first(out, Feed).act.node_ids.tolist() == [1, 2]
    out = c.on_candidates(first(out, Propose).ticket, Candidates(t(1, 2), t(11, 12), t(0.9, 0.9)))
    assert first(out, Feed).act.node_ids.tolist() == [3, 4]
    hit = first(c.on_verified(Verified("r", (0,), (7,), 2)), BroadcastPrune).prune
    assert hit.keep_ids.tolist() == [1, 3] and hit.horizon == 4
    out = c.on_verified(Verified("r", (1,), (40,), 3))
    miss = first(out, BroadcastPrune).prune
    assert first(out, Feed).act.tokens.tolist() == [40]  # the restart root
    assert miss.horizon == 4  # not 3 = max id left
    assert not bool(miss.alive(t(4)))


def test_a_last_stage_refuses_an_open_without_a_verify_spec(llama_dir) -> None:
    """The last stage verifies every request: an Open without its VerifySpec is refused
    (INVALID_ARGUMENT, saying so) and leaves nothing open; other stages need none."""

    async def main() -> None:
        async with _two_stages(llama_dir) as (_, router_addr, last, s0, s1):
            bare = stage_pb2.OpenStageRequest(request_id="r", capacity=64, next_hop=router_addr)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s1.Open(bare)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "VerifySpec" in info.value.details()
            assert not last._requests and last.runtime.info().active_requests == 0
            await s0.Open(bare)  # the first stage draws nothing
            await s1.Open(_open_last("r", router_addr))  # with one: taken

    asyncio.run(main())


def test_configure_loads_layers_into_an_empty_stage(llama_dir) -> None:
    async def main() -> None:
        off = StageService(None)  # Configure is off unless allowed
        port = await off.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                req = stage_pb2.ConfigureStageRequest(model_path=str(llama_dir), layer_start=2)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stage_pb2_grpc.StageStub(ch).Configure(req)
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        finally:
            await off.stop()
        svc = StageService(None, allow_configure=True)
        port = await svc.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = stage_pb2_grpc.StageStub(ch)
                desc = await stub.Describe(pb.DescribeRequest())
                assert not desc.ready and desc.data_address.startswith("tcp://")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Open(
                        stage_pb2.OpenStageRequest(request_id="r", capacity=8, next_hop="tcp://x:1")
                    )
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                req = stage_pb2.ConfigureStageRequest(model_path=str(llama_dir), layer_start=2)
                desc = await stub.Configure(req)
                assert desc.ready and (desc.layer_start, desc.layer_end, desc.num_layers) == (
                    2,
                    5,
                    5,
                )
                assert desc.vocab_size == 97 and desc.weight_hash and desc.free_memory_bytes > 0
                # The paged KV cache: nothing held yet, the whole budget free in blocks.
                assert desc.cache_block_rows > 0 and desc.cache_blocks_used == 0
                assert desc.cache_blocks_free * desc.cache_block_rows > 0
                bad = stage_pb2.ConfigureStageRequest(model_path="/nonexistent", layer_start=0)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Configure(bad)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await svc.stop()

    asyncio.run(main())


def test_stage_and_draft_drain_refuse_new_requests_and_finish_open_ones(llama_dir) -> None:
    """SIGTERM's first half: NOT_SERVING at once, Open refused UNAVAILABLE, open requests
    keep being served; the drain ends when the router releases them."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from specpipe.services.draft_service import DraftService
    from specpipe.v1 import draft_pb2, draft_pb2_grpc

    async def main() -> None:
        stage = StageService(_stage(llama_dir, 0, 5, 5))
        draft = DraftService(llama_dir)
        ports = [await stage.start(), await draft.start()]
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in ports]
        s, d = stage_pb2_grpc.StageStub(channels[0]), draft_pb2_grpc.DraftStub(channels[1])
        health = [health_pb2_grpc.HealthStub(ch) for ch in channels]
        open_stage = stage_pb2.OpenStageRequest(
            capacity=16, next_hop="tcp://127.0.0.1:9", verify=greedy_verify()
        )
        open_draft = draft_pb2.OpenDraftRequest(capacity=16, prompt_ids=[1, 2, 3])
        try:
            open_stage.request_id = open_draft.request_id = "r"
            await s.Open(open_stage)
            await d.Open(open_draft)
            drains = [asyncio.create_task(svc.drain(600)) for svc in (stage, draft)]
            await asyncio.sleep(0.1)
            for h in health:
                resp = await h.Check(health_pb2.HealthCheckRequest(service=""))
                assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
            open_stage.request_id = open_draft.request_id = "new"
            for call, req in ((s.Open, open_stage), (d.Open, open_draft)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(req)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "shutting down" in info.value.details()
            # The open request is still served while draining.
            await s.Feed(_feed(0, 0, _rows([0, 1], [], [], committed=True), [5, 9]))
            layer = rows_to_proto(_rows([3], [0], [-1]))
            await d.Propose(draft_pb2.ProposeRequest(request_id="r", rows=layer, token_ids=[3],
                                                     top_k=2))  # fmt: skip
            assert not any(t.done() for t in drains)
            await s.Release(pb.RequestRef(request_id="r"))
            await d.Release(pb.RequestRef(request_id="r"))
            await asyncio.wait_for(asyncio.gather(*drains), 30)
        finally:
            for ch in channels:
                await ch.close()
            await stage.stop()
            await draft.stop()

    asyncio.run(main())


def test_last_stage_walks_down_the_levels_that_arrive_together(llama_dir) -> None:
    """Three tree levels in one activation (K layers per step): one verification walks
    down all of them (the engine's greedy tokens); a later layer under a node the walk
    passed by sends nothing; the next group is walked from the child drawn last."""

    async def main() -> None:
        async with _two_stages(llama_dir) as (out, router_addr, last, s0, s1):
            await s1.Open(_open_last("r", router_addr))
            await s0.Open(
                stage_pb2.OpenStageRequest(
                    request_id="r", capacity=64, next_hop=last.transport.address
                )
            )
            chain, tokens = _chain(llama_dir)
            await s0.Feed(_feed(0, 0, _rows([0, 1], [], [], committed=True), [5, 9]))
            await s0.Feed(_feed(1, 0, chain, tokens))
            assert _drawn(await asyncio.wait_for(out.get(), 10)) == _chain_drawn(llama_dir)
            g = _greedy(llama_dir, (5, 9, 13), 5)
            # Below node 1, off the drawn path (node 3 holds g[1]): ruled out, nothing sent.
            await s0.Feed(_feed(2, 0, _rows([4], [4], [1]), [(g[1] + 1) % 97]))
            await asyncio.sleep(0.3)
            assert out.empty()
            # The next group: node 5 (the token drawn at node 3) and its child node 6.
            await s0.Feed(_feed(3, 0, _rows([5, 6], [5, 6], [3, 5]), [g[2], g[3]]))
            assert _drawn(await asyncio.wait_for(out.get(), 10)) == ([5, 6], g[3:5], 5)

    asyncio.run(main())


def test_requests_computed_together_share_one_frame_per_hop(llama_dir) -> None:
    """Four requests whose rows a stage computes in one round reach the next stage in
    one frame, and the last stage's verifications reach the router in one frame; every
    request gets the in-process engine's greedy tokens (SpecPipe-DB, one frame per hop
    per step)."""
    import threading

    async def main() -> None:
        rids = ["r0", "r1", "r2", "r3"]
        async with _stage_pair(llama_dir, rids) as p:
            first, last, s0, s1 = p.first, p.last, p.s0, p.s1
            gate = threading.Event()
            real = first.rounds._launch
            first.rounds._launch = lambda r: gate.wait(10) and real(r)
            for rid in rids:
                await s1.Open(_open_last(rid, p.router_addr))
                await s0.Open(stage_pb2.OpenStageRequest(
                    request_id=rid, capacity=64, next_hop=last.transport.address,
                    report_to=p.router_addr))  # fmt: skip
            prefill = _rows([0, 1], [], [], committed=True)
            root, chain = _chain(llama_dir)
            for i, rid in enumerate(rids):
                for seq, act, tokens in ((0, prefill, [5, 9]), (1, root, chain)):
                    feed = _feed(seq, 0, act, tokens)
                    feed.request_id = rid
                    await s0.Feed(feed)
                if i == 0:  # r0's round is on the compute thread (held by the gate)
                    await asyncio.sleep(0.3)
            first.rounds._launch = real
            gate.set()
            for rid in rids:
                got = _drawn(await asyncio.wait_for(p.queues[rid].get(), 20))
                assert got == _chain_drawn(llama_dir)
            # r0's round alone, then r1..r3 together: their 6 activations in one frame.
            assert first.transport.parts_sent == 8
            assert first.transport.frames_sent <= 3, first.transport.frames_sent
            assert last.transport.frames_received == first.transport.frames_sent
            assert last.transport.parts_sent == 4 and last.transport.frames_sent <= 3

    asyncio.run(main())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_next_hop_that_died_fails_its_requests_alone(llama_dir) -> None:
    """Two requests whose next hop is gone (a replica SIGKILLed) share a round with one
    whose hop is up: the two get UNAVAILABLE error frames (the router replays them), the
    third its verification, and the stage goes on computing (a regression: the failure path
    raised and ended the compute loop, so the replica took requests it never computed)."""

    async def main() -> None:
        rids = ["dead0", "dead1", "live"]
        gone = f"tcp://127.0.0.1:{_free_port()}"
        async with _stage_pair(llama_dir, rids) as p:
            await p.s1.Open(_open_last("live", p.router_addr))
            for rid in rids:
                hop = p.last.transport.address if rid == "live" else gone
                await p.s0.Open(stage_pb2.OpenStageRequest(
                    request_id=rid, capacity=64, next_hop=hop, report_to=p.router_addr))  # fmt: skip

            async def feed(rid: str, seq: int, act: Activation, tokens: list[int]) -> None:
                req = _feed(seq, 0, act, tokens)
                req.request_id = rid
                await p.s0.Feed(req)

            chain, tokens = _chain(llama_dir)
            for rid in rids:
                await feed(rid, 0, _rows([0, 1], [], [], committed=True), [5, 9])
                await feed(rid, 1, chain, tokens)
            for rid in ("dead0", "dead1"):
                frame = await asyncio.wait_for(p.queues[rid].get(), 20)
                assert frame.kind == Kind.PAYLOAD_KIND_ERROR
                assert frame.header.error_code == grpc.StatusCode.UNAVAILABLE.value[0]
                assert "cannot reach the next hop" in frame.header.error
            got = _drawn(await asyncio.wait_for(p.queues["live"].get(), 20))
            assert got == _chain_drawn(llama_dir)
            # Still computing: the live request's next layer comes through.
            g = _greedy(llama_dir, (5, 9, 13), 4)
            await feed("live", 2, _rows([5], [4], [3]), [g[2]])
            more = _drawn(await asyncio.wait_for(p.queues["live"].get(), 20))
            assert more == ([4], [g[3]], 5)
            assert not p.first._loop_task.done()

    asyncio.run(main())


def test_a_service_whose_own_loop_ends_stops_serving() -> None:
    """`Server.supervise`: a loop that raises takes the replica out (NOT_SERVING, what
    it holds failed) instead of leaving it accepting work it never does."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from specpipe.services.grpc_util import Server

    async def main() -> None:
        server = Server(["x.Service"])
        port = await server.start("127.0.0.1", 0)
        await server.set_serving(True)
        failed = []

        async def loop() -> None:
            await asyncio.sleep(0.05)
            raise RuntimeError("a bug")

        task = asyncio.create_task(loop(), name="the-loop")
        server.supervise(task, lambda: failed.append(True))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                health = health_pb2_grpc.HealthStub(ch)
                check = health_pb2.HealthCheckRequest(service="x.Service")
                assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING
                with contextlib.suppress(RuntimeError):
                    await task
                await asyncio.sleep(0.2)
                status = (await health.Check(check)).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
                assert failed == [True]
        finally:
            await server.stop()

    asyncio.run(main())


def test_feed_many_takes_or_refuses_each_feed_on_its_own(llama_dir) -> None:
    """One FeedMany with two requests' feeds, one for a request the stage does not hold
    and one malformed: the two requests get the engine's tokens, the other two their own
    refusal (what Feed would have answered); the call itself is refused only on a stage
    that takes no feeds or when it holds too many."""
    from specpipe.common.runtime.validation import MAX_CALLS_PER_BATCH

    async def main() -> None:
        rids = ["r0", "r1"]
        async with _stage_pair(llama_dir, rids) as p:
            for rid in rids:
                await p.s1.Open(_open_last(rid, p.router_addr))
                await p.s0.Open(stage_pb2.OpenStageRequest(
                    request_id=rid, capacity=64, next_hop=p.last.transport.address,
                    report_to=p.router_addr))  # fmt: skip
            prefill = _rows([0, 1], [], [], committed=True)
            root, chain = _chain(llama_dir)
            feeds = []
            for rid in [*rids, "nobody"]:
                for seq, act, tokens in ((0, prefill, [5, 9]), (1, root, chain)):
                    feeds.append(_feed(seq, 0, act, tokens))
                    feeds[-1].request_id = rid
            bad = _feed(2, 0, _rows([5], [4], [3]), [1, 2])  # two tokens for one row
            bad.request_id = "r0"
            reply = await p.s0.FeedMany(stage_pb2.FeedManyRequest(feeds=[*feeds, bad]))
            codes = [grpc.StatusCode.OK.value[0]] * 4 + [grpc.StatusCode.NOT_FOUND.value[0]] * 2
            codes.append(grpc.StatusCode.INVALID_ARGUMENT.value[0])
            assert [o.code for o in reply.outcomes] == codes
            assert "not open" in reply.outcomes[4].message
            assert reply.outcomes[6].message
            for rid in rids:
                got = _drawn(await asyncio.wait_for(p.queues[rid].get(), 20))
                assert got == _chain_drawn(llama_dir)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await p.s1.FeedMany(stage_pb2.FeedManyRequest(feeds=feeds[:1]))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            many = stage_pb2.FeedManyRequest(feeds=feeds[:1] * (MAX_CALLS_PER_BATCH + 1))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await p.s0.FeedMany(many)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(main())
