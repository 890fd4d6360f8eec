"""Feeds and prunes as data-plane control frames (services/transport/control_frames.py)
between a router's `StageStream` and a real stage service: a request's prompt and tree
fed as frames are verified exactly as on the stream, a refusal comes back as a reply
frame to its own request only, releases still go on the gRPC stream (which a stage's
death breaks), and a stage's data plane that cannot be reached is a fault of every
request on the stream (the driver replays them, as after a broken stream)."""

from __future__ import annotations

import asyncio

import grpc
from specpipe.services.router.control_stream import ControlFrames, StageStream
from specpipe.services.stage_service import StageService
from specpipe.services.transport import Inbox, Transport, make_transport
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import stage_pb2_grpc

from .test_services_alignment import _feeds
from .test_services_stage import _chain_drawn, _drawn, _open_last, _stage

NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


def test_feeds_and_prunes_as_frames_verify_exactly_and_refusals_come_back(llama_dir) -> None:
    async def main() -> None:
        inbox = Inbox()
        verified = inbox.open("r")
        router = make_transport("tcp", inbox)
        router_addr = await router.start()
        svc = StageService(_stage(llama_dir, 0, 5, 5))
        port = await svc.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = stage_pb2_grpc.StageStub(ch)
                desc = await stub.Describe(pb.DescribeRequest())
                assert desc.control_frames
                await stub.Open(_open_last("r", router_addr))
                stream = StageStream(stub, "stage 1")
                stream.carry_on(ControlFrames(router, inbox), desc.data_address)
                told: dict[str, list] = {"r": [], "gone": []}
                for rid in told:
                    stream.attach(rid, lambda code, msg, rid=rid: told[rid].append((code, msg)))
                for feed in _feeds(llama_dir, "r"):
                    stream.feed(feed, 5.0)
                    await asyncio.sleep(0)
                frame = await asyncio.wait_for(verified.get(), 30)
                assert _drawn(frame) == _chain_drawn(llama_dir)  # as fed on the stream
                stream.prune(pb.PruneRequest(request_id="gone", prune=pb.PruneSignal(seq=1)), 5.0)
                for _ in range(200):
                    if told["gone"]:
                        break
                    await asyncio.sleep(0.01)
                assert [code for code, _ in told["gone"]] == [NOT_FOUND]
                assert "not open" in told["gone"][0][1] and told["r"] == []
                assert stream.frames == 3 and stream.messages == 0  # nothing on gRPC yet
                assert await asyncio.wait_for(stream.release("r"), 5)  # on the stream
                assert stream.messages == 1 and stream.opened == 1
                assert "r" not in svc._requests
                await stream.close()
        finally:
            await svc.stop()
            await router.close()

    asyncio.run(main())


class QuietControl:
    """A replica stub whose control stream opens and stays quiet."""

    def Control(self, requests):
        async def replies():
            async for _ in requests:
                pass
            return
            yield

        return replies()


async def unreachable(inbox: Inbox) -> tuple[Transport, str]:
    """A router's transport (started), and a data-plane address where nothing listens."""
    router = make_transport("tcp", inbox, handshake_seconds=2.0)
    await router.start()
    closed = make_transport("tcp", inbox)
    gone = await closed.start()
    await closed.close()
    return router, gone


def test_an_unreachable_data_plane_is_a_fault_of_every_request_on_the_stream() -> None:
    async def main() -> None:
        inbox = Inbox()
        router, gone = await unreachable(inbox)
        stream = StageStream(QuietControl(), "stage 2")
        stream.carry_on(ControlFrames(router, inbox), gone)
        told: dict[str, list] = {"a": [], "b": []}
        for rid in told:
            stream.attach(rid, lambda code, msg, rid=rid: told[rid].append((code, msg)))
        assert stream.opened == 1  # opened at the first attach: a dead stage breaks it
        stream.prune(pb.PruneRequest(request_id="a", prune=pb.PruneSignal(seq=1)), 5.0)
        for _ in range(500):
            if told["a"] and told["b"]:
                break
            await asyncio.sleep(0.01)
        assert [code for code, _ in told["a"]] == [UNAVAILABLE]
        assert [code for code, _ in told["b"]] == [UNAVAILABLE]
        assert "control frame not delivered" in told["a"][0][1]
        await stream.close()
        assert "control:" not in str(inbox._sinks)  # its answers' route is gone
        await router.close()

    asyncio.run(main())
