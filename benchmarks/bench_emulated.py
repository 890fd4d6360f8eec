"""Emulated devices: wall clock of the real services beside the projection of the same
run (docs/architecture.md, "11. How performance is stated"), and SpecPipe-DB's serving
figures at S = 8 projected from lockstep traces.

1. `gap` and `serve`: multi-process deployments (`specpipe up`'s launcher: router, draft
   and S stages, each its own process) of a tiny random Llama with the target as its own
   draft, every stage and draft forward paced to a cost model (`--emulate-costs`), so
   that the processes overlap as on one device each although this machine has 2 cores.
   Each cell (S, cost model, mode, concurrency) streams closed-loop requests through the
   router and runs the same requests through the in-process lockstep engine, whose trace
   is priced with the same cost model (`EmulatedCosts.at`, `common/perf/timeline.py`).
   The gap between the two is the system's own overhead, split into steps the services
   lost against lockstep (late drafts: a root verified before its children were
   proposed restarts the tree) and time per step beyond the model (router, gRPC feed,
   transport, waking a paced process, rows computed before the prune that drops them).
   `gap`: one client, specpipe and pp, under the Qwen2.5-Coder-1.5B stages' costs
   measured on this CPU (`results/qwen-coder`, S = 2 and 4: "measured", its "flat" view,
   and flat with a free draft). `serve`: concurrency 1, 2, 4, 8 for specpipe, pp and
   specinfer at S = 3 under a synthetic flat model (100 ms a stage forward, 60 ms a draft
   forward: slower than the real forwards here, so that the pacing holds).
3. `control` (issue 24): flat stage costs (`--control-stage-ms`, the draft at half),
   S (`--control-stages`), specpipe and pp at 1, 8 and 32 clients on a model small
   enough that its forwards fit the modelled ones (`--control-hidden`): wall clock
   against projection, the router's CPU per step (its process, per forward of the last
   stage), bytes to the router per emitted token (its data-plane counter), stage 1's
   step overhead, and how often each paced process ran over its model.
2. `project`: the Qwen pair at S = 8, many requests: closed-loop schedules of the
   single-request lockstep traces recorded by bench_specpipe.py (requests do not interact
   in lockstep without a row budget: `timeline.schedule`, tested against the engine),
   priced with batched cost curves of the Qwen S = 8 stages measured here (rows spread
   over 8 requests, each attending to its own context; `--measure` re-measures them)
   under the three cost views of bench_specpipe.py.

    python benchmarks/bench_emulated.py                   # every part, ~25 minutes here
    python benchmarks/bench_emulated.py --parts project   # projections only, seconds
    python benchmarks/bench_emulated.py --parts control --modes specpipe,pp   # ~15 minutes

Writes results/emulated/results.json and results.md (the tables printed).

One module, as every benchmark here: a script run end to end whose parts share its
deployment helpers and tables.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_serve import batch_summary, batching, make_model, scrape  # noqa: E402
from bench_specpipe import COST_VIEWS, cost_views  # noqa: E402
from specpipe.common.perf.cost_model import DeploymentCosts  # noqa: E402
from specpipe.common.perf.emulate import EmulatedCosts, costs_from_results  # noqa: E402
from specpipe.common.perf.timeline import Ask, closed_loop, project, schedule  # noqa: E402
from specpipe.common.spec.options import DecodeOptions, Growth  # noqa: E402
from specpipe.common.spec.stats import DecodeStats  # noqa: E402
from specpipe.services.router.requests import RequestDefaults  # noqa: E402

QWEN = HERE / "results" / "qwen-coder" / "results.json"
OUT = HERE / "results" / "emulated"
BATCHED_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
# What requests leave unset is fixed (K = 1, the draft), as the lockstep projection has
# it; the router would tune it (bench_defaults.py measures that)
FIXED_TREE = dataclasses.asdict(RequestDefaults.fixed())


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# -- 1. the services beside their projection ----------------------------------------------
def synthetic_flat(stage_ms: float, draft_ms: float) -> EmulatedCosts:
    costs = EmulatedCosts.flat(stage_ms / 1e3, draft_ms / 1e3)
    costs.source = f"flat {stage_ms:g}/{draft_ms:g} ms"
    return costs


def qwen_views(stages: int) -> dict[str, EmulatedCosts]:
    measured = costs_from_results(QWEN, stages).levels[0]
    return {
        f"qwen-{view}": EmulatedCosts([c], f"qwen-coder S={stages} {view}")
        for view, c in cost_views(measured).items()
    }


async def stream_all(address: str, prompts, concurrency: int, kwargs: dict):
    """Closed loop: `concurrency` workers take the next prompt when their last one is done;
    every token's arrival time, the tokens and the router's stats of each request."""
    from specpipe.services.client.aio import AsyncClient
    from specpipe.services.client.loadgen import Result

    todo = list(enumerate(prompts))
    results: list = [None] * len(prompts)
    tokens: list = [None] * len(prompts)

    async def worker(client) -> None:
        while todo:
            i, prompt = todo.pop(0)
            res = Result(ok=False, prompt_tokens=len(prompt), start=time.perf_counter())
            stream = client.stream(prompt_ids=prompt, **kwargs)
            async for chunk in stream:
                res.token_times += [time.perf_counter()] * len(chunk.token_ids)
            done = await stream.result()
            res.ok, res.output_tokens, res.stats = True, done.completion_tokens, done.stats
            res.end = time.perf_counter()
            results[i], tokens[i] = res, list(done.token_ids)

    async with AsyncClient(address, timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return results, tokens, time.perf_counter() - t0


def emulation_report(log_dir: Path) -> dict[str, dict]:
    """What each paced process did (its log's last 'emulated device summary')."""
    out = {}
    for f in sorted(log_dir.glob("*.log")):
        for line in f.read_text(errors="replace").splitlines():
            if "emulated device summary" in line:
                out[f.stem] = json.loads(line.split("summary", 1)[1])
    return out


def gap_of(cell: dict) -> dict:
    """Wall vs projected TBT, split into lost steps and overhead per step."""
    wall, proj = cell["services"]["tbt_ms_mean"], cell["projected"]["tbt_ms"]["mean"]
    tps_s, tps_l = cell["services"]["steady_tokens_per_step"], cell["lockstep_steady_tps"]
    steps = tps_l / tps_s if tps_s else float("nan")  # > 1: the services needed more steps
    adjusted = proj * steps  # the projection with the services' own step count
    return {
        "wall_over_projected": round(wall / proj, 3) if proj else None,
        "step_factor": round(steps, 3),
        "time_factor": round(wall / adjusted, 3) if adjusted else None,
        "overhead_ms_per_step": round((wall - adjusted) * tps_s, 2) if tps_s else None,
    }


def services_cells(args, target: Path, stages: int, costs: EmulatedCosts, cells) -> list[dict]:
    from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
    from specpipe.common.runtime.lockstep import LockstepEngine
    from specpipe.services.client.loadgen import load_dataset, summarize
    from specpipe.services.launcher import ServicesDeployment

    work = Path(tempfile.mkdtemp(prefix="bench-emulated-"))
    cost_file = costs.save(work / "costs.json")
    ctx = args.prompt_len + args.max_new_tokens
    priced = costs.at(ctx, stages)
    local = build_local(target, stages, ORACLE_DRAFT)
    policy = (
        {} if args.late_draft_wait_ms is None else {"late_draft_wait_ms": args.late_draft_wait_ms}
    )
    dep = ServicesDeployment(
        target,
        "oracle",
        stages,
        threads=1,
        emulate_costs=cost_file,
        log_dir=work / "logs",
        scheduling={**FIXED_TREE, **policy},
        metrics=True,
        batch_wait=None if args.batch_wait_ms is None else args.batch_wait_ms / 1e3,
    )
    dep.start()
    rows = []
    try:
        for mode, conc in cells:
            addrs = {n: a for n, a in dep.metrics_addresses().items() if n != "router"}
            before = {n: scrape(a) for n, a in addrs.items()}
            n = max(args.min_requests, conc * args.requests_per_client)
            prompts = [list(p.ids) for p in load_dataset(f"random:{args.prompt_len}", n, 511, conc)]
            kwargs = dict(mode=mode, max_new_tokens=args.max_new_tokens, ignore_eos=True)
            opts = DecodeOptions(max_new_tokens=args.max_new_tokens)
            if mode != "pp":
                kwargs.update(width=args.width, depth=args.depth, growth=args.growth)
                opts = DecodeOptions(
                    max_new_tokens=args.max_new_tokens,
                    width=args.width,
                    depth=args.depth,
                    growth=args.growth,
                )
            results, tokens, wall = asyncio.run(
                stream_all(dep.router_address, prompts, conc, kwargs)
            )
            s = summarize(results, wall)
            s["batching"] = batching(before, {n: scrape(a) for n, a in addrs.items()})
            stats = [r.stats for r in results]
            s["tbt_ms_mean"] = round(1e3 * statistics.mean(r.tbt for r in results), 3)
            for key in ("steady_tokens_per_step", "hit_rate", "tokens_per_step"):
                s[key] = round(statistics.mean(float(x[key]) for x in stats), 4)
            s["late_draft_answers"] = sum(int(x["late_draft_answers"]) for x in stats)
            draft = local.draft if mode != "pp" else None
            load = closed_loop(
                LockstepEngine(local.pipeline, draft), [Ask(p, mode, opts) for p in prompts], conc
            )
            cell = {
                "stages": stages,
                "costs": costs.source,
                "mode": mode,
                "concurrency": conc,
                "services": s,
                "projected": project(load, priced),
                "lockstep_steady_tps": round(
                    statistics.mean(x.stats.steady_tokens_per_step for x in load.served), 4
                ),
                "lockstep_hit_rate": round(
                    statistics.mean(x.stats.hit_rate for x in load.served), 4
                ),
                "identical": sum(t == x.tokens for t, x in zip(tokens, load.served, strict=True)),
                "requests": n,
            }
            cell["gap"] = gap_of(cell)
            rows.append(cell)
            log(fmt_cell(cell))
    finally:
        dep.stop()
    report = emulation_report(work / "logs")
    for cell in rows:
        cell["emulation"] = report
    return rows


def fmt_cell(c: dict) -> str:
    s, p, g = c["services"], c["projected"], c["gap"]
    return (
        f"S={c['stages']} {c['costs']:28s} {c['mode']:9s} c={c['concurrency']:<2d} "
        f"TBT wall {s['tbt_ms_mean']:7.1f} proj {p['tbt_ms']['mean']:7.1f} ms "
        f"(x{g['wall_over_projected']}: steps x{g['step_factor']} time x{g['time_factor']}) "
        f"tok/s wall {s['output_throughput']:6.1f} proj {p['output_throughput']:6.1f} "
        f"late {s['late_draft_answers']} identical {c['identical']}/{c['requests']} "
        f"{batch_summary(s)}"
    )


def tiny_target() -> Path:
    return make_model(Path(tempfile.mkdtemp(prefix="bench-emulated-model-")), 8, 256, 512)


def run_gap(args) -> list[dict]:
    """One client, specpipe and pp, under the Qwen stages' cost views."""
    target, rows = tiny_target(), []
    for stages in args.qwen_stages:
        for view, costs in qwen_views(stages).items():
            if view.removeprefix("qwen-") not in args.views.split(","):
                continue
            cells = [(m, 1) for m in ("specpipe", "pp") if m in args.modes]
            rows += services_cells(args, target, stages, costs, cells)
    return rows


def run_serve(args) -> list[dict]:
    """Every mode and concurrency under the synthetic flat model."""
    cells = [(m, c) for m in args.modes for c in args.concurrency]
    flat = synthetic_flat(args.stage_ms, args.draft_ms)
    return services_cells(args, tiny_target(), args.serve_stages, flat, cells)


# -- 3. the control loop: services' overhead, router CPU and bytes per step ---------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def router_bytes(m: dict[str, float], verifications: float, vocab: int) -> float:
    """Bytes the last stage sent the router: its data-plane counter where the build has
    one, else (builds that sent logits) one fp32 logits row per verification."""
    key = "specpipe:dataplane_received_bytes_total"
    return m[key] if key in m else verifications * vocab * 4


def control_cells(args, target: Path, stages: int, costs: EmulatedCosts) -> list[dict]:
    """`services_cells` with the router's CPU seconds per pipeline step (the last stage's
    forwards) and the bytes to the router per emitted token."""
    from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
    from specpipe.common.runtime.lockstep import LockstepEngine
    from specpipe.services.client.loadgen import load_dataset, summarize
    from specpipe.services.launcher import ServicesDeployment

    work = Path(tempfile.mkdtemp(prefix="bench-control-"))
    cost_file = costs.save(work / "costs.json")
    priced = costs.at(args.prompt_len + args.max_new_tokens, stages)
    local = build_local(target, stages, ORACLE_DRAFT)
    vocab = local.pipeline.vocab_size
    dep = ServicesDeployment(
        target, "oracle", stages, threads=1, emulate_costs=cost_file, log_dir=work / "logs",
        metrics=True,
        scheduling={**FIXED_TREE, "max_running": max(args.concurrency),
                    "max_running_per_key": max(args.concurrency)},  # one client: all slots
        **({"relay_prunes": False} if args.no_relay_prunes else {}),
    )  # fmt: skip
    dep.start()
    rows = []
    last = f"stage{stages - 1}"
    try:
        router = dep.children["router"].proc
        assert router is not None
        for mode in args.modes:
            for conc in args.concurrency:
                n = max(args.min_requests, conc * args.requests_per_client)
                prompts = [
                    list(p.ids) for p in load_dataset(f"random:{args.prompt_len}", n, 511, conc)
                ]
                kwargs = dict(mode=mode, max_new_tokens=args.max_new_tokens, ignore_eos=True)
                opts = DecodeOptions(max_new_tokens=args.max_new_tokens)
                if mode != "pp":
                    kwargs.update(width=args.width, growth=args.growth)
                    opts = DecodeOptions(
                        max_new_tokens=args.max_new_tokens, width=args.width, growth=args.growth
                    )
                addrs = dep.metrics_addresses()
                before = {k: scrape(a) for k, a in addrs.items()}
                cpu0, load0 = cpu_seconds(router.pid), os.getloadavg()[0]
                results, tokens, wall = asyncio.run(
                    stream_all(dep.router_address, prompts, conc, kwargs)
                )
                cpu = cpu_seconds(router.pid) - cpu0
                after = {k: scrape(a) for k, a in addrs.items()}

                key = "specpipe:stage_forward_seconds_count"
                steps = after[last].get(key, 0.0) - before[last].get(key, 0.0)
                emitted = sum(len(t) for t in tokens)
                key = "specpipe:spec_verifications_total"
                verifs = after["router"].get(key, 0.0) - before["router"].get(key, 0.0)
                sent = router_bytes(after["router"], verifs, vocab) - router_bytes(
                    before["router"], 0, vocab
                )
                key = "specpipe:step_overhead_seconds"
                n_over = after["stage0"].get(f"{key}_count", 0.0) - before["stage0"].get(
                    f"{key}_count", 0.0
                )
                t_over = after["stage0"].get(f"{key}_sum", 0.0) - before["stage0"].get(
                    f"{key}_sum", 0.0
                )
                s = summarize(results, wall)
                s["tbt_ms_mean"] = round(1e3 * statistics.mean(r.tbt for r in results), 3)
                s["steady_tokens_per_step"] = round(
                    statistics.mean(float(r.stats["steady_tokens_per_step"]) for r in results), 4
                )
                draft = local.draft if mode != "pp" else None
                ask = [Ask(p, mode, opts) for p in prompts]
                load = closed_loop(LockstepEngine(local.pipeline, draft), ask, conc)
                proj = project(load, priced)
                cell = {
                    "stages": stages,
                    "costs": costs.source,
                    "mode": mode,
                    "concurrency": conc,
                    "requests": n,
                    "services": s,
                    "projected": proj,
                    "tbt_wall_over_projected": round(s["tbt_ms_mean"] / proj["tbt_ms"]["mean"], 3),
                    "throughput_projected_over_wall": round(
                        proj["output_throughput"] / s["output_throughput"], 3
                    ),
                    "router_cpu_ms_per_step": round(1e3 * cpu / steps, 3) if steps else None,
                    "router_bytes_per_token": round(sent / emitted, 1) if emitted else None,
                    "last_stage_steps": int(steps),
                    "growth": args.growth if mode != "pp" else "",
                    # the step's service overhead stage 1 measured (from the last stage's
                    # verification to the next feed; builds that have the metric)
                    "step_overhead_ms": round(1e3 * t_over / n_over, 2) if n_over else None,
                    "identical": sum(
                        t == x.tokens for t, x in zip(tokens, load.served, strict=True)
                    ),
                    "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)],
                }
                rows.append(cell)
                log(fmt_control(cell))
    finally:
        dep.stop()
    report = emulation_report(work / "logs")
    for cell in rows:
        cell["emulation"] = report
    return rows


def overrun_share(cell: dict) -> str:
    """The largest share of a paced process's forwards that ran over their model (the
    emulation holds while this is small), stage and draft."""
    rep = cell.get("emulation", {})
    share = {n: r["overruns"] / r["forwards"] for n, r in rep.items() if r.get("forwards")}
    stage = max((v for n, v in share.items() if n.startswith("stage")), default=0.0)
    return f"{stage:.0%} / {share.get('draft', 0.0):.0%}"


def fmt_control(c: dict) -> str:
    s, p = c["services"], c["projected"]
    return (
        f"{c['costs']:18s} S={c['stages']} {c['mode']:8s} c={c['concurrency']:<2d} "
        f"TBT {s['tbt_ms_mean']:7.1f}/{p['tbt_ms']['mean']:7.1f} ms "
        f"(x{c['tbt_wall_over_projected']}) tok/s {s['output_throughput']:7.1f}/"
        f"{p['output_throughput']:7.1f} (x{c['throughput_projected_over_wall']}) "
        f"router {c['router_cpu_ms_per_step']} ms CPU/step, {c['router_bytes_per_token']} B/token "
        f"tps {s['mean_tokens_per_step']}/{p['mean_tokens_per_step']} "
        f"overhead {c['step_overhead_ms']} ms "
        f"identical {c['identical']}/{c['requests']} load {c['load_average']}"
    )


def run_control(args) -> list[dict]:
    """Flat stage costs (the draft at half) x S x modes x clients, on a model small
    enough (hidden `--control-hidden`) that its real forwards fit the modelled ones."""
    root = Path(tempfile.mkdtemp(prefix="bench-emulated-model-"))
    target, rows = make_model(root, 8, args.control_hidden, 512), []
    for stage_ms in args.control_stage_ms:
        for stages in args.control_stages:
            costs = synthetic_flat(stage_ms, stage_ms / 2)
            rows += control_cells(args, target, stages, costs)
    return rows


def control_table(rows: list[dict]) -> list[str]:
    lines = [
        "| stage ms | S | mode | clients | TBT ms wall / projected (x) "
        "| tok/s wall / projected (x) | router CPU ms / step | bytes to router / token "
        "| step overhead ms | identical | load | overruns stage / draft |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in rows:
        s, p = c["services"], c["projected"]
        lines.append(
            f"| {c['costs'].split()[1].split('/')[0]} | {c['stages']} | {c['mode']} "
            f"| {c['concurrency']} | {s['tbt_ms_mean']:.1f} / {p['tbt_ms']['mean']:.1f} "
            f"({c['tbt_wall_over_projected']}) | {s['output_throughput']:.1f} / "
            f"{p['output_throughput']:.1f} ({c['throughput_projected_over_wall']}) "
            f"| {c['router_cpu_ms_per_step']} | {c['router_bytes_per_token']} "
            f"| {c.get('step_overhead_ms') or '-'} | {c['identical']}/{c['requests']} | {c['load_average'][0]}-{c['load_average'][1]} "
            f"| {overrun_share(c)} |"
        )
    return lines


# -- 2. S = 8 projected from recorded traces ----------------------------------------------
def recorded_runs(mode: str, temperature: str = "0.0") -> list[DecodeStats]:
    """bench_specpipe.py's S = 8 runs of `mode` as DecodeStats, with the prefill step
    its JSON leaves out put back (one prompt chunk in stage 1: decode step 0 shows it in
    stage 2)."""
    runs = json.loads(QWEN.read_text())["by_stages"]["8"]["modes"][f"{mode}@T{temperature}"]
    out = []
    for r in runs["runs"]:
        assert r["prefill_steps"] == 1, "one prompt chunk"
        first = r["trace"][0]
        prefill = [first[1]] + [0] * (len(first) - 1)
        out.append(
            DecodeStats(
                mode=mode,
                stages=8,
                width=int(r.get("width", 0)),
                prefill_steps=1,
                decode_steps=r["decode_steps"],
                new_tokens=r["new_tokens"],
                trace=[prefill, *r["trace"]],
                emit_steps=r["emit_steps"],
                draft_layers=r["draft_layers"],
            )
        )
    return out


def measure_batched(requests: int, repeats: int = 2) -> DeploymentCosts:
    """Every Qwen S = 8 stage (the recorded runs' layer split) and the draft, loaded one at
    a time, timed on batched forwards of rows spread over `requests` requests."""
    from specpipe.common.model.config import ModelConfig
    from specpipe.common.model.loading import load_stage
    from specpipe.common.model.partition import parse_layer_ranges
    from specpipe.common.perf.cost_model import measure_runtime
    from specpipe.common.runtime.stage import StageRuntime
    from specpipe.common.store.resolver import resolve_model

    results = json.loads(QWEN.read_text())
    cfg, context = results["config"], results["context"]
    target, draft = resolve_model(cfg["target"]), resolve_model(cfg["draft"])
    notes = results["by_stages"]["8"]["costs"]["notes"]
    ranges = parse_layer_ranges(
        notes["layers"].replace(" ", ","), ModelConfig.from_dir(target).num_layers
    )

    def curve(model_dir, layer_range):
        runtime = StageRuntime(load_stage(model_dir, layer_range, torch.float32))
        c = measure_runtime(runtime, BATCHED_ROWS, context, repeats, requests)
        log(f"  {model_dir.name} {layer_range}: " + " ".join(f"{1e3 * x:.0f}" for x in c.seconds))
        return c

    stages = [curve(target, r) for r in ranges]
    costs = DeploymentCosts(context, stages, curve(draft, None))
    costs.notes.update(
        layers=notes["layers"],
        requests=str(requests),
        load_average_1m=f"{os.getloadavg()[0]:.2f}",
        torch_threads=str(torch.get_num_threads()),
    )
    return costs


def batched_costs(args) -> dict[int, DeploymentCosts]:
    """Batched curves for 1 and for 8 requests (measured now with --measure, else the
    files an earlier --measure saved)."""
    out = {}
    for requests in (1, 8):
        path = OUT / f"qwen_s8_costs_{requests}req.json"
        if args.measure or not path.is_file():
            log(f"measuring Qwen S=8 stage costs, rows over {requests} request(s) ...")
            EmulatedCosts([measure_batched(requests)], str(path)).save(path)
        out[requests] = EmulatedCosts.load(path).levels[0]
    return out


def run_projection(args) -> list[dict]:
    costs = batched_costs(args)
    runs = {m: recorded_runs(m) for m in ("specpipe", "pp", "specinfer")}
    rows = []
    one = cost_views(costs[1])  # flat views: n rows cost one row's time, batched or not
    for conc in args.project_concurrency:
        views = {**one, "measured": costs[1 if conc == 1 else 8]}
        for mode, recorded in runs.items():
            n = max(args.min_requests, conc * args.requests_per_client)
            load = schedule([recorded[i % len(recorded)] for i in range(n)], conc)
            for view in COST_VIEWS:
                p = project(load, views[view])
                rows.append({"mode": mode, "concurrency": conc, "view": view, "requests": n, **p})
    return rows


# -- tables --------------------------------------------------------------------------------
def services_table(rows: list[dict]) -> list[str]:
    lines = [
        "| S | cost model | mode | clients | TBT ms wall / projected | wall / projected "
        "| steps lost (x) | time per step (x) | overhead ms/step | tok/s wall / projected "
        "| late drafts | identical | forwards (requests each) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in rows:
        s, p, g = c["services"], c["projected"], c["gap"]
        lines.append(
            f"| {c['stages']} | {c['costs']} | {c['mode']} | {c['concurrency']} "
            f"| {s['tbt_ms_mean']:.1f} / {p['tbt_ms']['mean']:.1f} | {g['wall_over_projected']} "
            f"| {g['step_factor']} | {g['time_factor']} | {g['overhead_ms_per_step']} "
            f"| {s['output_throughput']:.1f} / {p['output_throughput']:.1f} "
            f"| {s['late_draft_answers']} | {c['identical']}/{c['requests']} "
            f"| {batch_summary(s)} |"
        )
    return lines


def projection_table(rows: list[dict]) -> list[str]:
    lines = [
        "| clients | mode | tok/s measured / flat / flat, free draft | vs pp (same three) "
        "| TBT p50 ms (same three) | TBT p99 ms (same three) |",
        "|---|---|---|---|---|---|",
    ]
    by = {(r["mode"], r["concurrency"], r["view"]): r for r in rows}
    for conc in sorted({r["concurrency"] for r in rows}):
        for mode in ("specpipe", "specinfer", "pp"):
            cells = [by[mode, conc, v] for v in COST_VIEWS]
            pp = [by["pp", conc, v]["output_throughput"] for v in COST_VIEWS]
            lines.append(
                f"| {conc} | {mode} | "
                + " / ".join(f"{c['output_throughput']:.1f}" for c in cells)
                + " | "
                + " / ".join(
                    f"{c['output_throughput'] / b:.2f}x" for c, b in zip(cells, pp, strict=True)
                )
                + " | "
                + " / ".join(f"{c['tbt_ms']['p50']:.0f}" for c in cells)
                + " | "
                + " / ".join(f"{c['tbt_ms']['p99']:.0f}" for c in cells)
                + " |"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--parts", default="gap,serve,project")
    ap.add_argument("--qwen-stages", type=ints, default=[2, 4], help="S of the Qwen cost models")
    ap.add_argument("--serve-stages", type=int, default=3)
    ap.add_argument("--modes", default="specpipe,pp,specinfer")
    ap.add_argument("--concurrency", type=ints, default=[1, 2, 4, 8])
    ap.add_argument("--project-concurrency", type=ints, default=[1, 2, 4, 8, 16])
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--depth", type=int, default=4, help="specinfer tree depth")
    ap.add_argument("--growth", default=Growth.VERIFIED.value, choices=[g.value for g in Growth])
    ap.add_argument("--stage-ms", type=float, default=100.0, help="synthetic flat stage forward")
    ap.add_argument("--draft-ms", type=float, default=60.0, help="synthetic flat draft forward")
    ap.add_argument("--measure", action="store_true", help="re-measure the batched Qwen curves")
    ap.add_argument("--views", default="measured,flat,flat_free_draft", help="gap: Qwen views")
    ap.add_argument(
        "--late-draft-wait-ms",
        type=float,
        default=None,
        help="the router's late-draft wait (default: the router's, one measured step; 0: none)",
    )
    ap.add_argument(
        "--batch-wait-ms",
        type=float,
        default=None,
        help="the stages' --batch-wait-ms (default: theirs, auto; 0: no step alignment)",
    )
    ap.add_argument(
        "--control-stage-ms", type=lambda s: [float(x) for x in s.split(",")], default=[20, 100]
    )
    ap.add_argument("--control-stages", type=ints, default=[4, 8])
    ap.add_argument("--control-hidden", type=int, default=64, help="the control part's model")
    ap.add_argument("--no-relay-prunes", action="store_true",
                    help="control part: the router's prunes to every stage (A/B)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    args.modes = args.modes.split(",")
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    parts = args.parts.split(",")
    for part, run in (("gap", run_gap), ("serve", run_serve), ("control", run_control)):
        if part in parts:
            results[part] = run(args)
    if "project" in parts:
        results["project"] = run_projection(args)
    results.setdefault("meta", {})[",".join(parts)] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load_average": os.getloadavg(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    lines = []
    for part in ("gap", "serve"):
        if results.get(part):
            lines += [
                f"Through the services ({part}), emulated devices, beside the projection:",
                "",
            ]
            lines += [*services_table(results[part]), ""]
    if results.get("control"):
        lines += ["The control loop (flat stage costs, draft at half):", ""]
        lines += [*control_table(results["control"]), ""]
    if results.get("project"):
        lines += ["Projected, Qwen pair, S = 8, closed loop (recorded traces, batched costs):", ""]
        lines += projection_table(results["project"])
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
