"""Bad inputs to a stage and the draft, in one process (issue 13, "Validation gaps" and
"Silent hangs"): every one is answered INVALID_ARGUMENT on the control plane, or with an
error frame to the router on the data plane, never computed, never a hang."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import torch
from specpipe.common.spec.messages import Activation
from specpipe.services.control import rows_to_proto
from specpipe.services.stage_service import StageService
from specpipe.services.transport import Inbox, make_transport
from specpipe.services.transport.codec import Kind, encode
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, draft_pb2_grpc, stage_pb2, stage_pb2_grpc

from ..conftest import greedy_verify
from .test_services_stage import DTYPE, _feed, _rows, _stage

Code = grpc.StatusCode


async def _code(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    return Code.OK


@contextlib.asynccontextmanager
async def _last_stage(llama_dir, request_ids):
    """The last stage [2, 5) as a service with `request_ids` open, their errors reported
    to an inbox (a queue each); a transport to send it frames."""
    inbox = Inbox()
    queues = {rid: inbox.open(rid) for rid in request_ids}
    router = make_transport("tcp", inbox)
    router_addr = await router.start()
    sender = make_transport("tcp", lambda f: None)
    svc = StageService(_stage(llama_dir, 2, 5, 5))
    port = await svc.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = stage_pb2_grpc.StageStub(ch)
    for rid in request_ids:
        await stub.Open(
            stage_pb2.OpenStageRequest(
                request_id=rid,
                capacity=64,
                next_hop=router_addr,
                report_to=router_addr,
                verify=greedy_verify(),
            )
        )
    try:
        yield svc, sender, queues
    finally:
        await ch.close()
        await svc.stop()
        await sender.close()
        await router.close()


def _hidden_frame(hidden: torch.Tensor, positions=(0, 1), committed=True):
    act = Activation("r", torch.tensor(positions), committed=committed, hidden=hidden)
    return encode(act, 0)


BAD_FRAMES = {
    "float16 payload": lambda: _hidden_frame(torch.zeros(2, 48, dtype=torch.float16)),
    "int64 payload": lambda: _hidden_frame(torch.zeros(2, 48, dtype=torch.int64)),
    "3-D payload": lambda: _hidden_frame(torch.zeros(2, 1, 48, dtype=DTYPE)),
    "NaN hidden states": lambda: _hidden_frame(torch.full((2, 48), float("nan"), dtype=DTYPE)),
    "position 10^12": lambda: _hidden_frame(torch.zeros(2, 48, dtype=DTYPE), (0, 10**12)),
    "position -5": lambda: _hidden_frame(torch.zeros(2, 48, dtype=DTYPE), (-5, 1)),
}


def _mismatched_ids():
    """Tree rows whose node/parent id counts do not match the rows (an IndexError in the
    stage before: no error frame, no log, a hang)."""
    header, payload = _hidden_frame(torch.zeros(2, 48, dtype=DTYPE), committed=False)
    header.rows.node_ids.extend([0])
    header.rows.parent_ids.extend([-1, 0, 0])
    return header, payload


def _zero_dim():
    """A 0-dim payload (an asyncio fatal-error traceback before)."""
    header, _ = _hidden_frame(torch.zeros(2, 48, dtype=DTYPE))
    del header.shape[:]
    return header, torch.zeros((), dtype=DTYPE)


BAD_FRAMES["node/parent ids that do not match the rows"] = _mismatched_ids
BAD_FRAMES["0-dim payload"] = _zero_dim


def test_bad_frames_fail_the_request_with_an_error_frame(llama_dir) -> None:
    """Each bad frame fails its own request with an error frame to the router; a good
    frame of another request is computed as usual afterwards."""
    cases = list(BAD_FRAMES)

    async def main() -> None:
        async with _last_stage(llama_dir, [*cases, "good"]) as (svc, sender, queues):
            for case in cases:
                header, payload = BAD_FRAMES[case]()
                header.request_id = case
                await sender.send_frame(svc.transport.address, header, payload)
            for case in cases:
                frame = await asyncio.wait_for(queues[case].get(), 10)
                assert frame.kind == Kind.PAYLOAD_KIND_ERROR, (case, frame.header)
                assert "bad frame" in frame.header.error, case
            act = Activation("good", torch.tensor([0]), node_ids=torch.tensor([0]),
                             parent_ids=torch.tensor([-1]), hidden=torch.zeros(1, 48, dtype=DTYPE),
                             row_tokens=torch.tensor([3]))  # fmt: skip
            await sender.send(svc.transport.address, act, 0)
            frame = await asyncio.wait_for(queues["good"].get(), 10)
            assert frame.kind == Kind.PAYLOAD_KIND_VERIFIED

    asyncio.run(main())


def test_stage_control_inputs_are_invalid_argument(llama_dir) -> None:
    async def main() -> None:
        svc = StageService(_stage(llama_dir, 0, 5, 5))
        port = await svc.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = stage_pb2_grpc.StageStub(ch)

            def open_(**kw):
                base = dict(
                    request_id="r",
                    capacity=64,
                    next_hop="tcp://127.0.0.1:9",
                    verify=greedy_verify(),
                )
                return stub.Open(stage_pb2.OpenStageRequest(**{**base, **kw}))

            try:
                for kw in ({"next_hop": "10.0.0.1:80"}, {"next_hop": "ucx://127.0.0.1:9"},
                           {"capacity": 10**9}, {"report_to": "http://x"}):  # fmt: skip
                    assert await _code(open_(**kw)) == Code.INVALID_ARGUMENT, kw
                await open_()
                committed = _rows([0, 1], [], [], committed=True)
                bad = [
                    _feed(0, 0, _rows([0, 10**12], [], [], committed=True), [5, 9]),
                    _feed(0, 0, _rows([-5, 1], [], [], committed=True), [5, 9]),
                    _feed(0, 0, committed, [5, 97]),  # outside the vocabulary
                    _feed(0, 0, committed, [5]),  # one token for two rows
                    _feed(10**6, 0, committed, [5, 9]),  # far ahead: held forever before
                ]
                mismatch = _feed(0, 0, _rows([2, 3], [0, 1], [-1, 0]), [5, 9])
                mismatch.rows.node_ids.append(7)
                bad.append(mismatch)
                for req in bad:
                    assert await _code(stub.Feed(req)) == Code.INVALID_ARGUMENT, req
                await stub.Feed(_feed(0, 0, committed, [5, 9]))
                assert await _code(stub.Feed(_feed(0, 0, committed, [5, 9]))) == (
                    Code.INVALID_ARGUMENT  # a replay of seq 0
                )
                far = pb.PruneRequest(request_id="r", prune=pb.PruneSignal(seq=10**6))
                assert await _code(stub.Prune(far)) == Code.INVALID_ARGUMENT
            finally:
                await svc.stop()

    asyncio.run(main())


def test_draft_inputs_are_invalid_argument(llama_dir) -> None:
    """Out-of-vocabulary ids (UNKNOWN before), and a prompt longer than the draft's
    context (accepted before, stalling every draft user while it was prefilled)."""
    from specpipe.services.draft_service import DraftService

    async def main() -> None:
        svc = DraftService(llama_dir, "float64")
        port = await svc.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            d = draft_pb2_grpc.DraftStub(ch)
            try:
                long = draft_pb2.OpenDraftRequest(
                    request_id="x", capacity=8000, prompt_ids=[5] * 6000
                )
                assert await _code(d.Open(long)) == Code.INVALID_ARGUMENT  # context 256
                huge = draft_pb2.OpenDraftRequest(request_id="x", capacity=10**9, prompt_ids=[1])
                assert await _code(d.Open(huge)) == Code.INVALID_ARGUMENT
                oov = draft_pb2.OpenDraftRequest(request_id="x", capacity=16, prompt_ids=[1, 97])
                assert await _code(d.Open(oov)) == Code.INVALID_ARGUMENT
                await d.Open(draft_pb2.OpenDraftRequest(request_id="r", capacity=64,
                                                        prompt_ids=[1, 2, 3]))  # fmt: skip
                for tokens, start in (([97], 2), ([-1], 2), ([1], -3), ([1] * 300, 2)):
                    req = draft_pb2.PrefillDraftRequest(
                        request_id="r", token_ids=tokens, start_position=start
                    )
                    assert await _code(d.Prefill(req)) == Code.INVALID_ARGUMENT, (tokens, start)
                layer = rows_to_proto(_rows([3], [0], [-1]))
                for tokens in ([97], [10**9]):
                    req = draft_pb2.ProposeRequest(
                        request_id="r", rows=layer, token_ids=tokens, top_k=2
                    )
                    assert await _code(d.Propose(req)) == Code.INVALID_ARGUMENT
                far = _rows([10**12], [0], [-1])
                req = draft_pb2.ProposeRequest(
                    request_id="r", rows=rows_to_proto(far), token_ids=[3], top_k=2
                )
                assert await _code(d.Propose(req)) == Code.INVALID_ARGUMENT
                ok = draft_pb2.ProposeRequest(request_id="r", rows=layer, token_ids=[3], top_k=2)
                assert len((await d.Propose(ok)).token_ids) == 2
            finally:
                await svc.stop()

    asyncio.run(main())
