"""The router's event loop per pipeline step (issue 34, point 3): how many loop turns,
callbacks and socket writes a step costs the router, and the CPU time of each kind of
callback.

bench_host.py's emulated deployment (a tiny random Llama that is its own draft, S stages
paced to `--stage-ms`, the draft to `--draft-ms`, greedy, W = 4, closed loop at each of
`--concurrency` clients) with the router under a census (`loop_census/sitecustomize.py`,
on the router's PYTHONPATH only): every callback the loop runs is counted and its thread
CPU time summed by kind (a task's coroutine, a reader's `_read_ready`, a send round), and
so are the loop's turns and socket writes. Per pipeline step (the first stage's feeds:
one per request and step) and per emitted token it prints those counts, the router's
CPU (user + system, all threads, from /proc), the main thread's CPU outside callbacks
(the loop's own work: selecting, scheduling) and the costliest kinds. The census costs a
thread-time read per callback (about a microsecond), so its CPU figures run a few
percent above bench_host.py's; compare counts and shares, and CPU only between runs of
this script. `--wrap` adds named functions' calls and inclusive CPU per step (each call
then costs two more thread-time reads).

    python benchmarks/bench_router_loop.py                 # 1 and 8 clients, ~1 minute
    python benchmarks/bench_router_loop.py --concurrency 8 --out results/router-loop-x
    python benchmarks/bench_router_loop.py --process draft     # the draft's loop instead
    python benchmarks/bench_router_loop.py --process stage1    # a middle stage's
    python benchmarks/bench_router_loop.py --wrap \
        specpipe.common.spec.specpipe:SpecPipeController.on_verified

Writes results.json and results.md under `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_emulated import FIXED_TREE, cpu_seconds, stream_all, synthetic_flat  # noqa: E402
from bench_host import FEEDS_KEY  # noqa: E402
from bench_serve import make_model, scrape  # noqa: E402

CENSUS = HERE / "loop_census"


def run_cell(dep, conc: int, args, census: Path) -> dict:
    from specpipe.services.client.loadgen import load_dataset

    n = max(args.min_requests, conc * args.requests_per_client)
    prompts = [list(p.ids) for p in load_dataset(f"random:{args.prompt_len}", n, 511, conc)]
    kwargs = dict(mode="specpipe", max_new_tokens=args.max_new_tokens, ignore_eos=True,
                  width=args.width)  # fmt: skip
    asyncio.run(stream_all(dep.router_address, prompts[:conc], conc, kwargs))  # warm
    pid = dep.children[args.process].proc.pid
    stage0 = dep.metrics_addresses()["stage0"]
    census.unlink(missing_ok=True)
    os.kill(pid, signal.SIGRTMIN)
    time.sleep(0.2)
    feeds0, cpu0 = scrape(stage0).get(FEEDS_KEY, 0.0), cpu_seconds(pid)
    _, tokens, wall = asyncio.run(stream_all(dep.router_address, prompts, conc, kwargs))
    cpu = cpu_seconds(pid) - cpu0
    feeds = scrape(stage0).get(FEEDS_KEY, 0.0) - feeds0
    os.kill(pid, signal.SIGRTMIN + 1)
    for _ in range(100):
        if census.is_file() and census.stat().st_size:
            break
        time.sleep(0.05)
    c = json.loads(census.read_text())
    emitted = sum(len(t) for t in tokens)
    in_callbacks = sum(k["cpu_s"] for k in c["callbacks"].values())
    per = {"step": feeds, "token": emitted}
    kinds = sorted(c["callbacks"].items(), key=lambda kv: -kv[1]["cpu_s"])
    return {
        "concurrency": conc,
        "requests": n,
        "wall_s": round(wall, 2),
        "feeds": int(feeds),
        "emitted": emitted,
        "load_average": round(os.getloadavg()[0], 2),
        "per": {
            unit: {
                "router_cpu_ms": round(1e3 * cpu / d, 3),
                "callbacks_cpu_ms": round(1e3 * in_callbacks / d, 3),
                "loop_outside_callbacks_ms": round(
                    1e3 * (c["main_thread_cpu_s"] - in_callbacks) / d, 3
                ),
                "other_threads_ms": round(1e3 * (cpu - c["main_thread_cpu_s"]) / d, 3),
                "gc_ms": round(1e3 * c["gc"]["seconds"] / d, 4),
                "loop_turns": round(c["counts"].get("loop turns", 0) / d, 2),
                "callbacks": round(sum(k["count"] for k in c["callbacks"].values()) / d, 2),
                "socket_writes": round(c["counts"].get("socket writes", 0) / d, 2),
            }
            for unit, d in per.items()
            if d
        },
        "kinds": {
            name: {
                "per_step": round(k["count"] / feeds, 2) if feeds else None,
                "cpu_ms_per_step": round(1e3 * k["cpu_s"] / feeds, 3) if feeds else None,
                "us_each": round(1e6 * k["cpu_s"] / max(k["count"], 1), 1),
            }
            for name, k in kinds[: args.top]
        },
        "functions": {
            name: {
                "per_step": round(k["count"] / feeds, 2) if feeds else None,
                "cpu_ms_per_step": round(1e3 * k["cpu_s"] / feeds, 3) if feeds else None,
                "us_each": round(1e6 * k["cpu_s"] / max(k["count"], 1), 1),
            }
            for name, k in sorted(c["functions"].items(), key=lambda kv: -kv[1]["cpu_s"])
        },
    }


def fmt_cell(c: dict) -> list[str]:
    lines = [
        f"{c['concurrency']} client(s): {c['requests']} requests, {c['feeds']} feeds, "
        f"{c['emitted']} tokens in {c['wall_s']} s, load {c['load_average']}",
        "",
        "| per | router CPU ms | in callbacks | loop outside callbacks | other threads | GC "
        "| loop turns | callbacks | socket writes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for unit, p in c["per"].items():
        lines.append(
            f"| {unit} | {p['router_cpu_ms']} | {p['callbacks_cpu_ms']} "
            f"| {p['loop_outside_callbacks_ms']} | {p['other_threads_ms']} | {p['gc_ms']} "
            f"| {p['loop_turns']} | {p['callbacks']} | {p['socket_writes']} |"
        )
    lines += ["", "| callback kind | per step | CPU ms per step | us each |", "|---|---|---|---|"]
    for name, k in c["kinds"].items():
        lines.append(f"| {name} | {k['per_step']} | {k['cpu_ms_per_step']} | {k['us_each']} |")
    if c["functions"]:
        lines += ["", "| function (inclusive) | calls per step | CPU ms per step | us each |",
                  "|---|---|---|---|"]  # fmt: skip
        for name, k in c["functions"].items():
            lines.append(f"| {name} | {k['per_step']} | {k['cpu_ms_per_step']} | {k['us_each']} |")
    return [*lines, ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--stage-ms", type=float, default=20.0)
    ap.add_argument("--draft-ms", type=float, default=10.0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--top", type=int, default=10, help="callback kinds listed")
    ap.add_argument("--wrap", nargs="*", default=[], metavar="MODULE:QUALNAME",
                    help="functions to count too (inclusive CPU)")  # fmt: skip
    ap.add_argument(
        "--process",
        default="router",
        choices=["router", "draft", "stage1"],
        help="whose event loop is counted (stage1: a middle stage's)",
    )
    ap.add_argument("--label", default="")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "router-loop")
    args = ap.parse_args()

    from specpipe.services.launcher import ServicesDeployment

    work = Path(tempfile.mkdtemp(prefix="bench-router-loop-"))
    census = work / "census.json"
    # the deployment's children inherit this environment; only `--process` takes part
    os.environ["SPECPIPE_LOOP_CENSUS"] = str(census)
    os.environ["SPECPIPE_LOOP_CENSUS_WRAP"] = " ".join(args.wrap)
    # a stage's command is "stage" (every stage takes the census; only `--process` is read)
    os.environ["SPECPIPE_LOOP_CENSUS_PROCESS"] = args.process.rstrip("0123456789")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(CENSUS), os.environ.get("PYTHONPATH", "")) if p
    )
    target = make_model(work, 8, args.hidden, 512)
    cost_file = synthetic_flat(args.stage_ms, args.draft_ms).save(work / "costs.json")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    dep = ServicesDeployment(
        target, "oracle", args.stages, threads=1, emulate_costs=cost_file,
        log_dir=work / "logs", metrics=True,
        scheduling={**FIXED_TREE, "max_running": max(concurrency)},
    )  # fmt: skip
    dep.start()
    cells = []
    try:
        for conc in concurrency:
            cells.append(run_cell(dep, conc, args, census))
            print("\n".join(fmt_cell(cells[-1])), file=sys.stderr, flush=True)
    finally:
        dep.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"label": args.label, "args": {k: str(v) for k, v in vars(args).items()},
               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cells": cells}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [f"{args.label or 'this build'}: the {args.process}'s event loop, {args.stage_ms:g} ms "
             f"stages, S = {args.stages}", ""]  # fmt: skip
    for c in cells:
        lines += fmt_cell(c)
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
