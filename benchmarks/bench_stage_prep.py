"""A stage's per-step host work on `bench_host.py`'s workload, in process (issue 34 point
3): the calls every stage of the in-process lockstep engine receives (a tiny random
Llama, 8 layers, hidden 64, 4 stages of 2 layers, its own draft; specpipe, greedy, W = 4,
64 tokens; `--concurrency` clients, closed loop), recorded once, then replayed on fresh
stages as a stage's compute rounds run them: a step's prunes in one `prune_many`, then
`prepare_step` (block tables, positions, attention metadata: `pack`) and `run_step` (the
forward and the outputs). Prints thread CPU microseconds per step (the cheapest of
`--repeats` replays, fair on a shared machine) of each part, summed over the four stages
and per stage, and the device operations of the replayed steps (aten ops per step); and
the draft's calls of the same workload (`bench_draft_host.py`'s record), replayed as its
service batches them: its prunes, its preparation and the whole batch, per batch.

    python benchmarks/bench_stage_prep.py                 # 1 and 8 clients, ~1 minute

`bench_stage_host.py` times a synthetic step (a 4-row layer dropped every step); this one
the trees, commits and keeps a served request goes through.

`--baseline DIR` (a copy of another version's `common`, e.g. `git archive main common |
tar -x -C /tmp/base`) replays the same calls on that version's stages too, the two taking
turns in every repeat, so that a comparison on a loaded machine sees the same load.
Writes results/stage-prep/<label>.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_serve import make_model  # noqa: E402

OUT = HERE / "results" / "stage-prep"
PARTS = ("prune_many", "prepare_step", "pack", "run_step")


def record(target: Path, concurrency: int, requests: int) -> list[list[tuple[str, tuple]]]:
    """Per stage, its calls of the lockstep run in order: open, prune, forward_many,
    release (a step's prunes of every request come before its forwards)."""
    from specpipe.common.perf.timeline import Ask, closed_loop
    from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
    from specpipe.common.runtime.lockstep import LockstepEngine
    from specpipe.common.spec.options import DecodeOptions
    from specpipe.services.client.loadgen import load_dataset

    local = build_local(target, 4, ORACLE_DRAFT)
    calls: list[list[tuple[str, tuple]]] = []
    for stage in local.pipeline.stages:
        mine: list[tuple[str, tuple]] = []
        calls.append(mine)
        for name in ("open", "prune", "forward_many", "release"):
            real = getattr(stage, name)

            def recorded(*args, _real=real, _name=name, _calls=mine, **kwargs):
                _calls.append((_name, args, kwargs))
                return _real(*args, **kwargs)

            setattr(stage, name, recorded)
    engine = LockstepEngine(local.pipeline, local.draft)
    prompts = [list(p.ids) for p in load_dataset("random:32", requests, 511, concurrency)]
    opts = DecodeOptions(max_new_tokens=64, width=4)
    closed_loop(engine, [Ask(p, "specpipe", opts) for p in prompts], concurrency)
    return calls


def version(package: str) -> tuple:
    """(its `runtime.stage` module, its `load_runtime`) of a `common` package."""
    stage_module = importlib.import_module(f"{package}.runtime.stage")
    return stage_module, importlib.import_module(f"{package}.runtime.loader").load_runtime


def baseline_package(path: Path) -> str:
    """Another version's `common` (a copy of the folder), importable beside this one."""
    root = Path(tempfile.mkdtemp(prefix="bench-stage-prep-baseline-"))
    shutil.copytree(path, root / "baseline_common")
    sys.path.insert(0, str(root))
    return "baseline_common"


def timer(names: tuple[str, ...]):
    """`bench_draft_host.Parts` (CPU seconds of the methods it times while `counting`)
    over the parts `names`."""
    from bench_draft_host import Parts

    parts = Parts()
    parts.spent = dict.fromkeys(names, 0.0)
    return parts


def replay(
    target: Path, layers, calls, timed: bool = True, package: str = "specpipe.common"
) -> tuple[int, dict[str, float]]:
    """Steps (forwards of tree rows) and CPU seconds per part over them."""
    stage_module, load_runtime = version(package)
    runtime = load_runtime(target, layers, torch.float32, "cpu", None)
    parts = timer((*PARTS, "step"))
    if timed:
        for name in ("prune_many", "prepare_step", "run_step"):
            parts.time(runtime, name)
        pack = stage_module.pack
        parts.time(stage_module, "pack")
    steps, prunes = 0, []
    for name, args, kwargs in calls:
        if name == "prune":
            prunes.append(args)
            continue
        if name != "forward_many":
            getattr(runtime, name)(*args, **kwargs)
            continue
        tree = not any(a.committed for a in args[0])
        parts.counting = tree
        start = time.thread_time()
        if prunes:
            runtime.prune_many(prunes)
            prunes = []
        runtime.forward_many(*args)
        if tree:
            parts.spent["step"] += time.thread_time() - start
            steps += 1
        parts.counting = False
    if timed:
        stage_module.pack = pack
    return steps, parts.spent


def replay_draft(target: Path, calls, package: str) -> dict[str, float]:
    """The draft's recorded calls (`bench_draft_host.record`) replayed as its service
    batches them, on `package`'s `DraftRuntime`: CPU us per batch of its prunes
    (`prune_many`), its preparation (`StageRuntime.prepare_step`) and the whole batch."""
    from bench_draft_host import batches_of

    draft = importlib.import_module(f"{package}.runtime.loader").load_draft(target)
    proposal = importlib.import_module(f"{package}.runtime.draft").Proposal  # its own class
    parts = timer(("prune_many", "prepare_step", "batch"))
    parts.time(draft, "prune_many")
    parts.time(draft.runtime, "prepare_step")
    batches = 0
    for name, prunes, asks in batches_of(calls):
        if name != "batch":
            getattr(draft, name)(*prunes)
            continue
        parts.counting, start = True, time.thread_time()
        if prunes:
            draft.prune_many(prunes)
        if asks:
            draft.step_many([proposal(a.layer, a.top_k, a.temperature) for a in asks])
        parts.spent["batch"] += time.thread_time() - start
        parts.counting = False
        batches += 1
    return {k: 1e6 * v / batches for k, v in parts.spent.items()}


def device_ops(target: Path, layers, calls, package: str = "specpipe.common") -> float:
    """aten operations per replayed tree step (prunes and forward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        steps, _ = replay(target, layers, calls, timed=False, package=package)
    return Count.n / max(1, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3, help="replays; the cheapest is shown")
    ap.add_argument("--label", default="after")
    ap.add_argument("--baseline", type=Path, help="a copy of another version's common")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from specpipe.common.model.config import ModelConfig
    from specpipe.common.model.partition import plan_stages

    target = make_model(Path(tempfile.mkdtemp(prefix="bench-stage-prep-")), 8, 64, 512)
    ranges = plan_stages(ModelConfig.from_dir(target), 4, "even")
    versions = {"after": "specpipe.common"}
    if args.baseline is not None:
        versions = {"before": baseline_package(args.baseline), **versions}
    results = []
    for c in args.concurrency:
        calls = record(target, c, max(2, c))
        for name in versions:
            results.append({"concurrency": c, "version": name, "stages": []})
        runs = results[-len(versions) :]
        for k, layers in enumerate(ranges):
            best: dict[str, dict[str, float]] = {name: {} for name in versions}
            steps = 0
            for _ in range(args.repeats):  # the versions take turns
                for name, package in versions.items():
                    steps, spent = replay(target, layers, calls[k], package=package)
                    for part, s in spent.items():
                        us = 1e6 * s / steps
                        best[name][part] = min(best[name].get(part, us), us)
            for run, (name, package) in zip(runs, versions.items(), strict=True):
                ops = device_ops(target, layers, calls[k], package)
                run["stages"].append({"stage": k, "steps": steps, **best[name], "ops": ops})
        from bench_draft_host import record as record_draft

        draft_calls = record_draft(target, c, max(2, c))
        draft_best: dict[str, dict[str, float]] = {name: {} for name in versions}
        for _ in range(args.repeats):
            for name, package in versions.items():
                for part, us in replay_draft(target, draft_calls, package).items():
                    draft_best[name][part] = min(draft_best[name].get(part, us), us)
        for run in runs:
            run["draft"] = draft_best[run["version"]]
            row = " | ".join(f"{p} {us:.1f}" for p, us in run["draft"].items())
            print(f"{c} client(s), {run['version']}, the draft, us per batch: {row}")
        for run in runs:
            per_stage = run["stages"]
            total = {p: sum(s[p] for s in per_stage) for p in (*PARTS, "step", "ops")}
            run["total"] = total
            row = " | ".join(f"{p} {total[p] / 4:.1f}" for p in (*PARTS, "step", "ops"))
            print(f"{c} client(s), {run['version']}, per stage (mean of 4), us per step: {row}")
            for s in per_stage:
                print("   ", {k: round(v, 1) if isinstance(v, float) else v for k, v in s.items()})
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.label}.json"
    path.write_text(json.dumps({"label": args.label, "results": results}, indent=1))
    print("saved", path)


if __name__ == "__main__":
    main()
