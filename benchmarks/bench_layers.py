"""Several tree layers per step (issue 11): tokens per step, hit rate and projected TBT of
specpipe with K = 1, 2, 3 and auto layers per step, beside SpecInfer swept over depth x
width and plain PP, on S = 2, 4, 8 stages, greedy and T = 0.8.

Everything runs in one process with the lockstep engine (the services' controller), and
time between tokens is projected for one device per stage from each run's step trace and
this machine's measured stage and draft costs (docs/architecture.md, "11. How
performance is stated"), under the cost views of `bench_specpipe.py`: *measured*, *flat*
(n rows cost as much as one, stages and draft) and *flat, free draft*. The draft grows K
layers a step, one forward each: a specpipe step costs max(slowest stage, the sum of the
step's draft forwards).

`auto` is what `--layers-per-step auto` would pick (`common/perf/layers_per_step.py`): from the
hit rates measured here at K = 1, 2, 3 and the cost curves, the K with the least
expected time per token; it is chosen per cost view, and its row reports that K's runs.

SpecInfer's decisions do not depend on S (a pass is the whole tree through all stages),
so its sweep runs once per temperature on the first S and its S-stage traces are the
lockstep engine's schedule of the same passes: pass i enters stage 1 at step S*i and
stage k at step S*i + k - 1, and its tokens are emitted at step S*(i + 1).

    python benchmarks/bench_layers.py            # Qwen2.5-Coder 1.5B / 0.5B if pulled
    python benchmarks/bench_layers.py --quick    # tiny random models, a few minutes
    python benchmarks/bench_layers.py --oracle-check --oracle-model qwen2.5-coder-0.5b-instruct

`--oracle-check` first runs a model as its own draft (every proposal the target's own
choice) on 7 stages: today's beam ranking against the target ranking, K = 1 and 2,
against the ideal (the first root crosses the empty pipeline with the K - 1 levels below it,
then K tokens a step).

`--scripted` (greedy only) keeps the real draft and replaces the target's stages by its
recorded greedy continuation (`common/runtime/scripted.py`): the tokens, steps and rows
each stage computes are the real pipeline's (`tests/unit/test_scripted.py`), the target's
forwards are skipped, so a run takes minutes instead of an hour; the costs are still
measured on the real stages, and every run must emit the target's continuation.

Writes results.json, results.md and layers.png under --out and prints the table;
`--replot` rewrites results.md and layers.png from the results.json there, and
`--reproject [--split balanced]` re-measures the costs (a quieter machine, another layer
split: which rows each stage computed does not depend on its layers) and re-projects the
recorded runs. The SpecInfer sweep keeps only aggregates: with flat costs each of its
passes costs the stages' one-row costs plus D draft forwards, so its flat figures are
rescaled by those sums; its measured figure is dropped.

One module, as every benchmark here: a script run end to end whose parts share its runs,
projections and tables.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_specpipe import COST_VIEWS, Prompt, cost_views, fmt_costs, load_prompts  # noqa: E402
from specpipe.common.model.config import ModelConfig  # noqa: E402
from specpipe.common.model.loading import load_stage  # noqa: E402
from specpipe.common.perf.cost_model import (  # noqa: E402
    DeploymentCosts,
    projected_tbt,
    specinfer_draft_seconds,
)
from specpipe.common.perf.layers_per_step import evaluate_layers, ideal_decode_steps  # noqa: E402
from specpipe.common.runtime.draft import DraftRuntime  # noqa: E402
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local  # noqa: E402
from specpipe.common.runtime.lockstep import LockstepGeneration  # noqa: E402
from specpipe.common.runtime.scripted import ScriptedPipeline  # noqa: E402
from specpipe.common.spec.options import DecodeOptions, Growth, Mode  # noqa: E402
from specpipe.common.spec.sampling import SamplingParams  # noqa: E402

COST_ROWS = [1, 2, 4, 8, 16, 32, 64]


@dataclass
class Setup:
    target: Path
    draft: Path
    prompts: list[Prompt]
    stop: tuple[int, ...]
    label: str


def qwen_setup(n_code: int, n_chat: int) -> Setup | None:
    """The Qwen2.5-Coder pair, if both are in the model store (`specpipe models pull`)."""
    from specpipe.common.store.store import ModelStore
    from specpipe.common.text import TextCodec

    store = ModelStore()
    names = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    dirs = [store.root / n for n in names]
    if not all((d / "config.json").is_file() for d in dirs):
        return None
    codec = TextCodec.from_dir(dirs[0])
    stop = ModelConfig.from_dir(dirs[0]).eos_token_ids
    return Setup(dirs[0], dirs[1], load_prompts(codec, n_code, n_chat), stop, "qwen-coder")


def tiny_setup(n_prompts: int) -> Setup:
    """A random 16-layer Llama made here, as its own draft (random models have no small
    sibling that predicts them): a smoke run of every variant, not a measurement."""
    sys.path.insert(0, str(HERE.parent))
    from tests.conftest import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="bench-layers-"))
    target = make_tiny_model(root / "target", layers=16, hidden=64, heads=4, kv_heads=2,
                             vocab=211, seed=1)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = [
        Prompt("tiny", f"tiny/{i}", torch.randint(1, 200, (12,), generator=g).tolist())
        for i in range(n_prompts)
    ]
    return Setup(target, target, prompts, (), "tiny")


# -- projection -------------------------------------------------------------------------


def project(run: dict, costs: DeploymentCosts) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for view, c in cost_views(costs).items():
        if run["mode"] == "specinfer":
            passes = specinfer_draft_seconds(run["draft_layers"], c)
            v = projected_tbt(run["trace"], run["emit_steps"], c, "specinfer", passes)
        else:  # a step: its slowest stage, or its draft forwards one after another
            v = projected_tbt(
                run["trace"], run["emit_steps"], c, "specpipe", draft_forwards=run["draft_forwards"]
            )
        out[view] = None if v is None else 1e3 * v
    return out


def specinfer_on(run: dict, stages: int) -> dict:
    """A specinfer run's trace and emission steps on `stages` stages (its passes do not
    depend on S: see the module docstring)."""
    trace, emit, step = [], [], 0
    for n, accepted in zip(run["pass_rows"], run["accepted_lengths"], strict=True):
        for k in range(stages):
            trace.append([n if i == k else 0 for i in range(stages)] + [0])
        step += stages
        emit += [step] * accepted
    return {**run, "trace": trace, "emit_steps": emit, "stages": stages, "decode_steps": step,
            "draft_forwards": [[] for _ in trace]}  # fmt: skip


# -- runs -------------------------------------------------------------------------------


def run_one(pipeline, prompt: Prompt, mode: Mode, opts: DecodeOptions, draft) -> dict:
    gen = LockstepGeneration(pipeline, draft, prompt.ids, mode, opts)
    t0 = time.perf_counter()
    tokens = gen.run()
    s = gen.stats
    decode = slice(s.prefill_steps, None)
    run = {
        "prompt": prompt.name,
        "kind": prompt.kind,
        "mode": mode.value,
        "tokens": tokens,
        **s.record(),
        "emit_steps": s.emit_steps,
        "trace": s.trace[decode],
        "draft_forwards": s.draft_forwards[decode],
        "draft_layers": s.draft_layers,
        "accepted_lengths": s.accepted_lengths,
        "hits": s.hits,
        "wall_seconds_in_process": time.perf_counter() - t0,
    }
    if mode == Mode.SPECINFER:
        run["pass_rows"] = [row[0] for row in run["trace"] if row[0]]
    return run


def aggregate(runs: list[dict], costs: DeploymentCosts) -> dict:
    """Token-weighted means over runs (TBT weighted by the gaps it averages)."""
    tokens = sum(r["new_tokens"] for r in runs)
    steps = sum(r["decode_steps"] for r in runs)
    tbt: dict[str, float | None] = {}
    for view in COST_VIEWS:
        num = den = 0.0
        for r in runs:
            v, gaps = project(r, costs)[view], r["new_tokens"] - 1
            if v is not None and gaps > 0:
                num, den = num + v * gaps, den + gaps
        tbt[view] = num / den if den else None
    return {
        "runs": len(runs),
        "new_tokens": tokens,
        "decode_steps": steps,
        "tokens_per_step": tokens / steps if steps else 0.0,
        "hit_rate": sum(r["hits"] for r in runs) / tokens if tokens else 0.0,
        "draft_hit_rate": sum(r["draft_hit_rate"] * r["new_tokens"] for r in runs) / tokens,
        "ngram_hit_rate": sum(r["ngram_hit_rate"] * r["new_tokens"] for r in runs) / tokens,
        "regrowths": sum(r["regrowths"] for r in runs),
        "projected_tbt_ms": tbt,
    }


def greedy_continuations(setup: Setup, max_new: int, log) -> dict[str, list[int]]:
    """prompt name -> prompt + the target's greedy continuation (plain decoding, once)."""
    dep = build_local(setup.target, 1)
    out = {}
    for p in setup.prompts:
        t0 = time.perf_counter()
        opts = DecodeOptions(max_new_tokens=max_new, stop_token_ids=setup.stop)
        tokens = LockstepGeneration(dep.pipeline, None, p.ids, Mode.AUTOREGRESSIVE, opts).run()
        out[p.name] = [*p.ids, *tokens]
        log(f"  {p.name}: the target's greedy continuation, {len(tokens)} tokens "
            f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    return out


def oracle_check(model: Path, prompts: list[Prompt], stop, args, log) -> dict:
    """The target as its own draft: tokens per step against the ideal, per ranking and K."""
    stages = args.oracle_stages
    dep = build_local(model, stages, ORACLE_DRAFT)
    out = {"model": str(model), "stages": stages}
    for label, kw in (
        ("beam K=1", {"ranking": "beam"}),
        ("target K=1", {}),
        ("beam K=2", {"ranking": "beam", "layers_per_step": 2}),
        ("target K=2", {"layers_per_step": 2}),
    ):
        k = kw.get("layers_per_step", 1)
        opts = DecodeOptions(max_new_tokens=args.max_new_tokens, width=args.width,
                             stop_token_ids=stop, **kw)  # fmt: skip
        runs = [run_one(dep.pipeline, p, Mode.SPECPIPE, opts, dep.draft) for p in prompts]
        tokens = sum(r["new_tokens"] for r in runs)
        ideal = sum(ideal_decode_steps(stages, r["new_tokens"], k) for r in runs)
        out[label] = {
            "tokens_per_step": tokens / sum(r["decode_steps"] for r in runs),
            "ideal_tokens_per_step": tokens / ideal,
            "hit_rate": sum(r["hits"] for r in runs) / tokens,
            "regrowths": sum(r["regrowths"] for r in runs),
            "per_prompt": {r["prompt"]: r["tokens_per_step"] for r in runs},
        }
        a = out[label]
        log(f"  oracle S={stages} {label}: tok/step {a['tokens_per_step']:.3f} "
            f"(ideal {a['ideal_tokens_per_step']:.3f}) regrowths {a['regrowths']}")  # fmt: skip
    del dep
    return out


def specpipe_configs(args, temperature: float) -> list[tuple[str, dict]]:
    """(row label, DecodeOptions fields) of every specpipe variant at `temperature` (the
    beam reference and the other sources only at `--extras-temperatures`)."""
    configs = [(f"specpipe K={k}", {"layers_per_step": k}) for k in args.layers]
    if temperature in args.extras_temperatures:
        if args.beam:
            configs.append(("specpipe K=1 beam", {"layers_per_step": 1, "ranking": "beam"}))
        for source in args.sources:
            for k in args.source_layers:
                configs.append((f"{source} K={k}", {"layers_per_step": k, "token_source": source}))
    return [(label, {**kw, "growth": args.growth}) for label, kw in configs]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stages", default="2,4,8")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--code", type=int, default=2, help="HumanEval prompts")
    ap.add_argument("--chat", type=int, default=1, help="chat prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--layers", default="1,2,3", help="specpipe layers per step")
    ap.add_argument("--growth", default=Growth.VERIFIED.value, choices=[g.value for g in Growth],
                    help="when specpipe's layers grow (DecodeOptions.growth)")  # fmt: skip
    ap.add_argument("--sources", default="ngram,hybrid", help="token sources besides the draft")
    ap.add_argument("--source-layers", default="2", help="layers per step of those sources")
    ap.add_argument("--extras-temperatures", default="0",
                    help="temperatures of the beam reference and the other sources")  # fmt: skip
    ap.add_argument("--no-beam", dest="beam", action="store_false",
                    help="skip today's beam ranking (K=1) as a reference")  # fmt: skip
    ap.add_argument("--depths", default="2,4,8", help="specinfer sweep: tree depths")
    ap.add_argument("--widths", default="2,4,8", help="specinfer sweep: tree widths")
    ap.add_argument("--pp-prompts", type=int, default=1, help="pp is 1/S by construction")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--quick", action="store_true", help="tiny random models")
    ap.add_argument("--oracle-check", action="store_true",
                    help="first: a model as its own draft, beam vs target ranking")  # fmt: skip
    ap.add_argument("--oracle-model", default=None, help="for --oracle-check (default: target)")
    ap.add_argument("--oracle-stages", type=int, default=7)
    ap.add_argument("--oracle-only", action="store_true", help="only the oracle check")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--split", default="even", choices=("even", "balanced"),
                    help="stage layer split (balanced counts the LM head)")  # fmt: skip
    ap.add_argument("--scripted", action="store_true",
                    help="greedy only: the target's stages replaced by its recorded "
                    "continuation (common/runtime/scripted.py; same tokens, steps and traces)")  # fmt: skip
    ap.add_argument("--reproject", action="store_true",
                    help="re-measure costs and re-project the runs in --out's results.json")  # fmt: skip
    ap.add_argument("--replot", action="store_true",
                    help="only rewrite results.md and layers.png from --out's results.json")  # fmt: skip
    args = ap.parse_args(argv)
    if args.replot:
        results = json.loads((args.out / "results.json").read_text())
        first = next(iter(results["by_stages"].values()))
        stages = [int(s) for s in results["by_stages"]]
        write_outputs(args.out, results, stages, [float(t) for t in first["rows"]])
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.reproject:
        reproject(args.out, args.split)
        return
    args.layers = [int(k) for k in args.layers.split(",")]
    args.source_layers = [int(k) for k in args.source_layers.split(",")]
    args.sources = [s for s in args.sources.split(",") if s]
    args.extras_temperatures = [float(t) for t in args.extras_temperatures.split(",") if t]
    setup = None if args.quick else qwen_setup(args.code, args.chat)
    if setup is None:
        setup = tiny_setup(max(args.code + args.chat, 1))
    out_dir = args.out or HERE / "results" / f"layers-{setup.label}"
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    stages_list = [int(s) for s in args.stages.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    context = max(len(p.ids) for p in setup.prompts) + args.max_new_tokens
    log(f"{setup.label}: {len(setup.prompts)} prompts, context up to {context}; S {stages_list}")

    oracle = None
    if args.oracle_check or args.oracle_only:
        from specpipe.common.store.resolver import resolve_model

        model = resolve_model(args.oracle_model) if args.oracle_model else setup.target
        oracle = oracle_check(model, setup.prompts, setup.stop, args, log)
        if args.oracle_only:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "oracle.json").write_text(json.dumps(oracle, indent=1))
            (out_dir / "oracle.md").write_text("\n".join(oracle_lines(oracle)) + "\n")
            return
    draft = DraftRuntime(load_stage(setup.draft))
    results: dict = {
        "oracle_check": oracle,
        "config": {k: str(v) for k, v in vars(args).items()},
        "setup": {"target": str(setup.target), "draft": str(setup.draft), "prompts": [p.name for p in setup.prompts]},
        "context": context,
        "by_stages": {},
    }  # fmt: skip
    reference: dict[tuple[str, float], list[int]] = {}
    mismatches: list[str] = []
    specinfer_runs: dict[tuple[float, int, int], list[dict]] = {}

    def base(sampling, **kw) -> DecodeOptions:
        return DecodeOptions(max_new_tokens=args.max_new_tokens, sampling=sampling,
                             width=args.width, stop_token_ids=setup.stop, **kw)  # fmt: skip

    scripted = None
    if args.scripted:
        if temps != [0.0]:
            sys.exit("bench_layers: --scripted replays a greedy continuation: --temperatures 0")
        scripted = greedy_continuations(setup, args.max_new_tokens, log)
        vocab = ModelConfig.from_dir(setup.target).vocab_size
        results["scripted_target"] = True
        for p in setup.prompts:  # every run must emit exactly the target's continuation
            reference[(p.name, 0.0)] = scripted[p.name][len(p.ids) :]

    for S in stages_list:
        dep = build_local(setup.target, S, split=args.split)

        def pipe(p: Prompt, S: int = S, dep=dep):
            """The real target's stages, or its recorded continuation of `p` (--scripted)."""
            return (
                dep.pipeline if scripted is None else ScriptedPipeline(scripted[p.name], S, vocab)
            )

        costs = DeploymentCosts.measure(dep.pipeline.stages, draft.runtime, COST_ROWS, context, 2)
        log(f"S={S}: stage costs (ms) {fmt_costs(costs)}")
        entry: dict = {"costs": costs.to_dict(), "rows": {}}
        for T in temps:
            sampling = SamplingParams(temperature=T, seed=1234)
            rows: dict[str, dict] = {}

            def record(label, runs, rows=rows, S=S, T=T, costs=costs) -> None:
                rows[label] = {"aggregate": aggregate(runs, costs), "runs": runs}
                a = rows[label]["aggregate"]
                tbt = " / ".join(f"{v:.0f}" if v else "-" for v in a["projected_tbt_ms"].values())
                log(f"  S={S} T={T} {label:22s} tok/step {a['tokens_per_step']:.3f} "
                    f"hit {a['hit_rate']:.3f} TBT ms {tbt}")  # fmt: skip

            for label, kw in specpipe_configs(args, T):
                d = draft if kw.get("token_source") != "ngram" else None
                runs = [
                    run_one(pipe(p), p, Mode.SPECPIPE, base(sampling, **kw), d)
                    for p in setup.prompts
                ]
                for r in runs:  # lossless: every variant emits the same tokens
                    ref = reference.setdefault((r["prompt"], T), r["tokens"])
                    if r["tokens"] != ref:
                        mismatches.append(f"S={S} T={T} {label} {r['prompt']}")
                record(label, runs)
            rows["specpipe auto"] = auto_rows(rows, args.layers, costs, S, args.width)
            if not specinfer_runs or all(key[0] != T for key in specinfer_runs):
                for depth in [int(x) for x in args.depths.split(",")]:
                    for width in [int(x) for x in args.widths.split(",")]:
                        o = DecodeOptions(max_new_tokens=args.max_new_tokens, sampling=sampling,
                                          width=width, depth=depth,
                                          stop_token_ids=setup.stop)  # fmt: skip
                        runs = [
                            run_one(pipe(p), p, Mode.SPECINFER, o, draft) for p in setup.prompts
                        ]
                        specinfer_runs[(T, depth, width)] = runs
            sweep = {}
            for (t, depth, width), runs in specinfer_runs.items():
                if t == T:
                    label = f"specinfer D={depth} W={width}"
                    sweep[label] = {
                        "aggregate": aggregate([specinfer_on(r, S) for r in runs], costs)
                    }
            rows["specinfer best"] = best_of(sweep)
            entry.setdefault("specinfer_sweep", {})[str(T)] = {
                k: v["aggregate"] for k, v in sweep.items()
            }
            pp = [
                run_one(pipe(p), p, Mode.PP, base(sampling), None)
                for p in setup.prompts[: args.pp_prompts]
            ]
            record("pp", pp)
            entry["rows"][str(T)] = rows
        results["by_stages"][str(S)] = entry
        results["lossless_mismatches"] = mismatches
        write_outputs(out_dir, results, stages_list[: len(results["by_stages"])], temps)
        del dep
    log(f"lossless: {mismatches or 'all variants emitted the same tokens'}")


