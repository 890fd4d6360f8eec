"""The router's per-step paths outside the controller, each alone (issue 34): CPU per
frame read (`read`: a last stage's verification and a draft's answer through the TCP
receiver, `--secure` tags checked, into an inbox whose owners parse the draft's
message), per control frame sent (`send`: a feed's message framed, tagged and written
on a live loopback connection), and per message of a client's stream (`stream`: the
router's gRPC server sending 2-token deltas paced `--gap` apart to a client in another
process; the server process's CPU, all threads).

`--cold` evicts the caches (a pass over 64 MiB) before each frame, as a router step's
bursts find them (benchmarks/README.md, "Session 44: the router's step"). Run it
against any checkout for a before figure: it uses what that checkout has (a transport
without `post_bytes` sends control frames as tensors; a router without
`grpc_util.StreamWriter` streams through an async generator, as the old `Generate`).

    python benchmarks/bench_router_paths.py read send stream [--cold]
    cd ../main && .venv/bin/python ../wt/x/benchmarks/bench_router_paths.py read  # before
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time

import numpy as np

CHALLENGE = b"c" * 16
SECRET = b"s" * 32
EVICT = 64 << 20


def _evict(junk: np.ndarray | None) -> None:
    if junk is not None:
        junk += 1


async def read(n: int, cold: bool) -> float:
    """Microseconds of CPU per frame read and handed to its owner."""
    from specpipe.services.transport import Inbox, auth, tcp
    from specpipe.services.transport.codec import payload_bytes
    from specpipe.services.transport.control_frames import CONTROL_REPLY, message_frame, message_of
    from specpipe.v1 import dataplane_pb2 as pb
    from specpipe.v1 import draft_pb2

    keys = auth.FrameAuth(SECRET)
    verified = pb.FrameHeader(request_id="r" * 22, kind=pb.PAYLOAD_KIND_VERIFIED,
                              sender="stage 4/4 (layers 6:8)")  # fmt: skip
    verified.verified.node_ids.extend([0, 3, 7])
    verified.verified.token_ids.extend([11, 200, 31])
    verified.verified.position, verified.verified.sent_at_ns = 40, time.time_ns()
    reply = draft_pb2.DraftControlReply()
    answer = reply.answers.add(call_id=5)
    answer.proposal.SetInParent()
    answer_header, answer_payload = message_frame(CONTROL_REPLY, "control:t", reply, "draft")
    inbox = Inbox()
    got: list = []
    inbox.route("r" * 22, got.append)
    inbox.route("control:t", lambda f: got.append(message_of(f, draft_pb2.DraftControlReply)))
    rx = tcp.TcpTransport(inbox, auth=keys, admit=inbox.admit)
    rx.check_every = 0
    auth.FrameAuth.challenge = staticmethod(lambda: CHALLENGE)  # type: ignore[method-assign]

    class Socket:
        def get_extra_info(self, key):
            return None

        def write(self, data) -> None:
            pass

    reader = tcp._FrameReader(rx)
    reader.connection_made(Socket())  # type: ignore[arg-type]
    mac = keys.session(CHALLENGE)
    frames = []
    for _ in range(n // 2):
        for header, payload in ((verified, None), (answer_header, answer_payload)):
            hb = header.SerializeToString()
            data = payload_bytes(payload)
            frames.append(b"".join(bytes(b) for b in tcp._frame_writes(mac, hb, data)))
    junk = np.ones(EVICT, dtype=np.uint8) if cold else None
    cpu = 0.0
    for data in frames:
        _evict(junk)
        buf = reader.get_buffer(-1)
        buf[: len(data)] = data
        t0 = time.thread_time()
        reader.buffer_updated(len(data))
        cpu += time.thread_time() - t0
    assert len(got) == len(frames)
    return 1e6 * cpu / len(frames)


async def send(n: int, cold: bool) -> float:
    """Microseconds of CPU per control frame posted on a live connection."""
    from specpipe.services.transport import Inbox, auth, tcp
    from specpipe.services.transport.control_frames import CONTROL, bytes_frame
    from specpipe.v1 import stage_pb2

    keys = auth.FrameAuth(SECRET)
    feed = stage_pb2.FeedRequest(request_id="r" * 22)
    msg = stage_pb2.StageControl(feeds=[feed]).SerializeToString() + b"x" * 150
    inbox = Inbox()
    got: list = []
    inbox.route("control:t", got.append)
    rx = tcp.TcpTransport(inbox, auth=keys, admit=inbox.admit)
    tx = tcp.TcpTransport(lambda f: None, auth=keys)
    addr = await rx.start()
    reply_to = "tcp://127.0.0.1:1"
    await tx.send_frame(addr, *bytes_frame(CONTROL, "control:t", msg, "router", reply_to=reply_to))
    if hasattr(tx, "post_bytes"):  # this checkout's way
        from specpipe.services.transport.control_frames import bytes_header

        def post() -> bool:
            header = bytes_header(CONTROL, "control:t", len(msg), "router", reply_to)
            return tx.post_bytes(addr, header, msg)
    else:

        def post() -> bool:
            frame = bytes_frame(CONTROL, "control:t", msg, "router", reply_to=reply_to)
            return tx.post_frame(addr, *frame)

    junk = np.ones(EVICT, dtype=np.uint8) if cold else None
    cpu = 0.0
    for _ in range(n):
        _evict(junk)
        t0 = time.thread_time()
        assert post()
        cpu += time.thread_time() - t0
        await asyncio.sleep(0.001)
    await tx.close()
    await rx.close()
    return 1e6 * cpu / n


def _stream_server(port_q, go, n: int, gap: float) -> None:
    import grpc
    from specpipe.services import grpc_util
    from specpipe.v1 import generation_pb2 as gen
    from specpipe.v1 import generation_pb2_grpc

    def delta(i: int):
        return gen.GenerateResponse(delta=gen.TokenDelta(token_ids=[i, i + 1], index=i))

    writer = getattr(grpc_util, "StreamWriter", None)

    class Direct(generation_pb2_grpc.GenerationServicer):
        async def Generate(self, request, context) -> None:
            loop = asyncio.get_running_loop()
            w = writer(context)
            done = loop.create_future()

            def emit(i: int) -> None:  # a frame's callback
                w.write(delta(i))
                if i == n - 1:
                    done.set_result(None)

            for i in range(n):
                loop.call_later(gap * (i + 1), emit, i)
            await done
            await w.drain()
            w.close()

    class Yielding(generation_pb2_grpc.GenerationServicer):
        async def Generate(self, request, context):
            loop = asyncio.get_running_loop()
            woken: asyncio.Queue = asyncio.Queue()  # a driver's task woken per emission
            for i in range(n):
                loop.call_later(gap * (i + 1), woken.put_nowait, i)
            for _ in range(n):
                yield delta(await woken.get())

    async def serve() -> None:
        server = grpc.aio.server()
        servicer = Direct() if writer is not None else Yielding()
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_q.put(port)
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        await server.stop(0)

    asyncio.run(serve())


def _process_cpu(pid: int, task: int | None = None) -> float:
    """CPU seconds of process `pid` (all its threads), or of its thread `task`."""
    path = f"/proc/{pid}/stat" if task is None else f"/proc/{pid}/task/{task}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream_client(port: int, calls: int) -> int:
    import grpc
    from specpipe.v1 import generation_pb2 as gen
    from specpipe.v1 import generation_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        got = 0
        for _ in range(calls):
            async for _ in stub.Generate(gen.GenerateRequest()):
                got += 1
        return got


def stream(n: int, gap: float) -> tuple[float, str]:
    """Microseconds of the server process's CPU per streamed message."""
    ctx = mp.get_context("spawn")
    port_q, go = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_stream_server, args=(port_q, go, n, gap))
    p.start()
    port = port_q.get()
    asyncio.run(_stream_client(port, 1))  # warm
    cpu0, loop0 = _process_cpu(p.pid), _process_cpu(p.pid, p.pid)
    got = asyncio.run(_stream_client(port, 3))
    cpu, loop = _process_cpu(p.pid) - cpu0, _process_cpu(p.pid, p.pid) - loop0
    go.set()
    p.join()
    how = "StreamWriter" if _has_writer() else "an async generator"
    return 1e6 * cpu / got, f"{how}; the event loop's thread {1e6 * loop / got:.1f} us"


def _has_writer() -> bool:
    from specpipe.services import grpc_util

    return hasattr(grpc_util, "StreamWriter")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", choices=["read", "send", "stream"])
    ap.add_argument("--cold", action="store_true", help="caches evicted before each frame")
    ap.add_argument("--frames", type=int, default=800, help="frames read or sent")
    ap.add_argument("--messages", type=int, default=1000, help="messages per streamed call")
    ap.add_argument("--gap", type=float, default=0.002, help="seconds between messages")
    args = ap.parse_args()
    for path in args.paths:
        if path == "stream":
            us, how = stream(args.messages, args.gap)
            what = f"server CPU per streamed message ({how})"
        else:
            us = asyncio.run((read if path == "read" else send)(args.frames, args.cold))
            what = f"CPU per frame {'read' if path == 'read' else 'sent'}"
        cold = " (cold)" if args.cold and path != "stream" else ""
        print(f"{path}{cold}: {us:.1f} us {what}, load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
