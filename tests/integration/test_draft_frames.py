"""The draft's calls as data-plane control frames (services/transport/control_frames.py)
between a router's `DraftStream` and a real draft service: proposals answered as on the
stream, a refused call answered to that call only, nothing written on the gRPC stream
(which stays open, so that a lost draft breaks it); through a router, a request whose
draft calls ride frames decodes exactly as plain decoding, and one whose draft's data
plane cannot be reached, or whose draft stops mid-request, goes on without the draft,
exactly too."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from specpipe.services.draft_service import DraftService
from specpipe.services.router.control_stream import ControlFrames, DraftStream
from specpipe.services.security import Security, make_pki
from specpipe.services.stage_service import StageService
from specpipe.services.transport import Inbox, make_transport
from specpipe.services.transport.auth import FrameAuth
from specpipe.services.transport.control_frames import CONTROL, message_frame
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, draft_pb2_grpc

from ..router_config import router_service
from .test_control_frames import QuietControl, unreachable
from .test_draft_batching import _propose
from .test_services_stage import _stage
from .test_services_stalls import _request, _tokens

NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
PROMPTS = {"a": [5, 9, 2, 7], "b": [5, 9, 2, 7]}


async def _router_and_draft(llama_dir):
    """A router's data plane (its inbox, its transport) and a started draft (fp64), with
    the draft's gRPC port."""
    inbox = Inbox()
    router = make_transport("tcp", inbox)
    await router.start()
    draft = DraftService(llama_dir, dtype="float64")
    return inbox, router, draft, await draft.start()


def test_calls_as_frames_answer_as_the_stream_and_refusals_their_own_call(llama_dir) -> None:
    async def main() -> None:
        inbox, router, draft, port = await _router_and_draft(llama_dir)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = draft_pb2_grpc.DraftStub(ch)
                desc = await stub.Describe(pb.DescribeRequest())
                assert desc.control_frames and desc.data_address == draft.transport.address
                for rid, p in PROMPTS.items():
                    await stub.Open(draft_pb2.OpenDraftRequest(request_id=rid, capacity=32,
                                                               prompt_ids=p))  # fmt: skip
                plain = DraftStream(stub, "draft (stream)")
                framed = DraftStream(stub, "draft (frames)")
                framed.carry_on(ControlFrames(router, inbox), desc.data_address)
                want = await asyncio.wait_for(plain.call(propose=_propose("a", 3, 7)), 30)
                got, missing = (
                    framed.call(propose=_propose("b", 3, 7)),
                    framed.call(propose=_propose("gone", 3, 7)),
                )  # one turn: one frame
                got = await asyncio.wait_for(got, 30)
                assert got == want  # the same request, the same proposal
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await asyncio.wait_for(missing, 30)
                assert refused.value.code() == grpc.StatusCode.NOT_FOUND
                assert "not open" in (refused.value.details() or "")
                release = pb.RequestRef(request_id="b")
                assert await asyncio.wait_for(framed.call(release=release), 30) is None
                assert "b" not in draft.leases
                assert framed.frames == 2 and framed.messages == 0  # nothing on gRPC
                assert framed.opened == 1  # open beside the frames: a lost draft breaks it
                await plain.close()
                await framed.close()
                assert "control:" not in str(inbox._sinks)  # its answers' route is gone
        finally:
            await draft.stop()
            await router.close()

    asyncio.run(main())