def auto_rows(rows: dict, layers: list[int], costs: DeploymentCosts, S: int, width: int) -> dict:
    """`--layers-per-step auto` per cost view, from the measured hit rates at each K."""
    hit = {k: rows[f"specpipe K={k}"]["aggregate"]["hit_rate"] for k in layers}
    views, chosen, explain = {}, {}, {}
    for view, c in cost_views(costs).items():
        choice = evaluate_layers(hit, c, S, width)
        chosen[view] = choice.layers
        views[view] = rows[f"specpipe K={choice.layers}"]["aggregate"]["projected_tbt_ms"][view]
        explain[view] = choice.explain()
    return {"aggregate": {"chosen": chosen, "projected_tbt_ms": views, "explain": explain}}


def best_of(sweep: dict) -> dict:
    """The best SpecInfer configuration per cost view (least projected TBT)."""
    best, tbt = {}, {}
    for view in COST_VIEWS:
        label, row = min(
            sweep.items(), key=lambda kv: kv[1]["aggregate"]["projected_tbt_ms"][view] or math.inf
        )
        tbt[view] = row["aggregate"]["projected_tbt_ms"][view]
        best[view] = label if tbt[view] else "-"
    return {"aggregate": {"chosen": best, "projected_tbt_ms": tbt}}


