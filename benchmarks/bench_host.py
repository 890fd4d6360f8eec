"""The host cost of a pipeline step (issue 34): CPU per step of every process of an
emulated deployment, and where it goes.

`specpipe up --emulate-costs`'s processes (router, S stages, the draft; TCP, secure as
`up` runs them) serve a tiny random Llama that is its own draft (8 layers, hidden 64,
vocabulary 512: its real forwards fit the modelled ones), every stage forward paced to
`--stage-ms` and the draft's to `--draft-ms`, greedy, W = 4, `--max-new-tokens` tokens per
request, closed loop at each of `--concurrency` clients. Per process it prints the CPU
time (user + system of all its threads, from /proc, over the cell) per pipeline step (the
last stage's forwards) and per emitted token, that per token split by thread (its main
thread, a service's event loop; its busiest other, a stage's or the draft's compute
thread; the rest), and, with py-spy attached to every process
(`--profile`, sampling without stopping it), where its on-CPU samples go, grouped by
subsystem (`SUBSYSTEMS`: the first frame from the leaf up that a rule claims) and the
leaf functions that cost most. Every output is checked against the in-process lockstep
engine's.

    python benchmarks/bench_host.py                       # 1 and 8 clients, ~2 minutes
    python benchmarks/bench_host.py --concurrency 1 --no-profile
    python benchmarks/bench_host.py --wire                # the control message's cost only
    python benchmarks/bench_host.py --idle 20             # CPU per second serving nothing

`--wire` (how the control plane's transport was chosen, docs/architecture.md, "6. Control
plane and data plane"): the CPU time of one control message (a feed of 4 rows) sent and
taken, both ends in this process on loopback, one message per 0.5 ms as a step's would
come: a unary gRPC call, a message on a bidirectional gRPC stream, and a data-plane TCP
frame (what riding the data plane would cost); then a step's control to 4 stages through
the router's `StageStream`s, and the draft's Propose round trip through its `DraftStream`
(one call, and 8 calls in one turn as 8 clients' would come; the draft's end in a process
of its own, each end's CPU apart), each on gRPC streams and as control frames.

Writes results/host/results.json and results.md (the tables printed). CPU time, not wall
clock: a shared 2-core machine measures it fairly. One piece: the wire part prices the
very messages the cells' processes send, counted the same way, and the README's tables
quote both together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_emulated import FIXED_TREE, cpu_seconds, stream_all, synthetic_flat  # noqa: E402
from bench_serve import make_model, scrape  # noqa: E402
from specpipe.common.spec.options import DecodeOptions  # noqa: E402

OUT = HERE / "results" / "host"
STEPS_KEY = "specpipe:stage_forward_seconds_count"  # the last stage's forwards: steps
# The first stage's feeds: one per request and pipeline step (a tree layer entering the
# pipeline). The last stage's rounds also count rounds of prunes only, about 1.7 per
# pipeline step at 1 client, so CPU per feed is the honest per-step figure there.
FEEDS_KEY = "specpipe:stage_feeds_per_call_sum"
# rows each stage computed: pruned rows a stage learns of late are computed all the same
ROWS_KEY = "specpipe:stage_rows_total"
# the draft's batched forwards and their rows (prefill chunks included)
DRAFT_KEYS = ("specpipe:draft_forward_seconds_count", "specpipe:draft_rows_total")

# Subsystems, checked from a sample's leaf frame up: the first rule whose pattern is in a
# frame's file (or "file:function") claims the sample. Project modules first (they call
# the libraries), then the libraries.
SUBSYSTEMS: list[tuple[str, tuple[str, ...]]] = [
    ("metrics", ("services/metrics.py", "prometheus_client")),
    ("logging", ("logging/", "services/ratelog.py")),
    ("block tables", ("block_pool.py", "kv_cache.py", "paged_batch.py", "prefix_hash.py")),
    ("model forward", ("common/model/", "torch/", "common/runtime/stage.py",
                       "common/runtime/draft.py", "common/runtime/verifier.py",
                       "common/perf/emulate.py", "compute_round.py:_forward")),
    ("controller", ("common/spec/",)),
    ("data plane frames", ("services/transport/",)),
    ("control messages", ("services/control.py", "services/router/executor.py",
                          "services/router/batched.py", "services/router/control_stream.py",
                          "services/control_stream.py", "_pb2")),
    ("stage bookkeeping", ("common/runtime/ordering.py", "common/runtime/alignment.py",
                           "common/runtime/validation.py", "services/compute_round.py",
                           "services/stage_service.py", "services/draft_service.py",
                           "common/runtime/lease.py", "services/lease.py")),
    ("router driver", ("services/router/",)),
    ("gRPC/protobuf", ("grpc/", "google/protobuf")),
    ("asyncio", ("asyncio/", "selectors.py")),
    ("thread hand-offs", ("threading.py", "concurrent/futures", "queue.py")),
]  # fmt: skip

# Leaves in a blocking call (native code under them): py-spy, sampling without stopping
# the process, cannot always tell whether such a thread was waiting or working (epoll
# with a zero timeout is work; a sleep in the pacer is not), so they are a group of their
# own, "waits", partly idle.
WAITS = (
    "selectors.py:EpollSelector.select",
    "selectors.py:_PollLikeSelector.select",  # the metrics server
    "perf/emulate.py:Pacer.forward",
    "perf/emulate.py:Deadline.wait",  # the pacer's sleep at hand-off
    "futures/thread.py:_worker",
    "threading.py:Thread.run",
    "threading.py:Condition.wait",
    "queue.py:Queue.get",
)


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# -- profiles ------------------------------------------------------------------------------
def start_profilers(pids: dict[str, int], work: Path, rate: int, seconds: float) -> dict:
    """py-spy on every process, sampling on-CPU stacks without stopping it (stopping it
    per sample, as C frames would need, doubles its CPU time here)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).is_file():
        log("py-spy is not installed (the bench extra, or pip install py-spy): no profiles")
        return {}
    procs = {}
    for name, pid in pids.items():
        out = work / f"{name}.txt"
        argv = [spy, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
                "--duration", str(int(seconds)), "-o", str(out), "--nonblocking"]  # fmt: skip
        procs[name] = (
            subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
            out,
        )
    return procs


