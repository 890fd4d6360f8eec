"""`grpc_util.StreamWriter` over a real grpc.aio call (loopback): messages written from
plain loop callbacks reach the client all and in order with status OK, and a client's
cancel mid-stream ends the handler (cancelled or `ClientGone`) without a send left
under way. test_stream_writer.py covers the writer's steps with a fake `write`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from specpipe.services.grpc_util import ClientGone, StreamWriter

_METHOD = "/specpipe.test.Stream/Numbers"


class _Numbers:
    """A server-stream handler that writes `int(request)` messages ("0", "1", ...)
    from a chain of loop callbacks (as the router's deltas come from frames'
    callbacks, not from its handler), `every` at a time; 0: until the client goes.
    `ended` says how the handler ended and `writer` is kept for the test to check."""

    def __init__(self, every: int = 7) -> None:
        self.every = every
        self.ended: asyncio.Future[str] | None = None
        self.writer: StreamWriter | None = None

    async def handle(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        loop = asyncio.get_running_loop()
        self.ended = loop.create_future()
        writer = self.writer = StreamWriter(context)
        n, done = int(request), loop.create_future()
        sent = 0
        stop = False

        def step() -> None:  # a frame's callback: a few messages, then the next frame
            nonlocal sent
            if stop or done.done():
                return
            try:
                for _ in range(self.every):
                    if n and sent == n:
                        done.set_result(None)
                        return
                    writer.write(str(sent).encode())
                    sent += 1
            except ClientGone as e:
                done.set_exception(e)
                return
            loop.call_soon(step)

        loop.call_soon(step)
        outcome = "returned"
        try:
            await done
            await writer.drain()
        except ClientGone:
            outcome = "client gone"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            stop = True
            writer.close()
            self.ended.set_result(outcome)


async def _serve(handler: Callable) -> tuple[grpc.aio.Server, grpc.aio.Channel]:
    server = grpc.aio.server()
    service, method = _METHOD.strip("/").split("/")
    rpc = grpc.unary_stream_rpc_method_handler(handler)  # bytes in and out
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: rpc}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def test_messages_from_callbacks_reach_the_client_in_order() -> None:
    async def main() -> None:
        handler = _Numbers()
        server, channel = await _serve(handler.handle)
        try:
            call = channel.unary_stream(_METHOD)(b"3000")
            got = [m async for m in call]
            assert got == [str(i).encode() for i in range(3000)]
            assert await call.code() == grpc.StatusCode.OK
            assert handler.ended is not None and await handler.ended == "returned"
            assert handler.writer is not None and not handler.writer.busy
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_client_cancel_mid_stream_ends_the_handler() -> None:
    async def main() -> None:
        handler = _Numbers()
        server, channel = await _serve(handler.handle)
        try:
            call = channel.unary_stream(_METHOD)(b"0")  # until the client goes
            got = []
            async for m in call:
                got.append(m)
                if len(got) == 50:
                    call.cancel()
                    break
            assert got == [str(i).encode() for i in range(50)]
            assert await call.code() == grpc.StatusCode.CANCELLED
            assert handler.ended is not None
            # a hang guard, not a timing: the handler ends once gRPC sees the cancel
            outcome = await asyncio.wait_for(asyncio.shield(handler.ended), 10)
            assert outcome in ("cancelled", "client gone")
            assert handler.writer is not None and not handler.writer.busy
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(asyncio.wait_for(main(), 30))
