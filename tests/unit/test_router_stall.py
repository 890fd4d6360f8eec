"""A slow request is not a stalled one, and a replay never runs beside its first copy
(issue 35, F1: a slow 32k-token prefill was replayed onto the same stages while it still
ran there, and the stage's memory doubled until the kernel killed it).

The fake pipeline (router_fakes.py) holds the first path's first verification back, as a
long prefill does; meanwhile it reports progress or says nothing."""

from __future__ import annotations

import asyncio

import grpc
from specpipe.common.spec.controller import make_controller
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.services.router.driver import DriverSettings, RequestDriver
from specpipe.services.router.path_session import first_path
from specpipe.services.transport.codec import Frame, empty_header

from .router_fakes import TEXT, VOCAB, FakePipeline, deployment

PROMPT = TEXT[:12]
NEW = 10
EXPECTED = TEXT[len(PROMPT) : len(PROMPT) + NEW]
STALL = 0.3  # seconds without progress before a replay
SLOW = 1.2  # the first path's first verification comes this late


def slow_first_path(pipeline: FakePipeline, progress: bool) -> None:
    """The first wire id's first verification comes `SLOW` seconds late; with
    `progress`, the stages report every 0.05 s that they compute it meanwhile."""
    feed = pipeline.feed
    held: set[str] = set()

    def slow_feed(request) -> None:
        rid = request.request_id
        if rid != "r" or request.rows.committed or rid in held:
            feed(request)
            return
        held.add(rid)
        loop = asyncio.get_running_loop()
        loop.call_later(SLOW, feed, request)
        if progress:
            for i in range(int(SLOW / 0.05)):
                header = empty_header(rid, 0, "stage 0")
                loop.call_later(0.05 * i, lambda h=header: pipeline.inbox(Frame(h)))

    pipeline.feed = slow_feed  # type: ignore[method-assign]


def run(progress: bool, events: list[tuple[str, str, str]]):
    dep = deployment(ranges=((0, 2), (2, 4)))
    slow_first_path(dep.pipeline, progress)
    for s in dep.stages:  # the order of opens and releases, on every replica
        stub = s.stub
        for name in ("Open", "Release"):
            real = getattr(stub, name)

            async def logged(request, timeout, real=real, name=name, label=stub.label):
                if name == "Release":  # a busy stage answers late; logged once done
                    await asyncio.sleep(0.2)
                    answer = await real(request, timeout)
                    events.append((label, name, request.request_id))
                    return answer
                events.append((label, name, request.request_id))
                return await real(request, timeout)

            setattr(stub, name, logged)

    async def main():
        opts = DecodeOptions(max_new_tokens=NEW, prefill_chunk=4, width=4)
        path = first_path(dep.backends, Mode.PP, opts, PROMPT)
        controller = make_controller(Mode.PP, "r", PROMPT, opts, len(path.stages))
        settings = DriverSettings(replay_timeout=0.0, stall_timeout=STALL)
        driver = RequestDriver(controller, dep.backends, path, "tcp://router:1", dep.inbox,
                               settings=settings, vocab_size=VOCAB)  # fmt: skip
        out: list[int] = []
        try:
            async for tokens in driver.run():
                out += tokens
        finally:
            await driver.release()
        return driver, out

    return dep, *asyncio.run(asyncio.wait_for(main(), 30))


def test_a_slow_request_that_reports_progress_is_not_replayed() -> None:
    events: list[tuple[str, str, str]] = []
    dep, driver, out = run(progress=True, events=events)
    assert out == EXPECTED
    assert driver.stats.replays == 0 and driver.wire_id == "r"
    assert [s.stub.opened for s in dep.stages] == [["r"], ["r"]]


def test_a_silent_request_is_replayed_only_once_its_first_copy_is_released() -> None:
    events: list[tuple[str, str, str]] = []
    dep, driver, out = run(progress=False, events=events)
    assert out == EXPECTED
    assert driver.stats.replays == 1 and driver.wire_id == "r~1"
    for s in dep.stages:  # replayed onto the same replicas: after they released "r"
        mine = [(name, rid) for label, name, rid in events if label == s.stub.label]
        assert mine.index(("Release", "r")) < mine.index(("Open", "r~1")), mine


def test_a_replica_that_does_not_confirm_the_release_is_left_out_of_the_replay() -> None:
    dep = deployment(ranges=((0, 4),), replicas=2)
    slow_first_path(dep.pipeline, progress=False)

    async def refuse(request, timeout):
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), "slow"
        )

    async def main():
        opts = DecodeOptions(max_new_tokens=NEW, prefill_chunk=4, width=4)
        path = first_path(dep.backends, Mode.PP, opts, PROMPT)
        path.stages[0].stub.Release = refuse  # it still computes the first copy
        for s in dep.stages[1:]:  # the other replica is the one a tie would not pick
            s.served = 1000
        controller = make_controller(Mode.PP, "r", PROMPT, opts, len(path.stages))
        settings = DriverSettings(replay_timeout=0.0, stall_timeout=STALL)
        driver = RequestDriver(controller, dep.backends, path, "tcp://router:1", dep.inbox,
                               settings=settings, vocab_size=VOCAB)  # fmt: skip
        out = [t async for tokens in driver.run() for t in tokens]
        await driver.release()
        return path.stages[0], driver, out

    first, driver, out = asyncio.run(asyncio.wait_for(main(), 30))
    assert out == EXPECTED and driver.stats.replays == 1
    assert driver.path.stages[0] is not first  # not beside the copy it could not cancel
    assert first.stub.opened == ["r"]
