"""`grpc_util.StreamWriter`: a server stream written from plain callbacks sends its
messages in order, one at a time (gRPC takes one send per call at a time), with no task
of its own; `drain` waits for them, a failed send fails the stream, and `close`
abandons a send in flight."""

from __future__ import annotations

import asyncio

import pytest
from specpipe.services.grpc_util import StreamWriter


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
        ctx = _Context()
        w = StreamWriter(ctx)  # type: ignore[arg-type]
        w.write("a")
        w.write("b")
        ctx.complete(ConnectionError("the client went away"))
        with pytest.raises(ConnectionError):
            await w.drain()
        with pytest.raises(ConnectionError):
            w.write("c")
        assert ctx.sent == [] and not w.busy

    asyncio.run(main())


def test_close_abandons_a_send_in_flight() -> None:
    async def main() -> None:
        ctx = _Context()
        w = StreamWriter(ctx)  # type: ignore[arg-type]
        w.write("a")
        w.write("b")
        done = ctx.pending[0]
        w.close()
        assert done.cancelled() and not w.busy and ctx.in_flight == 0

    asyncio.run(main())
