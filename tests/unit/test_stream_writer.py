"""`grpc_util.StreamWriter`: a server stream written from plain callbacks sends its
messages in order, one at a time (gRPC takes one send per call at a time), with no task
of its own; `drain` waits for them, a failed send fails the stream, and `close`
abandons a send in flight."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from specpipe.services.grpc_util import ClientGone, StreamWriter
from specpipe.services.router.requests import RequestFailed
from specpipe.services.router.service import RouterService


class _Context:
    """`context.write` as grpc.aio's: a coroutine that starts a send and waits for its
    completion (a future the test completes)."""

    def __init__(self) -> None:
        self.started: list = []  # sends begun (gRPC has the message)
        self.sent: list = []  # sends whose coroutine finished
        self.pending: list[asyncio.Future] = []
        self.in_flight = self.most_in_flight = 0

    async def write(self, message) -> None:
        self.started.append(message)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        done = asyncio.get_running_loop().create_future()
        self.pending.append(done)
        try:
            await done
        finally:
            self.in_flight -= 1
        self.sent.append(message)

    def complete(self, error: BaseException | None = None) -> None:
        done = self.pending.pop(0)
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)


def _writing(*messages) -> tuple[_Context, StreamWriter]:
    """A writer over a fake call with `messages` written: the first one's send under
    way, the rest waiting."""
    ctx = _Context()
    w = StreamWriter(ctx)  # type: ignore[arg-type]
    for m in messages:
        w.write(m)
    return ctx, w


def test_messages_written_from_callbacks_go_in_order_one_at_a_time() -> None:
    async def main() -> None:
        ctx = _Context()
        w = StreamWriter(ctx)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        for i in range(3):
            loop.call_soon(w.write, i)  # a frame's callback, not a task
        await asyncio.sleep(0)
        assert ctx.in_flight == 1 and len(ctx.pending) == 1 and w.busy
        while ctx.pending:  # a completion starts the next waiting send (a callback)
            ctx.complete()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        assert ctx.started == [0, 1, 2] and ctx.most_in_flight == 1
        # the last send completed, and nothing waited for it: the next write finishes it
        assert ctx.sent == [0, 1] and w.busy
        w.write(3)
        assert ctx.sent == [0, 1, 2] and ctx.started == [0, 1, 2, 3]
        loop.call_later(0.01, ctx.complete)
        await w.drain()
        assert ctx.sent == [0, 1, 2, 3] and not w.busy
        w.write(4)  # nothing under way: starts at once
        assert ctx.started[-1] == 4 and ctx.in_flight == 1
        w.close()

    asyncio.run(main())


def test_a_failed_send_fails_the_stream() -> None:
    async def main() -> None:
        ctx, w = _writing("a", "b")
        ctx.complete(ConnectionError("the client went away"))
        with pytest.raises(ClientGone):
            await w.drain()
        with pytest.raises(ClientGone):
            w.write("c")
        assert ctx.sent == [] and not w.busy

    asyncio.run(main())


def test_close_abandons_a_send_in_flight() -> None:
    async def main() -> None:
        ctx, w = _writing("a", "b")
        done = ctx.pending[0]
        w.close()
        assert done.cancelled() and not w.busy and ctx.in_flight == 0

    asyncio.run(main())


def test_one_callback_per_completed_send_when_writes_finish_sends(monkeypatch) -> None:
    """A write that finishes a completed send before its callback ran: that callback
    must not watch the next send again (callbacks piled up, one more per send: the
    stream's CPU grew with the square of its messages)."""
    resumes = 0
    resume = StreamWriter._resume

    def counted(self, done) -> None:
        nonlocal resumes
        resumes += 1
        resume(self, done)

    monkeypatch.setattr(StreamWriter, "_resume", counted)

    async def main() -> None:
        ctx = _Context()
        w = StreamWriter(ctx)  # type: ignore[arg-type]
        w.write(0)
        w.write(1)
        for i in range(2, 50):
            ctx.complete()  # its callback is scheduled ...
            w.write(i)  # ... and this write finishes the send first
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        assert ctx.started == list(range(len(ctx.started))) and ctx.most_in_flight == 1
        assert resumes <= 50
        w.close()

    asyncio.run(main())


def test_a_send_that_ends_cancelled_fails_the_stream_not_the_drainer() -> None:
    """gRPC's own send future cancelled (not the handler): `drain` raises ClientGone,
    not CancelledError, so the handler still ends with its request's status."""

    async def main() -> None:
        ctx = _Context()
        w = StreamWriter(ctx)  # type: ignore[arg-type]
        w.write("a")
        asyncio.get_running_loop().call_soon(ctx.pending[0].cancel)
        with pytest.raises(ClientGone):
            await w.drain()
        assert not w.busy

    asyncio.run(main())


class _Engine:
    """What RouterService.Generate uses of the engine: a request that sends a delta from
    a callback, then ends (finished) or fails (`fail`)."""

    def __init__(self, fail: RequestFailed | None = None) -> None:
        self.fail = fail
        self.closed = False
        self.api_keys = SimpleNamespace(caller_of_call=lambda context: None)

    async def generate(self, request, deadline, caller, sink):
        try:
            yield "started"
            asyncio.get_running_loop().call_soon(sink, "delta")  # a frame's callback
            await asyncio.sleep(0.01)
            if self.fail is not None:
                raise self.fail
            yield "finished"
        finally:  # closed early or ended: the engine releases the request here
            self.closed = True


class _FailingContext(_Context):
    """A client that is gone: its first send fails as gRPC's do (`fail`: a plain
    Exception, or the send's future ends cancelled)."""

    def __init__(self, cancel: bool = False) -> None:
        super().__init__()
        self.cancel = cancel
        self.aborted: tuple | None = None

    def time_remaining(self):
        return None

    async def write(self, message) -> None:
        if not self.cancel:
            raise Exception("ExecuteBatchError: the call is gone")  # grpc's own type
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, future.cancel)  # while drain waits
        await future

    async def abort(self, code, details, trailing_metadata=()):
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


def test_a_failed_send_ends_the_handler_quietly_and_closes_the_request() -> None:
    async def main() -> None:
        engine = _Engine()
        ctx = _FailingContext()
        await RouterService.Generate(SimpleNamespace(engine=engine), None, ctx)  # type: ignore[arg-type]
        assert engine.closed and ctx.aborted is None

    asyncio.run(main())


def test_a_failed_request_keeps_its_status_when_a_send_ended_cancelled() -> None:
    async def main() -> None:
        failure = RequestFailed(grpc.StatusCode.UNAVAILABLE, "a stage went down")
        engine = _Engine(fail=failure)
        ctx = _FailingContext(cancel=True)
        with pytest.raises(grpc.aio.AbortError):
            await RouterService.Generate(SimpleNamespace(engine=engine), None, ctx)  # type: ignore[arg-type]
        assert engine.closed and ctx.aborted == (grpc.StatusCode.UNAVAILABLE, "a stage went down")

    asyncio.run(main())
