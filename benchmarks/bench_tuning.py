"""The router's `auto` settings (issue 11, item 4) on emulated devices: what it chooses for
layers per step and token source under different device costs, whether its price of each
setting ranks them as the wall clock does, and what the choice gains over the paper's
setting (one layer per step, the draft model). `--price model` makes the router go by
the cost curves instead of the measured time between tokens.

For each cost model a multi-process deployment (`specpipe up`'s launcher: router, draft,
S stages; a tiny random Llama as its own draft) runs with every forward paced to the cost
model (`--emulate-costs`), the router started with `--layers-per-step auto --token-source
auto --tune-calibration-tokens N`; the stages and the draft publish the emulated costs
as their cost curves. Closed-loop clients send `auto` requests: the first ones calibrate
every candidate, the rest get the choice. Then the same number of requests with K = 1 and
the draft, the paper's setting. Reported per candidate: the router's price (ms per token
from the cost curves over the tokens per step it measured) beside the wall-clock time
between tokens of the requests that ran with it; the choice, its reason, and the wall
clock of auto requests after calibration against the paper's setting.

    python benchmarks/bench_tuning.py           # three cost models, ~10 minutes here
    python benchmarks/bench_tuning.py --quick   # one, ~2 minutes

Writes results/tuning/results.json and results.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_emulated import qwen_views, stream_all, synthetic_flat, tiny_target  # noqa: E402
from specpipe.common.perf.emulate import EmulatedCosts  # noqa: E402

OUT = HERE / "results" / "tuning"


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def cost_models(quick: bool, stages: int) -> list[tuple[EmulatedCosts, int]]:
    """Flat costs with a cheap and a dear draft on `stages` stages, and the curves the
    Qwen2.5-Coder 1.5B/0.5B pair measured on this CPU (S = 2: rows cost nearly in
    proportion)."""
    models = [(synthetic_flat(100, 10), stages)]
    if not quick:
        models += [(synthetic_flat(100, 60), stages), (qwen_views(2)["qwen-measured"], 2)]
    return models


def wall_ms_per_token(results, keep) -> float | None:
    tbts = [r.tbt for r, s in results if keep(s) and r.tbt is not None]
    return round(1e3 * statistics.mean(tbts), 2) if tbts else None


def run_model(args, target: Path, costs: EmulatedCosts, stages: int) -> dict:
    from specpipe.services.client.loadgen import load_dataset
    from specpipe.services.launcher import ServicesDeployment

    from specpipe.client import Client

    work = Path(tempfile.mkdtemp(prefix="bench-tuning-"))
    dep = ServicesDeployment(
        target,
        "oracle",
        stages,
        threads=1,
        emulate_costs=costs.save(work / "costs.json"),
        log_dir=work / "logs",
        scheduling={
            "layers_per_step": "auto",
            "token_source": "auto",
            "tune_calibration_tokens": args.calibration_tokens,
            "tune_price": args.price,
        },
    )
    dep.start()
    try:
        n_auto = args.candidates * -(-args.calibration_tokens // args.max_new_tokens)
        n_auto += args.after
        data = load_dataset(f"random:{args.prompt_len}", n_auto + args.after, 511, 1)
        prompts = [list(p.ids) for p in data]
        kwargs = dict(mode="specpipe", max_new_tokens=args.max_new_tokens, ignore_eos=True)
        kwargs["width"] = args.width
        t0 = time.perf_counter()
        auto, _, _ = asyncio.run(
            stream_all(dep.router_address, prompts[:n_auto], args.concurrency, kwargs)
        )
        with Client(dep.router_address, timeout=30) as c:
            (tuning,) = c.describe().tuning
        paper_kwargs = dict(kwargs, layers_per_step=1, token_source="draft")
        paper, _, _ = asyncio.run(
            stream_all(dep.router_address, prompts[n_auto:], args.concurrency, paper_kwargs)
        )
        seconds = time.perf_counter() - t0
    finally:
        dep.stop()

    def setting(stats) -> tuple[int, str]:
        return int(stats["layers_per_step"]), str(stats["token_source"])

    auto_runs = [(r, setting(r.stats)) for r in auto]
    chosen = (tuning.chosen.layers_per_step, tuning.chosen.token_source)
    arms = []
    for a in tuning.arms:
        key = (a.layers_per_step, a.token_source)
        arms.append(
            {
                "layers_per_step": a.layers_per_step,
                "token_source": a.token_source,
                "requests": a.requests,
                "tokens_per_step": round(a.tokens / a.steps, 3) if a.steps else None,
                "hit_rate": round(a.hit_rate, 3),
                "step_ms": round(a.step_ms, 2),
                "priced_ms_per_token": round(a.ms_per_token, 2),
                "router_wall_ms_per_token": round(a.wall_ms_per_token, 2),
                "wall_ms_per_token": wall_ms_per_token(auto_runs, lambda s, k=key: s == k),
            }
        )
    tail = auto_runs[-args.after :]
    return {
        "costs": costs.source,
        "stages": stages,
        "width": args.width,
        "price": tuning.price,
        "chosen": {"layers_per_step": chosen[0], "token_source": chosen[1]},
        "reason": tuning.reason,
        "arms": arms,
        "auto_after_calibration_ms_per_token": wall_ms_per_token(tail, lambda s: True),
        "auto_after_calibration_settings": sorted({f"K={k} {src}" for _, (k, src) in tail}),
        "paper_setting_ms_per_token": wall_ms_per_token([(r, None) for r in paper], lambda s: True),
        "requests": {"auto": len(auto), "paper": len(paper)},
        "seconds": round(seconds, 1),
    }


def table(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        c = r["chosen"]
        out += [
            f"### {r['costs']} (S = {r['stages']}, W = {r['width']}; the router goes by "
            f"the {r['price']} price)",
            "",
            "| K | source | requests | tokens/step | hit rate | step (model) | "
            "ms/token model | ms/token wall (router) | ms/token wall (clients) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        key = "router_wall_ms_per_token" if r["price"] == "wall" else "priced_ms_per_token"
        for a in sorted(r["arms"], key=lambda a: a[key]):
            mark = " **chosen**" if (a["layers_per_step"], a["token_source"]) == (
                c["layers_per_step"], c["token_source"]) else ""  # fmt: skip
            out.append(
                f"| {a['layers_per_step']} | {a['token_source']}{mark} | {a['requests']} | "
                f"{a['tokens_per_step']} | {a['hit_rate']} | {a['step_ms']} ms | "
                f"{a['priced_ms_per_token']} | {a['router_wall_ms_per_token']} | "
                f"{a['wall_ms_per_token']} |"
            )
        out += [
            "",
            f"Reason: {r['reason']}",
            "",
            f"Wall ms/token after calibration: auto {r['auto_after_calibration_ms_per_token']} "
            f"({', '.join(r['auto_after_calibration_settings'])}) against the paper's K=1 "
            f"draft {r['paper_setting_ms_per_token']} ({r['requests']['paper']} requests each).",
            "",
        ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--calibration-tokens", type=int, default=64)
    ap.add_argument("--candidates", type=int, default=9, help="K in 1..3 x 3 sources")
    ap.add_argument("--after", type=int, default=6, help="requests after calibration")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--price", choices=["wall", "model"], default="wall")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    target = tiny_target()
    rows = []
    for costs, stages in cost_models(args.quick, args.stages):
        row = run_model(args, target, costs, stages)
        log(json.dumps(row, indent=1))
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
        "load_average": os.getloadavg(),
        "command": " ".join(["python", "benchmarks/bench_tuning.py", *sys.argv[1:]]),
    }
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = [f"Command: `{meta['command']}`; {meta['machine']}.", "", *table(rows)]
    (args.out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
