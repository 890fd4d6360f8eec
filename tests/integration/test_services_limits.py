"""What one request may ask of a stage or the draft (issue 22), every service in one
process: next hops only to the stage's peers (N8), rows per step capped by the service
and checked by the router before it opens anything (N4), bounded work waiting per
request (N9), and no request ids in the logs above DEBUG (N10)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import grpc
import pytest
import torch
from specpipe.common.perf.cost_model import BUDGET_ROWS, CostCurve
from specpipe.common.runtime.validation import DEFAULT_STEP_ROWS, MIN_STEP_ROWS
from specpipe.common.spec.messages import Activation
from specpipe.services.client import build_request
from specpipe.services.control import rows_to_proto
from specpipe.services.draft_service import DraftService
from specpipe.services.router.requests import RequestFailed
from specpipe.services.security import Security, make_pki
from specpipe.services.stage_service import StageService
from specpipe.services.transport import Inbox, make_transport
from specpipe.services.transport.codec import Kind
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, draft_pb2_grpc, stage_pb2, stage_pb2_grpc

from ..conftest import greedy_verify
from ..router_config import router_service
from .test_services_stage import DTYPE, _feed, _rows, _stage

Code = grpc.StatusCode


async def _status(call) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return Code.OK, ""


@contextlib.asynccontextmanager
async def _serving(svc, channel_of=grpc.aio.insecure_channel):
    port = await svc.start()
    ch = channel_of(f"127.0.0.1:{port}")
    try:
        yield ch
    finally:
        await ch.close()
        await svc.stop()


def _tree(rows: int, position: int = 5) -> Activation:
    """`rows` siblings under the committed prefix, all at `position`."""
    return _rows([position] * rows, list(range(rows)), [-1] * rows)


# -- N8: next hops ---------------------------------------------------------------------
def test_next_hops_only_to_peers_in_every_mode(llama_dir, tmp_path) -> None:
    """Issue 22, N8: with --peers empty (its default) a stage accepted any next hop and
    report address, connected there and wrote a hidden-state frame. Now only loopback
    without --peers, the listed hosts and networks with it, with and without --secure."""
    security = Security.load(make_pki(tmp_path / "pki"))

    async def opens(svc: StageService, channel_of) -> dict[tuple[str, str], grpc.StatusCode]:
        codes = {}
        async with _serving(svc, channel_of) as ch:
            stub = stage_pb2_grpc.StageStub(ch)
            for hop, report in (
                ("tcp://127.0.0.1:7000", ""),
                ("tcp://localhost:7000", "tcp://127.0.0.1:7001"),
                ("tcp://192.0.2.1:7000", ""),
                ("tcp://10.1.2.3:7000", ""),
                ("tcp://127.0.0.1:7000", "tcp://192.0.2.1:7001"),
                ("tcp://attacker.example:80", ""),
            ):
                req = stage_pb2.OpenStageRequest(
                    verify=greedy_verify(),
                    request_id=hop + report,
                    capacity=8,
                    next_hop=hop,
                    report_to=report,
                )
                code, details = await _status(stub.Open(req))
                if code == Code.INVALID_ARGUMENT:
                    assert "is not one of this stage's peers" in details, details
                codes[hop.split("//")[1].rsplit(":")[0], report] = code
        return codes

    def secure_channel(address: str):
        return grpc.aio.secure_channel(
            address, security.channel_credentials(), security.channel_options()
        )

    async def main() -> None:
        ok, bad = Code.OK, Code.INVALID_ARGUMENT
        expected = {
            ("127.0.0.1", ""): ok,
            ("localhost", "tcp://127.0.0.1:7001"): ok,
            ("192.0.2.1", ""): bad,
            ("10.1.2.3", ""): bad,
            ("127.0.0.1", "tcp://192.0.2.1:7001"): bad,
            ("attacker.example", ""): bad,
        }
        model = _stage(llama_dir, 0, 5, 5)
        assert await opens(StageService(model), grpc.aio.insecure_channel) == expected
        assert await opens(StageService(model, security=security), secure_channel) == expected
        listed = StageService(model, peers=["10.0.0.0/8", "localhost"])
        assert await opens(listed, grpc.aio.insecure_channel) == {
            **expected,
            ("127.0.0.1", ""): bad,  # loopback is no longer listed
            ("localhost", "tcp://127.0.0.1:7001"): bad,
            ("10.1.2.3", ""): ok,
        }

    asyncio.run(main())


# -- N4: rows per step -----------------------------------------------------------------
def test_a_stage_refuses_a_step_above_its_cap(llama_dir) -> None:
    """Issue 22, N4: a stage computed any activation of up to 16384 rows (576 MB for
    8192). Now at most `max_step_rows` (Describe): DEFAULT_STEP_ROWS without a measured
    cost curve, the floor on a CPU-like one; a Feed above is INVALID_ARGUMENT saying the
    limit, a frame above fails its request with an error frame to the router."""

    async def main() -> None:
        async with _serving(StageService(_stage(llama_dir, 0, 5, 5))) as ch:
            stub = stage_pb2_grpc.StageStub(ch)
            desc = await stub.Describe(pb.DescribeRequest())
            assert desc.max_step_rows == DEFAULT_STEP_ROWS
            await stub.Open(stage_pb2.OpenStageRequest(verify=greedy_verify(),
                request_id="r", capacity=2048, next_hop="tcp://127.0.0.1:9"))  # fmt: skip
            rows = DEFAULT_STEP_ROWS + 1
            code, details = await _status(stub.Feed(_feed(0, 0, _tree(rows), [3] * rows)))
            assert code == Code.INVALID_ARGUMENT
            assert f"at most {DEFAULT_STEP_ROWS} rows per step" in details, details

        measured = _stage(llama_dir, 0, 5, 5)
        measured.cost_curve = CostCurve(list(BUDGET_ROWS), [2e-3 + 1e-3 * n for n in BUDGET_ROWS])
        async with _serving(StageService(measured)) as ch:
            stub = stage_pb2_grpc.StageStub(ch)
            assert (await stub.Describe(pb.DescribeRequest())).max_step_rows == MIN_STEP_ROWS
            await stub.Open(stage_pb2.OpenStageRequest(verify=greedy_verify(),
                request_id="r", capacity=2048, next_hop="tcp://127.0.0.1:9"))  # fmt: skip
            rows = MIN_STEP_ROWS + 1
            code, details = await _status(stub.Feed(_feed(0, 0, _tree(rows), [3] * rows)))
            assert code == Code.INVALID_ARGUMENT and f"at most {MIN_STEP_ROWS}" in details

        inbox = Inbox()
        queue = inbox.open("r")
        router = make_transport("tcp", inbox)
        router_addr = await router.start()
        sender = make_transport("tcp", lambda f: None)
        last = StageService(_stage(llama_dir, 2, 5, 5), max_step_rows=16)
        try:
            async with _serving(last) as ch:
                await stage_pb2_grpc.StageStub(ch).Open(stage_pb2.OpenStageRequest(verify=greedy_verify(),
                    request_id="r", capacity=64, next_hop=router_addr, report_to=router_addr))  # fmt: skip
                act = _tree(17)
                act.hidden = torch.zeros(17, 48, dtype=DTYPE)
                await sender.send(last.transport.address, act, 0)
                frame = await asyncio.wait_for(queue.get(), 10)
                assert frame.kind == Kind.PAYLOAD_KIND_ERROR
                assert "at most 16 rows" in frame.header.error, frame.header.error
        finally:
            await sender.close()
            await router.close()

    asyncio.run(main())


def test_the_draft_refuses_a_step_above_its_cap(llama_dir) -> None:
    """Issue 22, N4, the draft: a prefill chunk (Open, Prefill) or a tree layer
    (Propose) above its `max_step_rows` is INVALID_ARGUMENT saying the limit."""

    async def main() -> None:
        async with _serving(DraftService(llama_dir, "float64")) as ch:
            d = draft_pb2_grpc.DraftStub(ch)
            assert (await d.Describe(pb.DescribeRequest())).max_step_rows == DEFAULT_STEP_ROWS
            chunk = DEFAULT_STEP_ROWS * 2
            big = draft_pb2.OpenDraftRequest(
                request_id="r", capacity=64, prompt_ids=[1, 2, 3], prefill_chunk=chunk
            )
            code, details = await _status(d.Open(big))
            assert code == Code.INVALID_ARGUMENT
            assert f"prefill chunk {chunk} is above the {DEFAULT_STEP_ROWS} rows" in details
            await d.Open(draft_pb2.OpenDraftRequest(request_id="r", capacity=2048,
                                                    prompt_ids=[1, 2, 3]))  # fmt: skip
            prefill = draft_pb2.PrefillDraftRequest(
                request_id="r", token_ids=[4], start_position=2, prefill_chunk=chunk
            )
            assert (await _status(d.Prefill(prefill)))[0] == Code.INVALID_ARGUMENT
            rows = DEFAULT_STEP_ROWS + 1
            layer = draft_pb2.ProposeRequest(
                request_id="r", rows=rows_to_proto(_tree(rows, 3)), token_ids=[3] * rows, top_k=1
            )
            code, details = await _status(d.Propose(layer))
            assert code == Code.INVALID_ARGUMENT and f"at most {DEFAULT_STEP_ROWS}" in details

    asyncio.run(main())


class _CountingStage(StageService):
    opens = 0

    async def Open(self, request, context):
        self.opens += 1
        return await super().Open(request, context)


def test_the_router_refuses_a_step_above_the_cap_before_opening(llama_dir) -> None:
    """Issue 22, N4, the router: a request whose prefill chunk or SpecInfer tree is above
    the fewest rows any stage or the draft takes per step (their Describe) fails
    INVALID_ARGUMENT with the limit, before anything is opened; requests within run."""

    async def main() -> None:
        stages = [
            _CountingStage(_stage(llama_dir, 0, 2, 5), max_step_rows=512),
            _CountingStage(_stage(llama_dir, 2, 5, 5)),
        ]
        draft = DraftService(llama_dir, "float64", max_step_rows=300)
        ports = [await s.start() for s in stages]
        dport = await draft.start()
        router = router_service([f"127.0.0.1:{p}" for p in ports], f"127.0.0.1:{dport}")
        try:
            await router.start(startup_timeout=30)
            for request, what in (
                (build_request(prompt_ids=[3, 4, 5], mode="pp", max_new_tokens=4,
                               prefill_chunk=301), "prefill_chunk 301 is above the 300 rows"),
                (build_request(prompt_ids=[3, 4, 5], mode="specinfer", max_new_tokens=4,
                               width=20, depth=15), "tree of 301 rows"),
            ):  # fmt: skip
                with pytest.raises(RequestFailed) as info:
                    async for _ in router.engine.generate(request):
                        pass
                assert info.value.code == Code.INVALID_ARGUMENT
                assert what in info.value.message and "300 rows" in info.value.message
            assert [s.opens for s in stages] == [0, 0]  # nothing was opened
            ok = build_request(prompt_ids=[3, 4, 5], mode="specinfer", max_new_tokens=4,
                               width=20, depth=14, prefill_chunk=300)  # fmt: skip
            got = [r async for r in router.engine.generate(ok)]
            assert got[-1].HasField("finished")
        finally:
            await router.stop()
            for svc in (*stages, draft):
                await svc.stop()

    asyncio.run(main())


# -- N9: work waiting ------------------------------------------------------------------
def test_a_request_cannot_pile_up_work_that_waits(llama_dir) -> None:
    """Issue 22, N9: one Open accepted capacity + 64 feeds that were never computed
    (1200 feeds: 337 MB on a stage). Now what waits for an earlier turn is bounded by
    the request's capacity in bytes: beyond it a Feed is RESOURCE_EXHAUSTED (a frame
    fails its request), and the stage keeps serving other requests."""

    async def main() -> None:
        inbox = Inbox()
        queues = {rid: inbox.open(rid) for rid in ("r", "good", "framed")}
        router = make_transport("tcp", inbox)
        router_addr = await router.start()
        sender = make_transport("tcp", lambda f: None)
        first, last = (
            StageService(_stage(llama_dir, 0, 5, 5)),
            StageService(_stage(llama_dir, 2, 5, 5)),
        )
        try:
            async with _serving(first) as ch0, _serving(last) as ch1:
                s0, s1 = stage_pb2_grpc.StageStub(ch0), stage_pb2_grpc.StageStub(ch1)
                for rid in ("r", "good"):
                    await s0.Open(stage_pb2.OpenStageRequest(verify=greedy_verify(),
                        request_id=rid, capacity=64, next_hop=router_addr,
                        report_to=router_addr))  # fmt: skip
                # Committed rows, token ids and positions: 16 bytes each; the request may
                # hold 128 rows' worth (twice its capacity) of stage-1 input waiting.
                chunk = _rows(list(range(32)), [], [], committed=True)
                codes = [
                    (await _status(s0.Feed(_feed(seq, 0, chunk, [3] * 32))))[0]
                    for seq in range(1, 12)  # seq 0 never comes: none is ever computed
                ]
                assert Code.RESOURCE_EXHAUSTED in codes, codes
                refused = codes.index(Code.RESOURCE_EXHAUSTED)
                assert codes[:refused] == [Code.OK] * refused and refused <= 8
                st = first._requests["r"]
                assert st.order.pending_bytes <= st.order.max_pending_bytes
                good = _feed(0, 0, _rows([0, 1], [], [], committed=True), [5, 9])
                good.request_id = "good"
                await s0.Feed(good)
                tree = _feed(1, 0, _rows([2], [0], [-1]), [13])
                tree.request_id = "good"
                await s0.Feed(tree)
                frame = await asyncio.wait_for(queues["good"].get(), 10)
                assert frame.kind == Kind.PAYLOAD_KIND_VERIFIED

                await s1.Open(stage_pb2.OpenStageRequest(verify=greedy_verify(),
                    request_id="framed", capacity=64, next_hop=router_addr,
                    report_to=router_addr))  # fmt: skip
                for seq in range(1, 12):  # hidden states: 416 bytes a row here
                    act = _tree(32)
                    act.request_id = "framed"
                    act.hidden = torch.zeros(32, 48, dtype=DTYPE)
                    await sender.send(last.transport.address, act, seq)
                frame = await asyncio.wait_for(queues["framed"].get(), 10)
                assert frame.kind == Kind.PAYLOAD_KIND_ERROR
                assert "wait for their turn already" in frame.header.error, frame.header.error
        finally:
            await sender.close()
            await router.close()

    asyncio.run(main())


def test_the_draft_refuses_a_flood_of_proposals(llama_dir) -> None:
    """Issue 22, N9, the draft: a router awaits each Propose of a request before the
    next; more than MAX_ASKS_PER_REQUEST waiting at once is RESOURCE_EXHAUSTED (they
    were queued without bound), and a Propose for a request not open is NOT_FOUND."""
    from specpipe.services.draft_service import MAX_ASKS_PER_REQUEST

    async def main() -> None:
        draft = DraftService(llama_dir, "float64", batch_wait=0)
        async with _serving(draft) as ch:
            d = draft_pb2_grpc.DraftStub(ch)
            await d.Open(draft_pb2.OpenDraftRequest(request_id="r", capacity=64,
                                                    prompt_ids=[1, 2, 3]))  # fmt: skip

            def ask(node: int, rid: str = "r") -> draft_pb2.ProposeRequest:
                layer = rows_to_proto(_rows([2], [node], [-1]))  # siblings: one node each
                return draft_pb2.ProposeRequest(request_id=rid, rows=layer, token_ids=[3], top_k=2)

            assert (await _status(d.Propose(ask(0, "x"))))[0] == Code.NOT_FOUND
            busy = threading.Event()
            compute = draft.rounds._compute

            def held(batch):  # the compute thread is busy until told
                busy.wait(30)
                return compute(batch)

            draft.rounds._compute = held
            n = MAX_ASKS_PER_REQUEST + 3
            calls = [asyncio.ensure_future(_status(d.Propose(ask(i)))) for i in range(n)]
            while sum(c.done() for c in calls) < n - 2 * MAX_ASKS_PER_REQUEST:
                await asyncio.sleep(0.02)
            busy.set()
            codes = [code for code, _ in await asyncio.gather(*calls)]
            assert codes.count(Code.RESOURCE_EXHAUSTED) >= n - 2 * MAX_ASKS_PER_REQUEST
            assert set(codes) == {Code.OK, Code.RESOURCE_EXHAUSTED}, codes

    asyncio.run(main())


# -- N10: logs -------------------------------------------------------------------------
def test_request_ids_are_not_logged_above_debug(llama_dir, caplog) -> None:
    """Issue 22, N10: request ids (capabilities) were logged at INFO and above. A failing
    request's lines name it only at DEBUG."""
    rid = "0123456789abcdef-secret"

    async def main() -> None:
        inbox = Inbox()
        queue = inbox.open(rid)
        router = make_transport("tcp", inbox)
        router_addr = await router.start()
        sender = make_transport("tcp", lambda f: None)
        last = StageService(_stage(llama_dir, 2, 5, 5))
        try:
            async with _serving(last) as ch:
                await stage_pb2_grpc.StageStub(ch).Open(stage_pb2.OpenStageRequest(verify=greedy_verify(),
                    request_id=rid, capacity=64, next_hop=router_addr, report_to=router_addr))  # fmt: skip
                act = Activation(rid, torch.tensor([0]), committed=True,
                                 hidden=torch.full((1, 48), float("nan"), dtype=DTYPE))  # fmt: skip
                await sender.send(last.transport.address, act, 0)
                frame = await asyncio.wait_for(queue.get(), 10)
                assert frame.kind == Kind.PAYLOAD_KIND_ERROR
        finally:
            await sender.close()
            await router.close()

    with caplog.at_level(logging.DEBUG, logger="specpipe.services"):
        asyncio.run(main())
    assert any(rid in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not [m for m in loud if rid in m], loud
