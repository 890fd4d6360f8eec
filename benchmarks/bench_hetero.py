"""Heterogeneous nodes, emulated (issue 26, docs/planning.md): the planned split against
the even and parameter-balanced splits on the same nodes, through the real services.

Every stage of `specpipe up` is an emulated device (docs/architecture.md, "5. The
request controller and its executors", "Emulated devices") paced to its node kind's cost
for its layers: one `--emulate-costs` file per split, stage k's curve its node's speed
times its layer count plus the head on the last stage
(`common/perf/profile.emulated_costs`). Costs are flat (accelerator-like: any rows cost
one row's time) or, with `--flat-rows R`, flat up to R rows a forward and linear beyond.
The model is a random 24-layer Llama (hidden 64) whose real stage forwards take a few
milliseconds against the modelled 75-180 ms, so the pacing holds while the machine is
not overloaded (overruns are counted from the services' logs; the draft, the whole
target, is the one that overruns).

Cases:
- `fast-slow`: 2 fast and 2 slow nodes, slow = 2.5x a fast node's time per layer and
  head; memory does not bind.
- `gpu-cpu`: 2 accelerator nodes whose memory holds 8 layers with the KV cache of 8
  requests of 512 tokens, and 2 CPU nodes 4x slower per layer with memory to spare: the
  plan is bound by memory (the speed-only plan, which would give the accelerators more
  layers, does not fit; it is reported, not run).

For each split: `specpipe up --layers ... --emulate-costs FILE --draft oracle` (the
draft paced flat at --draft-ms), then closed-loop clients (1 and 8) in specpipe
(`--growth`, eager by default) and pp mode: time between tokens, tokens per step, time
per step (TBT x tokens per step) and throughput, beside what the plan expects: a step
costs the slowest stage (specpipe), a token crosses every stage (pp: the sum).

    python benchmarks/bench_hetero.py                     # both cases, ~10 minutes here
    python benchmarks/bench_hetero.py --cases fast-slow --modes specpipe --clients 1 \
        --flat-rows 4 --out benchmarks/results/hetero-rows4

Writes OUT/results.json and results.md (default OUT: results/hetero).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_emulated import emulation_report, stream_all  # noqa: E402
from bench_serve import make_model  # noqa: E402
from specpipe.common.model.config import ModelConfig  # noqa: E402
from specpipe.common.model.partition import plan_stages  # noqa: E402
from specpipe.common.perf.planner import (  # noqa: E402
    GIB,
    ModelSizes,
    NodeKind,
    Plan,
    PlanError,
    assign_kinds,
    plan_split,
)
from specpipe.common.perf.profile import NodeProfile, emulated_costs, flat_cost  # noqa: E402

OUT = HERE / "results" / "hetero"
LAYERS = 24


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# -- the cases -------------------------------------------------------------------------------
def fast_slow(args, sizes: ModelSizes, kv_tokens: int) -> list[tuple[NodeProfile, int]]:
    a = args.layer_ms / 1e3
    fast = NodeProfile.flat("fast", a, args.head_layers * a, memory_gib=64)
    slow = NodeProfile.flat("slow", 2.5 * a, 2.5 * args.head_layers * a, memory_gib=64)
    return [(fast, 2), (slow, 2)]


def gpu_cpu(args, sizes: ModelSizes, kv_tokens: int) -> list[tuple[NodeProfile, int]]:
    """Accelerators that hold 8 layers (either end's embedding or head included) with
    their KV cache, and no more; CPU nodes 4x slower per layer, memory to spare."""
    a = 0.75 * args.layer_ms / 1e3
    fits = sizes.stage_bytes(8, True, True, kv_tokens) + sizes.layer_bytes // 2
    gpu = NodeProfile.flat("gpu", a, args.head_layers * a, memory_gib=fits / GIB)
    cpu = NodeProfile.flat("cpu", 4 * a, 4 * args.head_layers * a, memory_gib=64)
    return [(gpu, 2), (cpu, 2)]


CASES = {"fast-slow": fast_slow, "gpu-cpu": gpu_cpu}


def rows_bound(profile: NodeProfile, flat_rows: int) -> NodeProfile:
    """The profile's flat costs up to `flat_rows` rows a forward, linear in rows beyond
    (2x at twice the rows): a forward that merges two steps' tree layers costs two steps,
    as the plan's one layer per stage per step assumes."""
    from dataclasses import replace

    from specpipe.common.perf.cost_model import CostCurve
    from specpipe.common.perf.emulate import ForwardCost

    rows = sorted({1, flat_rows, 2 * flat_rows})

    def bound(cost: ForwardCost) -> ForwardCost:
        sec = cost(1, 0)
        curve = CostCurve(rows, [sec * max(1.0, r / flat_rows) for r in rows])
        return ForwardCost((0,), (curve,))

    parts = {k: bound(getattr(profile, k)) for k in ("layer", "stage", "embed", "head")}
    return replace(profile, **parts)


def kinds_of(profiles, rows: int, context: int) -> list[NodeKind]:
    return [NodeKind(p.name, n, p.at(rows, context)) for p, n in profiles]


def splits_of(args, cfg, sizes, profiles, kv_tokens) -> tuple[dict[str, Plan], dict]:
    """The planned split and the even and parameter-balanced ones on the same nodes (the
    best kind for each of their stages), and what the plan ignoring memory would be."""
    kinds = kinds_of(profiles, args.rows, args.context)
    plan = plan_split(sizes, kinds, kv_tokens)
    out, notes = {"planned": plan}, {}
    for split in ("even", "balanced"):
        ranges = plan_stages(cfg, len(plan.stages), split)
        if split == "balanced" and ranges == out["even"].ranges:
            notes["balanced"] = "the same ranges as even (the LM head is small here)"
            continue
        try:
            out[split] = assign_kinds(sizes, kinds, kv_tokens, ranges)
        except PlanError as e:
            notes[split] = f"does not fit: {e}"
    unbound = [NodeKind(k.name, k.count, _roomy(k.speed)) for k in kinds]
    free = plan_split(sizes, unbound, kv_tokens)
    if free.ranges != plan.ranges:
        memory = {p.name: p.memory_bytes for p, _ in profiles}
        over = [
            f"{s.node} {s.layers_text} needs {s.memory_bytes / 2**20:.1f} MiB of "
            f"{memory[s.node] / 2**20:.1f}"
            for s in free.stages
            if s.memory_bytes > memory[s.node]
        ]
        notes["speed_only"] = {
            "plan": describe(free),
            "step_ms": round(1e3 * free.step_seconds, 2),
            "over_memory": over,
        }
    return out, notes


def _roomy(speed):
    from dataclasses import replace

    return replace(speed, memory_bytes=1 << 60)


def describe(plan: Plan) -> str:
    return " ".join(f"{s.node}:{s.layers_text}" for s in plan.stages)


# -- one split through the services ----------------------------------------------------------
def start_up(target: Path, plan: Plan, cost_file: Path, log_dir: Path, args):
    """`specpipe up` as its own process; its router's address once it serves."""
    cmd = [sys.executable, "-m", "specpipe.cli", "up", "--target", str(target)]
    cmd += ["--draft", "oracle", "--stages", str(len(plan.stages))]
    cmd += ["--layers", ",".join(s.layers_text for s in plan.stages)]
    cmd += ["--emulate-costs", str(cost_file), "--threads", "1", "--log-dir", str(log_dir)]
    cmd += ["--router-port", "0", "--drain-seconds", "5", "--no-metrics"]
    if (
        "--insecure"
        in subprocess.run(
            [sys.executable, "-m", "specpipe.cli", "up", "--help"], capture_output=True, text=True
        ).stdout
    ):
        cmd.append("--insecure")
    log(" ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith("router: "):
            return proc, line.split("router: ", 1)[1].strip()
    proc.wait()
    raise RuntimeError(f"specpipe up exited with {proc.returncode} before serving")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def expected(plan: Plan, mode: str, clients: int, draft_s: float, tps: float) -> dict[str, float]:
    """The plan's expected step, TBT and throughput at the tokens per step measured (`tps`):
    specpipe, a step costs the slowest stage (or the draft, if slower); pp, a token
    crosses every stage, so its TBT is their sum."""
    step = max(plan.step_seconds, draft_s)
    if mode == "pp":
        tbt = sum(s.step_seconds for s in plan.stages)
        return {"tbt_ms": 1e3 * tbt, "tokens_per_s": clients / tbt}
    return {"step_ms": 1e3 * step, "tbt_ms": 1e3 * step / tps, "tokens_per_s": clients * tps / step}


def run_split(args, target: Path, name: str, plan: Plan, profiles, work: Path) -> list[dict]:
    from specpipe.services.client.loadgen import load_dataset, summarize

    by_name = {p.name: p for p, _ in profiles}
    draft_s = args.draft_ms / 1e3
    costs = emulated_costs(
        [(by_name[s.node], s.layers) for s in plan.stages], draft=flat_cost(draft_s)
    )
    cost_file = costs.save(work / f"{name}.costs.json")
    log_dir = work / f"{name}-logs"
    proc, address = start_up(target, plan, cost_file, log_dir, args)
    cells = []
    try:
        for mode in args.modes:
            for clients in args.clients:
                tokens = args.max_new_tokens if mode == "specpipe" else args.pp_new_tokens
                n = max(args.min_requests, clients * args.requests_per_client)
                prompts = [
                    list(p.ids)
                    for p in load_dataset(f"random:{args.prompt_len}", n, args.vocab - 1, clients)
                ]
                kwargs = dict(mode=mode, max_new_tokens=tokens, ignore_eos=True)
                if mode == "specpipe":
                    kwargs.update(width=args.width, growth=args.growth)
                results, _, wall = asyncio.run(stream_all(address, prompts, clients, kwargs))
                s = summarize(results, wall)
                tbt = statistics.mean(r.tbt for r in results)
                tps = statistics.mean(float(r.stats["steady_tokens_per_step"]) for r in results)
                cell = {
                    "split": name,
                    "layers": describe(plan),
                    "mode": mode,
                    "clients": clients,
                    "requests": n,
                    "tbt_ms": round(1e3 * tbt, 2),
                    "steady_tokens_per_step": round(tps, 4),
                    "step_ms": round(1e3 * tbt * tps, 2),
                    "tokens_per_s": s["output_throughput"],
                    "expected": {
                        k: round(v, 2)
                        for k, v in expected(plan, mode, clients, draft_s, tps).items()
                    },
                    "load_average_1m": round(os.getloadavg()[0], 2),
                }
                log(json.dumps(cell))
                cells.append(cell)
    finally:
        stop(proc)
    # Per process over the split's cells: forwards, modelled and real seconds, overruns.
    report = emulation_report(log_dir)
    for cell in cells:
        cell["emulation"] = report
    return cells


def run_case(args, case: str, target: Path) -> dict:
    cfg = ModelConfig.from_dir(target)
    sizes = ModelSizes.from_config(cfg, 4)
    kv_tokens = args.kv_clients * args.context
    profiles = CASES[case](args, sizes, kv_tokens)
    if args.flat_rows:  # the plan prices a step of that many rows
        profiles = [(rows_bound(p, args.flat_rows), n) for p, n in profiles]
        args.rows = args.flat_rows
    splits, notes = splits_of(args, cfg, sizes, profiles, kv_tokens)
    log(
        f"{case}: "
        + "; ".join(f"{k} {describe(p)} {1e3 * p.step_seconds:.1f} ms" for k, p in splits.items())
    )
    work = Path(tempfile.mkdtemp(prefix=f"bench-hetero-{case}-"))
    cells = []
    for name, plan in splits.items():
        if name not in args.splits.split(","):
            continue
        cells += run_split(args, target, name, plan, profiles, work)
    return {
        "nodes": [{**p.to_dict(), "count": n} for p, n in profiles],
        "splits": {
            k: {
                "layers": describe(p),
                "step_ms": round(1e3 * p.step_seconds, 2),
                "stage_ms": [round(1e3 * s.step_seconds, 2) for s in p.stages],
                "memory_mib": [round(s.memory_bytes / 2**20, 2) for s in p.stages],
            }
            for k, p in splits.items()
        },
        "notes": notes,
        "cells": cells,
    }


# -- tables ----------------------------------------------------------------------------------
def table(case: str, result: dict) -> list[str]:
    flat_rows = int(result["meta"]["args"].get("flat_rows", "0"))
    costs = f"flat up to {flat_rows} rows, linear beyond" if flat_rows else "flat at any rows"
    growth = result["meta"]["args"].get("growth", "?")
    lines = [
        f"### {case} (costs {costs}; growth {growth})",
        "",
        "Nodes: "
        + ", ".join(
            f"{n['name']} x{n['count']} ({1e3 * n['layer'][0]['seconds'][0]:.1f} ms/layer, "
            f"head {1e3 * n['head'][0]['seconds'][0]:.1f} ms, {n['memory_gib'] * 1024:.1f} MiB)"
            for n in result["nodes"]
        ),
        "",
        "| split | layers (node:A:B) | expected step ms (stages) | memory MiB |",
        "|---|---|---|---|",
    ]
    for name, s in result["splits"].items():
        lines.append(
            f"| {name} | {s['layers']} | {s['step_ms']} ({', '.join(map(str, s['stage_ms']))}) "
            f"| {', '.join(map(str, s['memory_mib']))} |"
        )
    for k, v in result["notes"].items():
        lines.append(f"\n{k}: {json.dumps(v)}")
    lines += [
        "",
        "| split | mode | clients | TBT ms (expected) | tokens/step | step ms (expected) "
        "| tokens/s (expected) | TBT vs even | tokens/s vs even |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cells = result["cells"]
    even = {(c["mode"], c["clients"]): c for c in cells if c["split"] == "even"}
    for c in cells:
        e, base = c["expected"], even.get((c["mode"], c["clients"]))
        step = f"{c['step_ms']} ({e['step_ms']})" if "step_ms" in e else f"{c['step_ms']} (-)"
        vs_tbt = f"{base['tbt_ms'] / c['tbt_ms']:.2f}x" if base else "-"
        vs_tps = f"{c['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        lines.append(
            f"| {c['split']} | {c['mode']} | {c['clients']} | {c['tbt_ms']} ({e['tbt_ms']}) "
            f"| {c['steady_tokens_per_step']} | {step} "
            f"| {c['tokens_per_s']} ({e['tokens_per_s']}) | {vs_tbt} | {vs_tps} |"
        )
    lines += ["", "Emulated devices per split (forwards / overruns, over all its cells):", ""]
    for split, report in {c["split"]: c["emulation"] for c in cells}.items():
        lines.append(
            f"- {split}: "
            + ", ".join(f"{k} {v['forwards']}/{v['overruns']}" for k, v in sorted(report.items()))
        )
    lines.append("")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--modes", default="specpipe,pp")
    ap.add_argument("--clients", type=ints, default=[1, 8])
    ap.add_argument("--hidden", type=int, default=64, help="the random model's hidden size")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--layer-ms", type=float, default=10.0, help="a fast node's ms per layer")
    ap.add_argument("--head-layers", type=float, default=1.25, help="head cost in layers")
    ap.add_argument(
        "--flat-rows",
        type=int,
        default=0,
        help="costs flat up to this many rows a forward and linear beyond (0: flat at any "
        "rows, accelerator-like)",
    )
    ap.add_argument("--draft-ms", type=float, default=60.0, help="the draft's flat forward")
    ap.add_argument("--rows", type=int, default=32, help="rows per step the plan prices")
    ap.add_argument("--context", type=int, default=512, help="tokens per request (KV)")
    ap.add_argument("--kv-clients", type=int, default=8, help="requests the KV is planned for")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument(
        "--growth",
        default="eager",
        choices=["verified", "eager"],
        help="eager (default here): stage 1's next layer does not wait for the verification's "
        "round trip through the router",
    )
    ap.add_argument("--splits", default="planned,even,balanced", help="which splits to run")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--pp-new-tokens", type=int, default=12)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    args.modes = args.modes.split(",")
    target = make_model(
        Path(tempfile.mkdtemp(prefix="bench-hetero-model-")), LAYERS, args.hidden, args.vocab
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    started = time.time()
    for case in args.cases.split(","):
        results[case] = run_case(args, case, target)
        results[case]["meta"] = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "model": f"random Llama, {LAYERS} layers, hidden {args.hidden}, vocab {args.vocab}, fp32",
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "shared": "the machine's 2 cores were shared with other jobs",
            "load_average": os.getloadavg(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        path.write_text(json.dumps(results, indent=1))
    log(f"done in {time.time() - started:.0f} s")
    lines = []
    for case in CASES:
        if case in results:
            lines += table(case, results[case])
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