def write_outputs(out: Path, results: dict, stages_list: list[int], temps: list[float]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        "TBT projected for one device per stage from each run's step trace "
        '(docs/architecture.md, "11. How performance is stated"), ms: '
        "measured (this CPU) / flat (n rows cost as 1) / flat with a free draft. `auto` and "
        "`specinfer best` pick per cost view (the chosen K or D x W in brackets).",
        "",
        "| S | T | variant | tok/step | hit rate (draft / ngram) | TBT ms measured / flat / flat, free draft "
        "| vs pp (same three) | vs specinfer best (same three) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for S in stages_list:
        for T in temps:
            rows = results["by_stages"][str(S)]["rows"][str(T)]
            pp = rows["pp"]["aggregate"]["projected_tbt_ms"]
            si = rows["specinfer best"]["aggregate"]["projected_tbt_ms"]
            for label, row in rows.items():
                a = row["aggregate"]
                tbt = a["projected_tbt_ms"]
                cells = " / ".join(f"{tbt[v]:.1f}" if tbt[v] else "-" for v in COST_VIEWS)
                if "chosen" in a:
                    picks = ", ".join(str(a["chosen"][v]).split(" ", 1)[-1] for v in COST_VIEWS)
                    cells += f" [{picks}]"
                vs_pp = " / ".join(ratio(pp[v], tbt[v]) for v in COST_VIEWS)
                vs_si = " / ".join(ratio(si[v], tbt[v]) for v in COST_VIEWS)
                if "tokens_per_step" in a:
                    hits = f"{a['hit_rate']:.3f} ({a['draft_hit_rate']:.2f} / {a['ngram_hit_rate']:.2f})"
                    tps = f"{a['tokens_per_step']:.3f}"
                else:
                    hits = tps = "-"
                lines.append(
                    f"| {S} | {T} | {label} | {tps} | {hits} | {cells} | {vs_pp} | {vs_si} |"
                )
    lines += ["", f"Lossless: mismatches {results['lossless_mismatches'] or 'none'}."]
    if results.get("oracle_check"):
        lines += ["", *oracle_lines(results["oracle_check"])]
    for S in stages_list:
        for T in temps:
            sweep = results["by_stages"][str(S)]["specinfer_sweep"][str(T)]
            lines += [
                "",
                f"SpecInfer sweep, S={S}, T={T} (tok/step, TBT ms measured / flat / free draft):",
                "",
            ]
            for label, a in sweep.items():
                tbt = " / ".join(fmt_ms(a["projected_tbt_ms"][v]) for v in COST_VIEWS)
                lines.append(f"- {label}: {a['tokens_per_step']:.3f}, {tbt}")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(out, results, stages_list, temps)


def plot(out: Path, results: dict, stages_list: list[int], temps: list[float]) -> None:
    """layers.png: tokens per step and projected TBT (each cost view) against K, one line
    per S and temperature."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 1 + len(COST_VIEWS), figsize=(16, 4))
    for S in stages_list:
        for T in temps:
            rows = results["by_stages"][str(S)]["rows"][str(T)]
            ks = [k for k in range(1, 9) if f"specpipe K={k}" in rows]
            aggs = [rows[f"specpipe K={k}"]["aggregate"] for k in ks]
            style = {"marker": "o", "linestyle": "-" if T == 0 else "--", "label": f"S={S} T={T}"}
            axes[0].plot(ks, [a["tokens_per_step"] for a in aggs], **style)
            for ax, view in zip(axes[1:], COST_VIEWS, strict=True):
                tbt = [a["projected_tbt_ms"][view] for a in aggs]
                ax.plot(ks, [math.nan if v is None else v for v in tbt], **style)
    axes[0].set(
        xlabel="layers per step K", ylabel="tokens per step", title="specpipe tokens per step"
    )
    for ax, view in zip(axes[1:], COST_VIEWS, strict=True):
        ax.set(xlabel="layers per step K", ylabel="ms", title=f"projected TBT, {view}")
    for ax in axes:
        ax.set_xticks([1, 2, 3])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "layers.png", dpi=110)


def reproject(out: Path, split: str) -> None:
    """Re-measure every S's costs with `split` and re-project the runs in out/results.json
    (see the module docstring); the recorded costs are kept as "costs_recorded"."""
    results = json.loads((out / "results.json").read_text())
    setup, cfg = results["setup"], results["config"]
    draft = DraftRuntime(load_stage(Path(setup["draft"])))
    for key, entry in results["by_stages"].items():
        dep = build_local(Path(setup["target"]), int(key), split=split)
        costs = DeploymentCosts.measure(
            dep.pipeline.stages, draft.runtime, COST_ROWS, results["context"], 2
        )
        costs.notes["split"] = split
        print(f"S={key}: stage costs (ms) {fmt_costs(costs)}", file=sys.stderr, flush=True)
        old = DeploymentCosts.from_dict(entry["costs"])
        entry.setdefault("costs_recorded", entry["costs"])
        entry["costs"] = costs.to_dict()
        for T, rows in entry["rows"].items():
            for row in rows.values():
                if "runs" in row:
                    row["aggregate"] = aggregate(row["runs"], costs)
            layers = [k for k in range(1, 9) if f"specpipe K={k}" in rows]
            rows["specpipe auto"] = auto_rows(rows, layers, costs, int(key), int(cfg["width"]))
            sweep = entry["specinfer_sweep"][T]
            for label, a in sweep.items():
                depth = int(label.split("D=")[1].split()[0])
                a["projected_tbt_ms"] = rescale_specinfer(a["projected_tbt_ms"], depth, old, costs)
            rows["specinfer best"] = best_of({k: {"aggregate": v} for k, v in sweep.items()})
        del dep
    cfg["reprojected"] = f"costs re-measured, split {split}"
    first = next(iter(results["by_stages"].values()))
    stages = [int(s) for s in results["by_stages"]]
    write_outputs(out, results, stages, [float(t) for t in first["rows"]])


def rescale_specinfer(tbt: dict, depth: int, old: DeploymentCosts, new: DeploymentCosts) -> dict:
    """A SpecInfer aggregate's flat TBTs under `new` costs: with flat costs its TBT is
    (passes per token) x (sum of the stages' one-row costs + depth draft forwards)."""
    stages_old = sum(c.seconds[0] for c in old.stages)
    stages_new = sum(c.seconds[0] for c in new.stages)
    per_pass = tbt["flat_free_draft"] / stages_old
    draft = depth * new.draft.seconds[0] if new.draft is not None else 0.0
    return {"measured": None, "flat": per_pass * (stages_new + draft),
            "flat_free_draft": per_pass * stages_new}  # fmt: skip


def fmt_ms(v: float | None) -> str:
    return f"{v:.1f}" if v else "-"


def oracle_lines(oc: dict) -> list[str]:
    lines = [f"Target as its own draft ({Path(oc['model']).name}), S={oc['stages']}:", "",
             "| ranking, K | tok/step | ideal | hit rate | regrowths |", "|---|---|---|---|---|"]  # fmt: skip
    for label, a in oc.items():
        if isinstance(a, dict):
            lines.append(f"| {label} | {a['tokens_per_step']:.3f} | {a['ideal_tokens_per_step']:.3f} "
                         f"| {a['hit_rate']:.3f} | {a['regrowths']} |")  # fmt: skip
    return lines


def ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num and den else "-"


if __name__ == "__main__":
    main()
