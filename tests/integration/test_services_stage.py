"""The stage service's ordering rules, in one process: activations are computed in
`seq` order whatever order they arrive in, wait for the prunes they were created after,
late nodes a prune dropped are skipped (also after several prunes), and the logits are
the engine's."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

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
from specpipe.services.transport import Inbox, decode, make_transport
from specpipe.services.transport.codec import Kind
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import stage_pb2, stage_pb2_grpc

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


def _reference_logits(llama_dir) -> torch.Tensor:
    """In one process: prompt [5, 9], then root 13 (node 0), child 7 (node 1) and
    grandchild 11 (node 3); logits of the three tree rows."""
    ref = [
        StageRuntime(load_stage(llama_dir, LayerRange(a, b, 5), DTYPE)) for a, b in ((0, 2), (2, 5))
    ]
    acts = [
        Activation("x", torch.tensor([0, 1]), committed=True, tokens=torch.tensor([5, 9])),
        Activation("x", torch.tensor([2, 3, 4]), node_ids=torch.tensor([0, 1, 3]),
                   parent_ids=torch.tensor([-1, 0, 1]), tokens=torch.tensor([13, 7, 11])),
    ]  # fmt: skip
    for s in ref:
        s.open("x", 64)
    for act in acts:
        for s in ref:
            act = s.forward(act)
    return act.logits


@pytest.mark.parametrize("batched", [False, True], ids=["Prune", "PruneMany"])
def test_order_prune_gating_and_late_nodes(llama_dir, batched) -> None:
    """With PruneMany, each stage gets both prunes in one call (out of order), with a
    duplicate and one for a request it does not hold, each refused on its own."""

    async def main() -> None:
        async with _two_stages(llama_dir) as (out, router_addr, last, s0, s1):
            await s1.Open(
                stage_pb2.OpenStageRequest(request_id="r", capacity=64, next_hop=router_addr)
            )
            await s0.Open(
                stage_pb2.OpenStageRequest(
                    request_id="r",
                    capacity=64,
                    next_hop=last.transport.address,
                    report_to=router_addr,
                )
            )
            # Root (node 0) and its children (1: token 7, 2: token 8) arrive before the prefill.
            await s0.Feed(_feed(2, 0, _rows([3, 3], [1, 2], [0, 0]), [7, 8]))
            await s0.Feed(_feed(1, 0, _rows([2], [0], [-1]), [13]))
            await asyncio.sleep(0.2)
            assert out.empty()  # nothing computed before seq 0
            await s0.Feed(_feed(0, 0, _rows([0, 1], [], [], committed=True), [5, 9]))
            root = decode(await asyncio.wait_for(out.get(), 10))
            kids = decode(await asyncio.wait_for(out.get(), 10))
            assert root.node_ids.tolist() == [0] and kids.node_ids.tolist() == [1, 2]
            # Grandchildren 3 (under 1) and 4 (under 2), made before the first prune.
            await s0.Feed(_feed(3, 0, _rows([4, 4], [3, 4], [1, 2]), [11, 12]))
            # Prune 1: hit on node 1 (keeps 1 and 3). Prune 2: miss at node 1 (keeps
            # nothing); its horizon is the largest id ever created (4), not the largest id
            # still in the tree (3). The restart root waits for prune 2; a late copy of
            # node 4 (dropped by prune 1, parent gone) arrives after both and is skipped.
            await s0.Feed(_feed(5, 2, _rows([4], [5], [-1]), [30]))  # restart root, early
            grand = decode(await asyncio.wait_for(out.get(), 10))
            assert grand.node_ids.tolist() == [3, 4]
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
            await s0.Feed(_feed(4, 0, _rows([4], [4], [2]), [12]))  # the late copy
            restart = decode(await asyncio.wait_for(out.get(), 10))
            assert restart.node_ids.tolist() == [5]
            await asyncio.sleep(0.2)
            assert out.empty()

            # The same computation in one process: prompt, root, child 1, grandchild 3.
            logits = _reference_logits(llama_dir)
            torch.testing.assert_close(root.logits[0], logits[0])
            torch.testing.assert_close(kids.logits[0], logits[1])
            torch.testing.assert_close(grand.logits[0], logits[2])

    asyncio.run(main())


def test_prune_horizon_is_the_largest_node_id_ever_created() -> None:
    """After a hit keeps a subtree without the newest ids, the next prune's horizon must
    still cover them, or a late copy of a dropped node would pass as newer."""
    from specpipe.common.spec.commands import BroadcastPrune, Feed, Propose
    from specpipe.common.spec.controller import make_controller
    from specpipe.common.spec.messages import Candidates
    from specpipe.common.spec.options import DecodeOptions, Mode

    def root_logits(node: int, token: int) -> Activation:
        x = torch.zeros(1, 97)
        x[0, token] = 10.0
        return Activation("r", t(2), node_ids=t(node), parent_ids=t(-1), logits=x)

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
    hit = first(c.on_logits(root_logits(0, 7)), BroadcastPrune).prune
    assert hit.keep_ids.tolist() == [1, 3] and hit.horizon == 4
    out = c.on_logits(root_logits(1, 40))
    miss = first(out, BroadcastPrune).prune
    assert first(out, Feed).act.tokens.tolist() == [40]  # the restart root
    assert miss.horizon == 4  # not 3 = max id left
    assert not bool(miss.alive(t(4)))


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
        open_stage = stage_pb2.OpenStageRequest(capacity=16, next_hop="tcp://127.0.0.1:9")
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


def test_last_stage_sends_only_root_logits_when_asked(llama_dir) -> None:
    """specpipe/pp (`root_logits_only`): a tree layer computed before its parent is
    verified sends nothing; the prune that commits the parent sends the new root's logits
    (one row, the engine's); rows a prune drops never send any."""

    async def main() -> None:
        async with _two_stages(llama_dir) as (out, router_addr, last, s0, s1):

            async def prune(seq: int, p: Prune) -> None:
                for stub in (s0, s1):
                    await stub.Prune(pb.PruneRequest(request_id="r", prune=prune_to_proto(p, seq)))

            async def no_frame() -> None:
                await asyncio.sleep(0.3)
                assert out.empty()

            await s1.Open(
                stage_pb2.OpenStageRequest(
                    request_id="r", capacity=64, next_hop=router_addr, root_logits_only=True
                )
            )
            await s0.Open(
                stage_pb2.OpenStageRequest(
                    request_id="r", capacity=64, next_hop=last.transport.address
                )
            )
            await s0.Feed(_feed(0, 0, _rows([0, 1], [], [], committed=True), [5, 9]))
            await s0.Feed(_feed(1, 0, _rows([2], [0], [-1]), [13]))  # root
            await s0.Feed(_feed(2, 0, _rows([3, 3], [1, 2], [0, 0]), [7, 8]))  # children
            await s0.Feed(_feed(3, 0, _rows([4, 4], [3, 4], [1, 2]), [11, 12]))  # grandchildren
            root = decode(await asyncio.wait_for(out.get(), 10))
            assert root.node_ids.tolist() == [0] and root.logits.shape[0] == 1
            await no_frame()  # children and grandchildren are held, not sent
            await prune(1, Prune(torch.tensor([0]), torch.tensor([1, 3]), horizon=4))  # hit: 1
            child = decode(await asyncio.wait_for(out.get(), 10))
            assert child.node_ids.tolist() == [1] and child.logits.shape[0] == 1
            await no_frame()
            await prune(2, Prune(torch.tensor([1]), torch.tensor([3]), horizon=4))  # hit: 3
            grand = decode(await asyncio.wait_for(out.get(), 10))
            assert grand.node_ids.tolist() == [3]
            await prune(3, Prune(torch.tensor([3]), torch.empty(0, dtype=torch.int64), horizon=4))
            await s0.Feed(_feed(4, 3, _rows([5], [5], [-1]), [30]))  # miss: restart root
            restart = decode(await asyncio.wait_for(out.get(), 10))
            assert restart.node_ids.tolist() == [5]

            # The same rows, every row's logits, in one process.
            logits = _reference_logits(llama_dir)
            for got, row in ((root, 0), (child, 1), (grand, 2)):
                torch.testing.assert_close(got.logits[0], logits[row])

    asyncio.run(main())


def test_requests_computed_together_share_one_frame_per_hop(llama_dir) -> None:
    """Four requests whose rows a stage computes in one round reach the next stage in
    one frame, and the last stage's logits reach the router in one frame; every request
    gets the logits of the in-process engine (SpecPipe-DB, one frame per hop per step)."""
    import threading

    async def main() -> None:
        rids = ["r0", "r1", "r2", "r3"]
        async with _stage_pair(llama_dir, rids) as p:
            first, last, s0, s1 = p.first, p.last, p.s0, p.s1
            gate = threading.Event()
            real = first.rounds._launch
            first.rounds._launch = lambda r: gate.wait(10) and real(r)
            for rid in rids:
                await s1.Open(stage_pb2.OpenStageRequest(request_id=rid, capacity=64,
                                                         next_hop=p.router_addr))  # fmt: skip
                await s0.Open(stage_pb2.OpenStageRequest(
                    request_id=rid, capacity=64, next_hop=last.transport.address,
                    report_to=p.router_addr))  # fmt: skip
            prefill = _rows([0, 1], [], [], committed=True)
            root = _rows([2, 3, 4], [0, 1, 3], [-1, 0, 1])
            for i, rid in enumerate(rids):
                for seq, act, tokens in ((0, prefill, [5, 9]), (1, root, [13, 7, 11])):
                    feed = _feed(seq, 0, act, tokens)
                    feed.request_id = rid
                    await s0.Feed(feed)
                if i == 0:  # r0's round is on the compute thread (held by the gate)
                    await asyncio.sleep(0.3)
            first.rounds._launch = real
            gate.set()
            want = _reference_logits(llama_dir)
            for rid in rids:
                got = decode(await asyncio.wait_for(p.queues[rid].get(), 20))
                torch.testing.assert_close(got.logits, want)
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
    third its logits, and the stage goes on computing (a regression: the failure path
    raised and ended the compute loop, so the replica took requests it never computed)."""

    async def main() -> None:
        rids = ["dead0", "dead1", "live"]
        gone = f"tcp://127.0.0.1:{_free_port()}"
        async with _stage_pair(llama_dir, rids) as p:
            await p.s1.Open(stage_pb2.OpenStageRequest(request_id="live", capacity=64,
                                                       next_hop=p.router_addr))  # fmt: skip
            for rid in rids:
                hop = p.last.transport.address if rid == "live" else gone
                await p.s0.Open(stage_pb2.OpenStageRequest(
                    request_id=rid, capacity=64, next_hop=hop, report_to=p.router_addr))  # fmt: skip

            async def feed(rid: str, seq: int, act: Activation, tokens: list[int]) -> None:
                req = _feed(seq, 0, act, tokens)
                req.request_id = rid
                await p.s0.Feed(req)

            for rid in rids:
                await feed(rid, 0, _rows([0, 1], [], [], committed=True), [5, 9])
                await feed(rid, 1, _rows([2, 3, 4], [0, 1, 3], [-1, 0, 1]), [13, 7, 11])
            for rid in ("dead0", "dead1"):
                frame = await asyncio.wait_for(p.queues[rid].get(), 20)
                assert frame.kind == Kind.PAYLOAD_KIND_ERROR
                assert frame.header.error_code == grpc.StatusCode.UNAVAILABLE.value[0]
                assert "cannot reach the next hop" in frame.header.error
            got = decode(await asyncio.wait_for(p.queues["live"].get(), 20))
            torch.testing.assert_close(got.logits, _reference_logits(llama_dir))
            # Still computing: the live request's next layer comes through.
            await feed("live", 2, _rows([5], [4], [3]), [12])
            more = decode(await asyncio.wait_for(p.queues["live"].get(), 20))
            assert more.node_ids.tolist() == [4]
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
    and one malformed: the two requests get the engine's logits, the other two their own
    refusal (what Feed would have answered); the call itself is refused only on a stage
    that takes no feeds or when it holds too many."""
    from specpipe.common.runtime.validation import MAX_CALLS_PER_BATCH

    async def main() -> None:
        rids = ["r0", "r1"]
        async with _stage_pair(llama_dir, rids) as p:
            for rid in rids:
                await p.s1.Open(stage_pb2.OpenStageRequest(request_id=rid, capacity=64,
                                                           next_hop=p.router_addr))  # fmt: skip
                await p.s0.Open(stage_pb2.OpenStageRequest(
                    request_id=rid, capacity=64, next_hop=p.last.transport.address,
                    report_to=p.router_addr))  # fmt: skip
            prefill = _rows([0, 1], [], [], committed=True)
            root = _rows([2, 3, 4], [0, 1, 3], [-1, 0, 1])
            feeds = []
            for rid in [*rids, "nobody"]:
                for seq, act, tokens in ((0, prefill, [5, 9]), (1, root, [13, 7, 11])):
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
            want = _reference_logits(llama_dir)
            for rid in rids:
                got = decode(await asyncio.wait_for(p.queues[rid].get(), 20))
                torch.testing.assert_close(got.logits, want)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await p.s1.FeedMany(stage_pb2.FeedManyRequest(feeds=feeds[:1]))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            many = stage_pb2.FeedManyRequest(feeds=feeds[:1] * (MAX_CALLS_PER_BATCH + 1))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await p.s0.FeedMany(many)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(main())