def stop_profilers(procs: dict) -> dict[str, Path]:
    out = {}
    for name, (p, path) in procs.items():
        p.send_signal(2)  # SIGINT: py-spy writes what it has
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
        if path.is_file():
            out[name] = path
        else:
            log(f"  no profile of {name}: {p.stderr.read().decode(errors='replace')[-300:]}")
    return out


def frames_of(stack: str) -> list[str]:
    """'thread;root (file:line);...;leaf (file:line)' -> frames leaf first, as
    'file:function'."""
    out = []
    for f in reversed(
        stack.split(";")[1:] if stack.startswith(("thread", "process")) else stack.split(";")
    ):
        name, _, where = f.rpartition(" (")
        out.append(f"{where.rsplit(':', 1)[0]}:{name}" if where else f)
    return out


def subsystem(frames: list[str]) -> str:
    if frames and any(frames[0].endswith(leaf) for leaf in WAITS):
        return "waits"
    for frame in frames:
        for group, patterns in SUBSYSTEMS:
            if any(p in frame for p in patterns):
                return group
    return "other"


def summarize_profile(path: Path, top: int = 8) -> dict:
    """Shares of the samples that are not waits, by subsystem and by leaf function
    (`waits`: the share of all samples that were, mostly idle)."""
    groups: Counter = Counter()
    leaves: Counter = Counter()
    total = waits = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames, count = frames_of(stack), int(n)
        group = subsystem(frames)
        if group == "waits":
            waits += count
            continue
        total += count
        groups[group] += count
        leaf = frames[0] if frames else "?"
        leaves["/".join(leaf.split("/")[-2:])] += count
    share = lambda c: {k: round(v / total, 3) for k, v in c.most_common(top)}  # noqa: E731
    return {
        "samples": total,
        "waits": round(waits / max(total + waits, 1), 3),
        "subsystems": share(groups) if total else {},
        "top_leaves": share(leaves) if total else {},
    }


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each live thread of process `pid`, by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def thread_split(pid: int, before: dict[int, float], after: dict[int, float]) -> dict:
    """A process's CPU seconds over a cell by thread: its main thread (a service's event
    loop), its busiest other thread (a stage's or the draft's compute thread) and the rest
    (gRPC's, the metrics', executors'; threads that ended count in none)."""
    spent = {tid: cpu - before.get(tid, 0.0) for tid, cpu in after.items()}
    loop = spent.pop(pid, 0.0)
    busiest = max(spent.values(), default=0.0)
    return {"loop": loop, "busiest": busiest, "rest": sum(spent.values()) - busiest}


# -- the wire: one control message's CPU ------------------------------------------------------
def _cpu() -> float:
    return time.process_time()