def test_the_compute_thread_sends_answers_itself_and_the_loop_what_it_cannot(llama_dir) -> None:
    """A control frame's proposal is answered by the draft's compute thread itself
    (`Transport.send_now`, issue 34 point 4) once a connection to the router is there;
    the first (no connection yet) and one whose send from the thread failed (here a
    bug) are answered by the event loop, that batch only. Every answer equals the
    stream's, and nothing is written on the gRPC stream."""
    rids = [f"r{i}" for i in range(5)]

    async def main() -> None:
        inbox, router, draft, port = await _router_and_draft(llama_dir)
        thread_sends: list[bool] = []
        loop_sends: list[str] = []
        tries: list[str] = []
        real_send_now, real_send = draft.transport.send_now, draft._frame_answers.sends.send

        def send_now(address, parts, sender=""):
            tries.append(address)
            if len(tries) == 3:  # r2's
                raise RuntimeError("a bug sending from the thread")
            thread_sends.append(real_send_now(address, parts, sender))
            return thread_sends[-1]

        def send(address, header, payload, what, who):
            loop_sends.append(what)
            return real_send(address, header, payload, what, who)

        draft.transport.send_now = send_now
        draft._frame_answers.sends.send = send
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = draft_pb2_grpc.DraftStub(ch)
                desc = await stub.Describe(pb.DescribeRequest())
                for rid in ["a", *rids]:
                    await stub.Open(draft_pb2.OpenDraftRequest(request_id=rid, capacity=32,
                                                               prompt_ids=PROMPTS["a"]))  # fmt: skip
                plain = DraftStream(stub, "draft (stream)")
                framed = DraftStream(stub, "draft (frames)")
                framed.carry_on(ControlFrames(router, inbox), desc.data_address)
                want = await asyncio.wait_for(plain.call(propose=_propose("a", 3, 7)), 30)
                for rid in rids:  # one call after another: call ids 1..5
                    got = await asyncio.wait_for(framed.call(propose=_propose(rid, 3, 7)), 30)
                    assert got == want, rid
                assert framed.frames == 5 and framed.messages == 0
                await plain.close()
                await framed.close()
        finally:
            await draft.stop()
            await router.close()
        # r0: no connection yet (False), the loop's; r1, r3, r4 the thread's; r2's failed
        assert thread_sends == [False, True, True, True] and len(tries) == 5
        assert len(loop_sends) == 2

    asyncio.run(main())


def test_only_authenticated_frames_from_peers_are_answered(llama_dir, tmp_path) -> None:
    """Under --secure a control frame without the deployment's key is not read, and one
    whose reply address is not one of the draft's peers (here only "localhost") is not
    answered, though it is reachable; the frame after them, naming a peer, is."""
    security = Security.load(make_pki(tmp_path / "pki"))

    async def main() -> None:
        inbox = Inbox()
        answers = inbox.open("token")
        router = make_transport("tcp", inbox, auth=security.frame_auth())
        await router.start()
        forger = make_transport("tcp", lambda f: None, auth=FrameAuth(b"guess" * 8))
        draft = DraftService(llama_dir, dtype="float64", security=security, peers=["localhost"])
        await draft.start()
        try:
            calls = draft_pb2.DraftControl(
                calls=[draft_pb2.DraftCall(call_id=1, propose=_propose("gone", 3, 7))]
            )
            address = draft.transport.address
            peer = router.address.replace("127.0.0.1", "localhost")
            forged = message_frame(CONTROL, "token", calls, "evil", peer)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(forger.send_frame(address, *forged), 5)
            for reply_to in (router.address, peer):  # not a peer, then one
                header, payload = message_frame(CONTROL, "token", calls, "router", reply_to)
                await router.send_frame(address, header, payload)
            frame = await asyncio.wait_for(answers.get(), 30)
            reply = draft_pb2.DraftControlReply.FromString(frame.payload.numpy().tobytes())
            assert [(a.call_id, a.code) for a in reply.answers] == [(1, NOT_FOUND)]
            await asyncio.sleep(0.2)
            assert answers.empty()  # the first two frames got no answer
        finally:
            await draft.stop()
            await forger.close()
            await router.close()

    asyncio.run(main())


