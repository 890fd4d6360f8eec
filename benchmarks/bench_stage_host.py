"""A stage's host work per step, in one process (issue 34 point 3): CPU microseconds per
step of the functions a step runs, where `bench_host.py` measures whole processes.

A middle stage of a tiny Llama (5 layers, hidden 48; layers 1-2 here), no gRPC and no
peers: each step every request's 4-row tree layer arrives as a frame (`_on_frame`:
decode, checks, queue), one round computes it (`_collect` and `compute`: the prunes,
the finite check, the cache rows and attention metadata, the forward), and a prune of
the layer follows, as the router's prunes come apart from the activations: applied by
the next layer's round, as a stage does when no turn waits for it, or (`--prune-rounds`,
the stage before it deferred them) in a round of its own. Each function's CPU time
(`time.process_time`, this thread) is summed over the steps and divided by them:
microseconds per step, all its rounds (a function called once per request counts every
call); `step` is the CPU of a step's rounds together. Besides: one secure TCP data-plane frame of 4
rows sent and taken on loopback, both ends in this process (CPU per frame, ping-pong).

    python benchmarks/bench_stage_host.py            # 1 and 8 requests, ~30 s
    python benchmarks/bench_stage_host.py --steps 100
    python benchmarks/bench_stage_host.py --prune-rounds   # each prune in a round of its own

Writes results/stage-host/results.json. Per call, and CPU time: a shared machine moves
it less than wall time, but compare runs made back to back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange
from specpipe.common.model.synthetic import save_random_model
from specpipe.common.runtime import kv_cache, stage
from specpipe.common.runtime.loader import LoadedModel
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation, Prune
from specpipe.services import compute_round
from specpipe.services.stage_service import StageService
from specpipe.services.transport import Frame, encode, make_transport
from specpipe.services.transport.auth import FrameAuth
from specpipe.v1 import stage_pb2

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "stage-host"
WIDTH = 48  # the tiny Llama's hidden size
FEED = 4  # rows of a step's tree layer


class Timers:
    """CPU seconds and calls of the functions wrapped (`wrap`), by `clock` (the process's
    CPU time; `time.thread_time`: the calling thread's)."""

    def __init__(self, clock=time.process_time) -> None:
        self.clock = clock
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()

    def wrap(self, owner, name: str, label: str | None = None) -> None:
        fn, label = getattr(owner, name), label or name

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += self.clock() - start
                self.calls[label] += 1

        setattr(owner, name, timed)

    def per_step_us(self, steps: int) -> dict[str, float]:
        return {k: round(1e6 * v / steps, 1) for k, v in self.seconds.items()}


def timers() -> Timers:
    t = Timers()
    t.wrap(stage.StageRuntime, "prune_many")
    t.wrap(stage.StageRuntime, "prepare_step")
    t.wrap(stage, "pack")  # as the runtime calls it
    t.wrap(kv_cache.TreeKVCache, "append_nodes")
    t.wrap(stage.StageRuntime, "run_step")
    t.wrap(compute_round.ComputeRounds, "_check_finite")
    t.wrap(compute_round.ComputeRounds, "_complete")
    return t


def _layer(rid: str, seq: int, node: int) -> Frame:
    """A request's tree layer of FEED rows (a root and its children), as a frame."""
    t = torch.tensor
    act = Activation(
        rid,
        t([32, 33, 33, 34]),
        node_ids=torch.arange(node, node + FEED),
        parent_ids=t([-1, node, node, node + 1]),
        hidden=torch.randn(FEED, WIDTH),
    )
    return Frame(*encode(act, seq, seq - 1))


async def stage_steps(
    model_dir: Path, requests: int, steps: int, t: Timers, prune_rounds: bool = False
) -> dict:
    model = load_stage(model_dir, LayerRange(1, 3, 5), torch.float32)
    svc = StageService(LoadedModel(StageRuntime(model), "m", "h", 256, ()))
    rounds = svc.rounds
    rids = [f"r{i}" for i in range(requests)]
    try:
        for rid in rids:
            req = stage_pb2.OpenStageRequest(
                request_id=rid, capacity=4096, next_hop="tcp://127.0.0.1:9"
            )
            await svc.Open(req, None)
            prompt = Activation(rid, torch.arange(32), committed=True,
                                hidden=torch.randn(32, WIDTH))  # fmt: skip
            svc._on_frame(Frame(*encode(prompt, 0)))
        rounds.compute(rounds._collect())
        on_frame = compute = pruning = 0.0
        for s in range(steps):
            seq, node = s + 1, 1000 + FEED * s
            frames = [_layer(rid, seq, node) for rid in rids]
            start = time.process_time()
            for f in frames:
                svc._on_frame(f)
            mid = time.process_time()
            work = rounds._collect()
            rounds.compute(work)
            compute += time.process_time() - mid
            on_frame += mid - start
            if any(w.error is not None for w in work) or len(work) != requests:
                raise RuntimeError(f"a round failed: {[w.error for w in work]}")
            empty = torch.tensor([], dtype=torch.long)
            for rid in rids:  # the layer dropped: the next one starts a tree anew
                with rounds.inbox:
                    prune = Prune(empty, empty, node + FEED - 1)
                    svc._requests[rid].order.add_prune(seq, prune)
            if prune_rounds:
                start = time.process_time()
                rounds.compute(rounds._collect(turns=False))
                pruning += time.process_time() - start
    finally:
        await svc.stop()
    return {
        "_on_frame": round(1e6 * on_frame / (steps * requests), 1),
        # the layer's round, its forward (and with the prunes deferred, the prunes) included
        "round": round(1e6 * compute / steps, 1),
        "step": round(1e6 * (compute + pruning) / steps, 1),  # with the prunes' own rounds
    }


async def delivery(model_dir: Path, steps: int) -> float:
    """CPU us per round of a stage's delivery on its event loop (`_delivered`: the round's
    frames made and sent to its next hop), one request of one 4-row layer a round, and
    of the frame's receipt by that hop (a TCP transport in this process, no auth)."""
    got = asyncio.Event()
    rx = make_transport("tcp", lambda f: got.set())
    hop = await rx.start()
    model = load_stage(model_dir, LayerRange(1, 3, 5), torch.float32)
    svc = StageService(LoadedModel(StageRuntime(model), "m", "h", 256, ()))
    rounds = svc.rounds
    req = stage_pb2.OpenStageRequest(request_id="r", capacity=4096, next_hop=hop)
    await svc.Open(req, None)
    prompt = Activation("r", torch.arange(32), committed=True, hidden=torch.randn(32, WIDTH))
    svc._on_frame(Frame(*encode(prompt, 0)))
    rounds.compute(rounds._collect())
    empty = torch.tensor([], dtype=torch.long)
    cpu = 0.0
    try:
        for s in range(steps + 20):  # 20 to warm up
            seq, node = s + 1, 1000 + FEED * s
            svc._on_frame(_layer("r", seq, node))
            work = rounds._collect()
            rounds.compute(work)
            got.clear()
            start = time.process_time()
            await rounds._delivered(work, None)
            await got.wait()
            if s >= 20:
                cpu += time.process_time() - start
            with rounds.inbox:  # the layer dropped, applied by the next round
                svc._requests["r"].order.add_prune(seq, Prune(empty, empty, node + FEED - 1))
    finally:
        await svc.stop()
        await rx.close()
    return round(1e6 * cpu / steps, 1)


async def threaded(model_dir: Path, requests: int, steps: int, direct: bool) -> float:
    """CPU us per step of the whole process (every thread) with the stage serving as it
    does (its compute thread, `run_forever`): each step a previous stage's batch frame of
    every request's 4-row layer arrives over TCP, the round computes and sends its
    outputs to a next hop (here), which takes them. `direct`: the compute thread sends
    them itself where it can (`Transport.send_now`, issue 34 point 4); otherwise through
    the event loop, as before session 44. The sender and receiver's CPU is counted too:
    compare the two."""
    got, count = asyncio.Event(), [0]

    def took(frame: Frame) -> None:
        count[0] += 1
        if count[0] == requests:
            got.set()

    rx = make_transport("tcp", took)
    tx = make_transport("tcp", lambda f: None)
    hop = await rx.start()
    model = load_stage(model_dir, LayerRange(1, 3, 5), torch.float32)
    svc = StageService(LoadedModel(StageRuntime(model), "m", "h", 256, ()), batch_wait=0)
    if not direct:
        svc.transport.send_now = lambda *a, **k: False  # type: ignore[method-assign]
    addr = await svc.transport.start()
    rids = [f"r{i}" for i in range(requests)]
    for rid in rids:
        req = stage_pb2.OpenStageRequest(request_id=rid, capacity=4096, next_hop=hop)
        await svc.Open(req, None)
    task = asyncio.create_task(svc.rounds.run_forever())
    empty = torch.tensor([], dtype=torch.long)

    async def step(parts: list) -> None:
        got.clear()
        count[0] = 0
        await tx.send_many(addr, parts)
        await asyncio.wait_for(got.wait(), 30)

    cpu = 0.0
    try:
        prompts = [Activation(rid, torch.arange(32), committed=True,
                              hidden=torch.randn(32, WIDTH)) for rid in rids]  # fmt: skip
        await step([encode(a, 0) for a in prompts])
        for s in range(steps + 20):  # 20 to warm up
            seq, node = s + 1, 1000 + FEED * s
            parts = [(_layer(rid, seq, node).header, _layer(rid, seq, node).payload)
                     for rid in rids]  # fmt: skip
            start = time.process_time()
            await step(parts)
            if s >= 20:
                cpu += time.process_time() - start
            with svc.rounds.inbox:  # the layer dropped, applied by the next round
                for rid in rids:
                    prune = Prune(empty, empty, node + FEED - 1)
                    svc._requests[rid].order.add_prune(seq, prune)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await svc.stop()
        await tx.close()
        await rx.close()
    return round(1e6 * cpu / steps, 1)


async def tcp_frame(rounds: int) -> float:
    """CPU us per 4-row secure frame, sent and taken (both ends here)."""
    got = asyncio.Event()
    auth = FrameAuth(b"k" * 32)
    rx = make_transport("tcp", lambda f: got.set(), auth=auth)
    tx = make_transport("tcp", lambda f: None, auth=auth)
    addr = await rx.start()
    await tx.start()
    t = torch.tensor
    act = Activation("a", t([5, 6, 6, 7]), node_ids=t([0, 1, 2, 3]),
                     parent_ids=t([-1, 0, 0, 1]), hidden=torch.randn(FEED, 64))  # fmt: skip
    try:
        for n in (100, rounds):  # warm-up, then measured
            start = time.process_time()
            for i in range(n):
                got.clear()
                await tx.send(addr, act, seq=i)
                await got.wait()
            cpu = time.process_time() - start
    finally:
        await tx.close()
        await rx.close()
    return round(1e6 * cpu / rounds, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--frames", type=int, default=3000)
    ap.add_argument(
        "--prune-rounds",
        action="store_true",
        help="each step's prunes in a round of their own (as before deferral)",
    )
    ap.add_argument("--pairs", type=int, default=3, help="served steps: loop/thread pairs")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = save_random_model(Path(tempfile.mkdtemp()), "llama", layers=5, seed=0)
    t = timers()
    cells = []
    for n in args.requests:
        t.seconds.clear()
        t.calls.clear()
        cell = asyncio.run(stage_steps(model_dir, n, args.steps, t, args.prune_rounds))
        cell = {"requests": n, **cell, **t.per_step_us(args.steps)}
        cells.append(cell)
        print(f"{n} request(s), CPU us per step (_on_frame: per frame):", json.dumps(cell),
              flush=True)  # fmt: skip
    frame = asyncio.run(tcp_frame(args.frames))
    print(f"tcp frame (4 rows, secure, both ends): {frame} us CPU", flush=True)
    delivered = asyncio.run(delivery(model_dir, args.frames))
    print(f"a round's delivery and receipt (1 request, tcp): {delivered} us CPU", flush=True)
    served: dict[str, list[float]] = {}
    for _ in range(args.pairs):  # alternated: the machine's load moves both alike
        for n in args.requests:
            for direct in (False, True):
                us = asyncio.run(threaded(model_dir, n, args.steps, direct))
                served.setdefault(f"{n} {'thread sends' if direct else 'loop sends'}", []).append(
                    us
                )
    for key, values in served.items():
        print(f"served step, {key} (process CPU us, all threads, both ends): {values}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"label": args.label, "prune_rounds": args.prune_rounds, "cells": cells,
               "tcp_frame_us": frame, "delivery_us": delivered, "served_us": served,
               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
