"""A stage's whole compute round, in process and cold (issue 34: a stage's CPU per step):
thread CPU microseconds per step of each part of a round, as a deployed stage's compute
thread runs it, where `bench_stage_prep.py` times the runtime's calls alone.

The middle stage (layers 2-3) of `bench_host.py`'s tiny Llama (8 layers, hidden 64,
float32), one request, `--steps` steps: each step its 4-row tree layer arrives as a frame
(`StageService._on_frame`, the event loop's part), then one round takes it
(`_collect`), prepares it (`_prepare`: the prunes, the finite check, `prepare_step`),
launches it (`_launch`: the forward, through a pacer as `--emulate-costs` runs it, of no
modelled time) and hands it off (`_hand_off`: `_complete`, the frames made by
`_outgoing`, sent by `_send_now` over a TCP connection to a next hop in this process);
then a prune drops the layer, applied by the next round. Before each step the CPU's
caches are evicted (a pass over 16 MiB; `--warm`: not), as a stage whose steps come
20 ms apart on a shared machine finds them. Each wrapped function's CPU
(`time.thread_time`, inclusive: a part's callees are in it too) per step.

    python benchmarks/bench_stage_round.py               # ~10 s
    python benchmarks/bench_stage_round.py --warm --steps 500
    python benchmarks/bench_stage_round.py --warm --gap-ms 20 [--spin]

`--gap-ms`: the pause after each step (default 2 ms, the next hop's read); a deployed
stage at one client pauses 10-20 ms, after which the same step costs about 1.3-1.9x
(benchmarks/README.md, "Session 47: the stage's and the draft's step"); `--spin` spends
the pause beyond 2 ms spinning rather than idle.

Compare runs made back to back (a loaded machine moves CPU time too): e.g. this script
run by another checkout (`cd /work/main && .venv/bin/python <this file>`). Writes
results/stage-round/<label or "run">.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_serve import make_model  # noqa: E402
from bench_stage_host import Timers  # noqa: E402

OUT = HERE / "results" / "stage-round"
WIDTH = 64
COLD_BYTES = 16 << 20


def timers() -> Timers:
    from specpipe.common.perf import emulate
    from specpipe.common.runtime import kv_cache, stage
    from specpipe.services import compute_round
    from specpipe.services.stage_service import StageService

    t = Timers(time.thread_time)
    rounds = compute_round.ComputeRounds
    for name in ("_collect", "_prepare", "_check_finite", "_launch", "_hand_off", "_complete",
                 "_outputs", "_outgoing", "_send_now"):  # fmt: skip
        t.wrap(rounds, name)
    for name in ("prune_many", "prepare_step", "run_step"):
        t.wrap(stage.StageRuntime, name)
    t.wrap(stage, "pack")
    t.wrap(kv_cache.TreeKVCache, "prune_rows")
    t.wrap(kv_cache.TreeKVCache, "append_nodes")
    t.wrap(compute_round, "encode")
    t.wrap(emulate, "batch_shape")
    t.wrap(StageService, "_on_frame")
    return t


async def steps(
    model_dir: Path,
    n: int,
    warm_up: int,
    cold: bool,
    t: Timers,
    gap: float = 0.002,
    spin: bool = False,
) -> float:
    """Thread CPU seconds of `n` steps (after `warm_up`), frame to frame sent."""
    from specpipe.common.model.loading import load_stage
    from specpipe.common.model.partition import LayerRange
    from specpipe.common.perf.emulate import EmulatedCosts, Pacer
    from specpipe.common.runtime.loader import LoadedModel
    from specpipe.common.runtime.stage import StageRuntime
    from specpipe.common.spec.messages import Activation, Prune
    from specpipe.services.stage_service import StageService
    from specpipe.services.transport import Frame, encode, make_transport
    from specpipe.v1 import stage_pb2

    model = load_stage(model_dir, LayerRange(2, 4, 8), torch.float32)
    pacer = Pacer(EmulatedCosts.flat(0.0).stage(), name="stage")
    svc = StageService(LoadedModel(StageRuntime(model), "m", "h", 256, ()), batch_wait=0,
                       pacer=pacer)  # fmt: skip
    rx = make_transport("tcp", lambda f: None)
    hop = await rx.start()
    await svc.transport.start()
    rounds = svc.rounds
    await svc.Open(stage_pb2.OpenStageRequest(request_id="r", capacity=4096, next_hop=hop), None)
    prompt = Activation("r", torch.arange(32), committed=True, hidden=torch.randn(32, WIDTH))
    svc._on_frame(Frame(*encode(prompt, 0)))
    rounds.compute(rounds._collect())
    await svc.transport.send_frame(hop, *encode(prompt, 0))  # the connection, opened
    junk = np.ones(COLD_BYTES // 8)
    posted: list = []
    empty = torch.tensor([], dtype=torch.long)
    t_ = torch.tensor
    cpu = 0.0
    try:
        for s in range(n + warm_up):
            if s == warm_up:
                t.seconds.clear()
                t.calls.clear()
            seq, node = s + 1, 1000 + 4 * s
            act = Activation("r", t_([32 + seq, 33 + seq, 33 + seq, 34 + seq]),
                             node_ids=torch.arange(node, node + 4),
                             parent_ids=t_([-1, node, node, node + 1]),
                             hidden=torch.randn(4, WIDTH))  # fmt: skip
            frame = Frame(*encode(act, seq, seq - 1))
            if cold:
                junk += 1.0
            start = time.thread_time()
            svc._on_frame(frame)
            r = rounds._prepare(rounds._collect())
            rounds._launch(r)
            rounds._hand_off(r, posted.append)
            if s >= warm_up:
                cpu += time.thread_time() - start
            if posted:
                raise RuntimeError(f"a round was left for the event loop: {posted[0]}")
            with rounds.inbox:  # the layer dropped, applied by the next round
                svc._requests["r"].order.add_prune(seq, Prune(empty, empty, node + 3))
            await asyncio.sleep(0.002)  # the next hop reads
            if gap > 0.002:  # the rest of the step's pause: idle, or the core kept busy
                if spin:
                    until = time.perf_counter() + gap - 0.002
                    while time.perf_counter() < until:
                        pass
                else:
                    await asyncio.sleep(gap - 0.002)
    finally:
        await svc.stop()
        await rx.close()
    return cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warm", action="store_true", help="caches not evicted between steps")
    ap.add_argument("--gap-ms", type=float, default=2.0,
                    help="the pause between steps (deployed at 1 client: 10-20 ms)")  # fmt: skip
    ap.add_argument("--spin", action="store_true",
                    help="the pause beyond 2 ms spent spinning, not idle")  # fmt: skip
    ap.add_argument("--label", default="")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)  # as a deployed stage (`threads=1`)
    model_dir = make_model(Path(tempfile.mkdtemp()), 8, WIDTH, 512)
    t = timers()
    cpu = asyncio.run(
        steps(model_dir, args.steps, 20, not args.warm, t, args.gap_ms / 1e3, args.spin)
    )
    parts = {k: round(1e6 * v / args.steps, 1) for k, v in t.seconds.most_common()}
    cell = {"label": args.label, "cold": not args.warm, "steps": args.steps, "gap_ms": args.gap_ms,
            "step_us": round(1e6 * cpu / args.steps, 1), "parts_us": parts,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    print(f"{args.label or 'this build'}, {'warm' if args.warm else 'cold'}: a step "
          f"{cell['step_us']} us thread CPU (frame taken, round, frames sent)")  # fmt: skip
    for k, v in parts.items():
        print(f"  {k:16s} {v:8.1f} us  ({t.calls[k] / args.steps:.2f} calls per step)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.label or 'run'}.json").write_text(json.dumps(cell, indent=1))


if __name__ == "__main__":
    main()