async def _paced(send, n: int, gap: float) -> float:
    """CPU seconds per message of `send()` awaited n times, one per `gap`, less the pacing
    loop's own."""
    c0 = _cpu()
    for _ in range(n):
        await send()
        await asyncio.sleep(gap)
    c1 = _cpu()
    for _ in range(n):
        await asyncio.sleep(gap)
    return ((c1 - c0) - (_cpu() - c1)) / n


async def wire(n: int = 2000, gap: float = 0.0005) -> dict[str, float]:
    import grpc
    from specpipe.services.transport import make_transport
    from specpipe.v1 import dataplane_pb2 as pb
    from specpipe.v1 import stage_pb2, stage_pb2_grpc

    got = []

    class Stage(stage_pb2_grpc.StageServicer):
        async def Feed(self, request, context):
            got.append(request.seq)
            return stage_pb2.FeedResponse()

        async def Control(self, requests, context):
            async for msg in requests:
                got.append(len(msg.feeds) + len(msg.prunes))
            return
            yield

    server = grpc.aio.server()
    stage_pb2_grpc.add_StageServicer_to_server(Stage(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = stage_pb2_grpc.StageStub(channel)
    rows = pb.Rows(positions=[9, 9, 9, 9], node_ids=[5, 6, 7, 8], parent_ids=[1, 1, 1, 1])
    feed = stage_pb2.FeedRequest(request_id="r" * 22, seq=3, rows=rows, token_ids=[1, 2, 3, 4])
    out = {}
    await stub.Feed(feed)
    out["unary gRPC call"] = await _paced(lambda: stub.Feed(feed), n, gap)

    queue: asyncio.Queue = asyncio.Queue()

    async def messages():
        while (m := await queue.get()) is not None:
            yield m

    call = stub.Control(messages())

    async def on_stream() -> None:
        queue.put_nowait(stage_pb2.StageControl(feeds=[feed]))

    out["message on a gRPC stream"] = await _paced(on_stream, n, gap)
    queue.put_nowait(None)
    async for _ in call:
        pass

    receiver = make_transport("tcp", lambda frame: got.append(frame.header.seq))
    sender = make_transport("tcp", lambda frame: None)
    address = await receiver.start()
    header = pb.FrameHeader(request_id="r" * 22, seq=3, rows=rows)
    await sender.send_frame(address, header)
    out["data-plane TCP frame"] = await _paced(lambda: sender.send_frame(address, header), n, gap)
    await sender.close()
    await receiver.close()
    prune = pb.PruneRequest(request_id="r" * 22, prune=pb.PruneSignal(seq=3))
    for carrier in ("gRPC streams", "control frames"):
        key = f"a step's control to 4 stages (feed + 4 prunes), {carrier}"
        out[key] = await _control_turns(port, feed, prune, carrier == "control frames", n, gap)
    await channel.close()
    await server.stop(None)
    for calls in (1, 8):
        for carrier in ("gRPC stream", "control frames"):
            key = f"the draft's Propose round trip, {calls} call(s) a turn, {carrier}"
            router, draft = await _propose_turns(calls, carrier == "control frames", n, gap)
            out[f"{key}: router"], out[f"{key}: draft"] = router, draft
    return {k: round(1e6 * v, 1) for k, v in out.items()}


_PROPOSAL = dict(parent_ids=[0, 0, 1, 1], token_ids=[5, 6, 7, 8], probs=[0.4, 0.3, 0.2, 0.1])


def _answered(msg):
    """A draft's answer to a `DraftControl`: every Propose answered with 4 candidates."""
    from specpipe.v1 import draft_pb2

    proposal = draft_pb2.ProposeResponse(**_PROPOSAL)
    answers = [draft_pb2.DraftAnswer(call_id=c.call_id, proposal=proposal) for c in msg.calls]
    return draft_pb2.DraftControlReply(answers=answers)


async def _serve_draft_calls(conn) -> None:
    """A draft's control ends, answering at once: its gRPC `Control` stream, and its
    data plane reading and answering control frames as the draft service does
    (`read_control`, `answer`); its CPU time when the parent asks ("cpu")."""
    import grpc
    from specpipe.services.peers import Peers
    from specpipe.services.transport import control_frames, make_transport
    from specpipe.services.transport.background_sends import BackgroundSends
    from specpipe.v1 import draft_pb2, draft_pb2_grpc

    class Draft(draft_pb2_grpc.DraftServicer):
        async def Control(self, requests, context):
            async for msg in requests:
                yield _answered(msg)

    server = grpc.aio.server()
    draft_pb2_grpc.add_DraftServicer_to_server(Draft(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    peers = Peers.parse(())

    def check(address: str) -> None:
        peers.check_hop(address, "tcp", "this draft")

    def on_frame(frame) -> None:
        msg = control_frames.read_control(frame, draft_pb2.DraftControl, check, "draft")
        control_frames.answer(sends, frame.header, _answered(msg), "draft")

    transport = make_transport("tcp", on_frame)
    sends = BackgroundSends(transport)
    conn.send((port, await transport.start()))
    loop = asyncio.get_running_loop()
    while await loop.run_in_executor(None, conn.recv) == "cpu":
        conn.send(time.process_time())
    await transport.close()
    await server.stop(None)


def _draft_process(conn) -> None:
    asyncio.run(_serve_draft_calls(conn))


async def _propose_turns(calls: int, frames: bool, n: int, gap: float) -> tuple[float, float]:
    """CPU seconds per turn of `calls` Propose calls (4 rows and a prune each) through the
    router's `DraftStream` to a draft process that answers each at once (4 candidates),
    on its gRPC stream or as control frames: (the router's, the draft's)."""
    import multiprocessing

    import grpc
    from specpipe.services.router.control_stream import ControlFrames, DraftStream
    from specpipe.services.transport import Inbox, make_transport
    from specpipe.v1 import dataplane_pb2 as pb
    from specpipe.v1 import draft_pb2, draft_pb2_grpc

    ctx = multiprocessing.get_context("spawn")
    conn, child_end = ctx.Pipe()
    child = ctx.Process(target=_draft_process, args=(child_end,), daemon=True)
    child.start()
    loop = asyncio.get_running_loop()
    port, address = await loop.run_in_executor(None, conn.recv)

    async def draft_cpu() -> float:
        conn.send("cpu")
        return await loop.run_in_executor(None, conn.recv)

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    inbox = Inbox()
    router = make_transport("tcp", inbox)
    await router.start()
    stream = DraftStream(draft_pb2_grpc.DraftStub(channel), "draft")
    if frames:
        stream.carry_on(ControlFrames(router, inbox), address)
    rows = pb.Rows(positions=[9, 9, 9, 9], node_ids=[5, 6, 7, 8], parent_ids=[1, 1, 1, 1])
    prune = pb.PruneSignal(seq=3, commit_ids=[1, 2], horizon=4)
    ask = dict(rows=rows, token_ids=[1, 2, 3, 4], top_k=4, prunes=[prune])
    asks = [draft_pb2.ProposeRequest(request_id=f"{i:022d}", **ask) for i in range(calls)]

    async def turn() -> None:
        await asyncio.gather(*(stream.call(propose=a) for a in asks))

    await turn()
    d0 = await draft_cpu()
    cost = await _paced(turn, n, gap)
    draft = (await draft_cpu() - d0) / n  # its idle share (the pacing's second half) is ~0
    await stream.close()
    await channel.close()
    await router.close()
    conn.send("stop")
    child.join(10)
    return cost, draft


async def _control_turns(port: int, feed, prune, frames: bool, n: int, gap: float) -> float:
    """CPU seconds per step of the router's `StageStream`s to 4 stages (stage 1's feed,
    every stage's prune; a channel each, as the router has) and of their taking, on gRPC
    streams or as control frames."""
    import grpc
    from specpipe.services.router.control_stream import ControlFrames, StageStream
    from specpipe.services.transport import Inbox, make_transport
    from specpipe.v1 import stage_pb2_grpc

    inbox = Inbox()
    router = make_transport("tcp", inbox)
    await router.start()
    stages = [make_transport("tcp", lambda frame: None) for _ in range(4)]
    addresses = [await t.start() for t in stages]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(4)]
    streams = [
        StageStream(stage_pb2_grpc.StageStub(ch), f"stage {i}") for i, ch in enumerate(channels)
    ]
    for stream, address in zip(streams, addresses, strict=True):
        if frames:
            stream.carry_on(ControlFrames(router, inbox), address)
        stream.attach(feed.request_id, lambda code, message: None)

    async def step() -> None:
        streams[0].feed(feed, 60.0)
        for stream in streams:
            stream.prune(prune, 60.0)

    await step()
    cost = await _paced(step, n, gap)
    for stream in streams:
        await stream.close()
    for ch in channels:
        await ch.close()
    for t in (router, *stages):
        await t.close()
    return cost


# -- idle: what serving nothing costs (health checks, timers) ---------------------------------
def idle_cpu(dep, seconds: float) -> dict[str, float]:
    """CPU ms per second of each process over `seconds` without a request (after 3 s to
    settle)."""
    time.sleep(3.0)
    pids = {name: c.proc.pid for name, c in dep.children.items() if c.proc is not None}
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    return {n: round(1e3 * (cpu_seconds(p) - cpu0[n]) / seconds, 2) for n, p in pids.items()}


# -- one cell ------------------------------------------------------------------------------
def run_cell(args, dep, local, conc: int, work: Path) -> dict:
    from specpipe.common.perf.timeline import Ask, closed_loop
    from specpipe.common.runtime.lockstep import LockstepEngine
    from specpipe.services.client.loadgen import load_dataset

    n = max(args.min_requests, conc * args.requests_per_client)
    prompts = [list(p.ids) for p in load_dataset(f"random:{args.prompt_len}", n, 511, conc)]
    kwargs = dict(mode="specpipe", max_new_tokens=args.max_new_tokens, ignore_eos=True,
                  width=args.width)  # fmt: skip
    pids = {name: c.proc.pid for name, c in dep.children.items() if c.proc is not None}
    last = f"stage{args.stages - 1}"
    addrs = dep.metrics_addresses()
    before = scrape(addrs[last])
    feeds0 = scrape(addrs["stage0"]).get(FEEDS_KEY, 0.0)
    stages = [f"stage{i}" for i in range(args.stages)]
    rows0 = {s: scrape(addrs[s]).get(ROWS_KEY, 0.0) for s in stages}
    draft0 = scrape(addrs["draft"]) if "draft" in addrs else {}
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    profilers = start_profilers(pids, work / f"c{conc}", args.rate, 600) if args.profile else {}
    if profilers:
        time.sleep(1.0)  # attached
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    threads0 = {name: thread_cpu(pid) for name, pid in pids.items()}
    t0 = time.perf_counter()
    _, tokens, wall = asyncio.run(stream_all(dep.router_address, prompts, conc, kwargs))
    cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
    threads = {
        name: thread_split(pid, threads0[name], thread_cpu(pid)) for name, pid in pids.items()
    }
    profiles = stop_profilers(profilers)
    steps = scrape(addrs[last]).get(STEPS_KEY, 0.0) - before.get(STEPS_KEY, 0.0)
    feeds = scrape(addrs["stage0"]).get(FEEDS_KEY, 0.0) - feeds0
    rows = {s: scrape(addrs[s]).get(ROWS_KEY, 0.0) - rows0[s] for s in stages}
    draft1 = scrape(addrs["draft"]) if "draft" in addrs else {}
    forwards, draft_rows = (draft1.get(k, 0.0) - draft0.get(k, 0.0) for k in DRAFT_KEYS)
    emitted = sum(len(t) for t in tokens)
    opts = DecodeOptions(max_new_tokens=args.max_new_tokens, width=args.width)
    ref = closed_loop(
        LockstepEngine(local.pipeline, local.draft),
        [Ask(p, "specpipe", opts) for p in prompts],
        conc,
    )
    cell = {
        "concurrency": conc,
        "requests": n,
        "wall_s": round(wall, 2),
        "elapsed_s": round(time.perf_counter() - t0, 2),
        "steps": int(steps),
        "feeds": int(feeds),
        "emitted": emitted,
        "identical": sum(t == x.tokens for t, x in zip(tokens, ref.served, strict=True)),
        "load_average": round(os.getloadavg()[0], 2),
        "rows_per_feed": {s: round(r / feeds, 3) if feeds else None for s, r in rows.items()},
        "draft_forwards_per_feed": round(forwards / feeds, 3) if feeds else None,
        "draft_rows_per_forward": round(draft_rows / forwards, 2) if forwards else None,
        "processes": {},
    }
    for name in pids:
        row = {
            "cpu_s": round(cpu[name], 3),
            "cpu_ms_per_step": round(1e3 * cpu[name] / steps, 3) if steps else None,
            "cpu_ms_per_feed": round(1e3 * cpu[name] / feeds, 3) if feeds else None,
            "cpu_ms_per_token": round(1e3 * cpu[name] / emitted, 3) if emitted else None,
            "threads_ms_per_token": {
                k: round(1e3 * v / emitted, 3) if emitted else None
                for k, v in threads[name].items()
            },
        }
        if name in profiles:
            row["profile"] = summarize_profile(profiles[name])
        cell["processes"][name] = row
    return cell


def fmt_cell(c: dict) -> list[str]:
    lines = [
        f"{c['concurrency']} client(s): {c['requests']} requests, {c['steps']} steps "
        f"(last stage's rounds), {c.get('feeds')} feeds (first stage's), "
        f"{c['emitted']} tokens in {c['wall_s']} s, identical {c['identical']}/{c['requests']}, "
        f"load {c['load_average']}",
        "",
        "| process | CPU ms / step | CPU ms / feed | CPU ms / token | of which loop / busiest "
        "thread / rest | top subsystems (share of working samples) |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in c["processes"].items():
        prof = p.get("profile", {}).get("subsystems", {})
        top = ", ".join(f"{k} {v:.0%}" for k, v in list(prof.items())[:6]) or "-"
        split = " / ".join(str(v) for v in p.get("threads_ms_per_token", {}).values()) or "-"
        lines.append(
            f"| {name} | {p['cpu_ms_per_step']} | {p.get('cpu_ms_per_feed')} "
            f"| {p['cpu_ms_per_token']} | {split} | {top} |"
        )
    if rows := c.get("rows_per_feed"):
        lines += ["", "Rows computed per feed: " + ", ".join(f"{s} {r}" for s, r in rows.items())]
    if c.get("draft_forwards_per_feed") is not None:
        lines.append(
            f"Draft: {c['draft_forwards_per_feed']} batched forwards per feed, "
            f"{c['draft_rows_per_forward']} rows each"
        )
    return [*lines, ""]


def leaves_table(c: dict) -> list[str]:
    lines = [f"Top leaf functions, {c['concurrency']} client(s):", ""]
    for name, p in c["processes"].items():
        leaves = p.get("profile", {}).get("top_leaves", {})
        if leaves:
            lines.append(f"- {name}: " + ", ".join(f"{k} {v:.0%}" for k, v in leaves.items()))
    return [*lines, ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--concurrency", type=ints, default=[1, 8])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--stage-ms", type=float, default=20.0)
    ap.add_argument("--draft-ms", type=float, default=10.0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--wire", action="store_true", help="only a control message's CPU")
    ap.add_argument("--no-control-frames", action="store_true",
                    help="the router's feeds and prunes on the gRPC streams (A/B)")  # fmt: skip
    ap.add_argument("--no-relay-prunes", action="store_true",
                    help="the router's prunes to every stage, not relayed from stage 1 (A/B)")  # fmt: skip
    ap.add_argument("--idle", type=float, default=0.0, metavar="SECONDS",
                    help="only each process's CPU over SECONDS without a request")  # fmt: skip
    ap.add_argument("--label", default="", help="saved with the results (e.g. before/after)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.wire:
        costs = asyncio.run(wire())
        print("CPU per control message, both ends (us):", json.dumps(costs))
        return

    from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
    from specpipe.services.launcher import ServicesDeployment

    work = Path(tempfile.mkdtemp(prefix="bench-host-"))
    target = make_model(work, 8, args.hidden, 512)
    costs = synthetic_flat(args.stage_ms, args.draft_ms)
    cost_file = costs.save(work / "costs.json")
    local = build_local(target, args.stages, ORACLE_DRAFT)
    dep = ServicesDeployment(
        target, "oracle", args.stages, threads=1, emulate_costs=cost_file,
        log_dir=work / "logs", metrics=True,
        scheduling={**FIXED_TREE, "max_running": max(args.concurrency)},
        # an older checkout's launcher (a "before" run) has no control_frames
        **({"control_frames": False} if args.no_control_frames else {}),
        **({"relay_prunes": False} if args.no_relay_prunes else {}),
    )  # fmt: skip
    dep.start()
    cells = []
    try:
        if args.idle:
            print("CPU ms per second, idle:", json.dumps(idle_cpu(dep, args.idle)))
            return
        for conc in args.concurrency:
            (work / f"c{conc}").mkdir()
            cells.append(run_cell(args, dep, local, conc, work))
            log("\n".join(fmt_cell(cells[-1])))
    finally:
        dep.stop()
    results = {
        "label": args.label,
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cells": cells,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [f"{args.label or 'this build'}, {args.stage_ms:g} ms stages, S = {args.stages}", ""]
    for c in cells:
        lines += fmt_cell(c) + leaves_table(c)
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