@pytest.mark.parametrize("fault", ["none", "no data plane", "unreachable", "stopped"])
def test_a_request_whose_draft_calls_ride_frames_decodes_exactly(llama_dir, fault) -> None:
    """`no data plane`: a draft started without one (or of an older version) says so in
    its Describe and gets its calls on the stream; `unreachable`: the draft's data plane
    is gone (its gRPC is not), so every frame is undelivered; `stopped`: the draft stops
    mid-request. The last two make the request go on without the draft, exactly."""

    async def main() -> None:
        stages = [StageService(_stage(llama_dir, a, b, 5)) for a, b in ((0, 2), (2, 5))]
        kind = None if fault == "no data plane" else "tcp"
        draft = DraftService(llama_dir, "float64", transport_kind=kind)
        addrs = [f"127.0.0.1:{await s.start()}" for s in (*stages, draft)]
        if fault == "unreachable":
            await draft.transport.close()
        router = router_service(addrs[:2], addrs[2], health_check_interval=0.2,
                                replay_seconds=20.0)  # fmt: skip
        await router.start(startup_timeout=30)
        stopped = False
        try:
            plain = _tokens([r async for r in router.engine.generate(_request("pp", 32))])
            assert len(plain) == 32
            run = router.engine.generate(_request("specpipe", 32))
            got: list[int] = []
            while len(got) < 3:
                got += _tokens([await asyncio.wait_for(run.__anext__(), 30)])
            (driver,) = router.engine.drivers.values()
            control = next(b for b in router.engine.backends.drafts).control
            if fault == "stopped":
                await draft.stop()
                stopped = True

            async def rest() -> list:
                return [r async for r in run]

            got += _tokens(await asyncio.wait_for(rest(), 60))
            assert got == plain  # greedy: what plain decoding of the target gives
            assert isinstance(control, DraftStream) and control.opened >= 1
            if fault == "none":
                assert control.frames > 0 and control.messages == 0
                assert driver.stats.draft_drops == 0
            elif fault == "no data plane":
                assert control.frames == 0 and control.messages > 0
                assert driver.stats.draft_drops == 0
            else:
                assert driver.stats.draft_drops >= 1
        finally:
            await router.stop()
            for svc in (*stages, *([] if stopped else [draft])):
                await svc.stop()

    asyncio.run(main())


def test_an_undelivered_frame_fails_the_calls_in_flight() -> None:
    """A draft whose data plane cannot be reached: the call fails UNAVAILABLE (the driver
    goes on without the draft), as after a broken stream; the stream was opened at the
    call, so a lost draft would break it too."""

    async def main() -> None:
        inbox = Inbox()
        router, gone = await unreachable(inbox)
        stream = DraftStream(QuietControl(), "draft")
        stream.carry_on(ControlFrames(router, inbox), gone)
        call = stream.call(propose=_propose("a", 3, 7))
        with pytest.raises(grpc.aio.AioRpcError) as broke:
            await asyncio.wait_for(call, 10)
        assert stream.opened == 1
        assert broke.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "control frame not delivered" in (broke.value.details() or "")
        await stream.close()
        await router.close()

    asyncio.run(main())


def test_calls_sent_as_frames_fail_when_the_drafts_data_plane_goes() -> None:
    """A describe refresh finds the draft without its data plane (restarted without
    --data-port): the calls that went as frames will get no answer, so they fail
    UNAVAILABLE at once (the driver goes on without the draft), not at their deadline."""

    async def main() -> None:
        inbox = Inbox()
        router = make_transport("tcp", inbox)
        await router.start()
        silent = make_transport("tcp", Inbox())  # takes frames, answers none
        address = await silent.start()
        stream = DraftStream(QuietControl(), "draft")
        stream.carry_on(ControlFrames(router, inbox), address)
        call = stream.call(propose=_propose("a", 3, 7))
        await asyncio.sleep(0.2)  # sent
        assert stream.frames == 1 and not call.done()
        stream.carry_on(ControlFrames(router, inbox), "")
        with pytest.raises(grpc.aio.AioRpcError) as broke:
            await asyncio.wait_for(call, 5)
        assert broke.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "data plane changed" in (broke.value.details() or "")
        await stream.close()
        for t in (router, silent):
            await t.close()

    asyncio.run(main())
