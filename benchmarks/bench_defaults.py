"""Defaults that never lose (issue 34, item 7): one stage with a draft, emulated devices,
the router's default request (no width, K or source: the router tunes them, not using
the draft among the candidates) beside the same deployment's requests without the draft
(pp) and with the old fixed default (K = 1, the draft).

A `specpipe up` deployment (router, draft, one stage, each its own process) of a tiny
random Llama with the target as its own draft (`oracle`), every forward paced to a flat
cost model (`--emulate-costs`): a draft that pays (a fast draft) and one that does not
(a draft forward slower than the stage's). Per variant, closed-loop requests at one
client: time between tokens and tokens per step; the default's requests first calibrate
(every candidate measured on live requests) and are measured after, once the router
chose. Every output is checked against plain decoding's (`autoregressive`).

    python benchmarks/bench_defaults.py                        # ~3 minutes here
    python benchmarks/bench_defaults.py --costs 20/2,20/40 --requests 6

Writes results/defaults/results.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_emulated import stream_all, synthetic_flat  # noqa: E402
from bench_serve import make_model  # noqa: E402

OUT = HERE / "results" / "defaults"
VARIANTS = {
    "default": {},  # nothing set: the router's tuning
    "no draft (pp)": {"mode": "pp"},
    "K=1 W=8 draft": {"width": 8, "layers_per_step": 1, "token_source": "draft"},
}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def label(stats: dict) -> str:
    """What a request ran with, from its stats."""
    tree = f"W={stats['width']} K={stats['layers_per_step']} {stats['token_source']}"
    return f"{stats['mode']} {tree}".strip()


def measure(address: str, prompts, concurrency: int, kwargs: dict) -> dict:
    results, tokens, wall = asyncio.run(stream_all(address, prompts, concurrency, kwargs))
    stats = [r.stats for r in results]
    return {
        "requests": len(results),
        "tbt_ms": round(1e3 * statistics.mean(r.tbt for r in results), 2),
        "tokens_per_s": round(sum(len(t) for t in tokens) / wall, 1),
        "tokens_per_step": round(statistics.mean(float(s["tokens_per_step"]) for s in stats), 3),
        "settings": sorted({label(s) for s in stats}),
        "tokens": tokens,
        "wall_s": round(wall, 2),
    }


async def calibrate(address: str, prompts, concurrency: int, kwargs: dict) -> int:
    """Default requests from `concurrency` closed-loop clients until the router's tuning
    says it chose (no "measuring" in its reason) after each of `2 x concurrency + 2`
    requests in a row (a new measurement can open the search again: the best's
    neighbours) or the prompts run out; how many were served."""
    from specpipe.services.client.aio import AsyncClient

    todo, served, settled = list(prompts), 0, 0

    async def worker(client) -> None:
        nonlocal served, settled
        while todo and settled < 2 * concurrency + 2:
            await client.generate(prompt_ids=todo.pop(0), **kwargs)
            served += 1
            tuning = (await client.describe()).tuning
            chose = bool(tuning and "measuring" not in tuning[0].reason)
            settled = settled + 1 if chose else 0

    async with AsyncClient(address, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return served


def tuning_extra(arm) -> str:
    """What the router's Describe adds to an arm where it knows it (mixed requests)."""
    mixed = getattr(arm, "mixed_requests", None)
    return f", {mixed} mixed" if mixed is not None else ""


def tuning_arms(t) -> list[str]:
    """The arms of one of the router's Describe tunings, one line each."""
    return [
        f"{a.width}/{a.layers_per_step}/{a.token_source}: {a.requests} requests, "
        f"{a.wall_ms_per_token:.1f} ms/token" + tuning_extra(a)
        for a in t.arms
    ]


def run_costs(args, target: Path, stage_ms: float, draft_ms: float, concurrency: int) -> dict:
    from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
    from specpipe.common.runtime.lockstep import LockstepGeneration
    from specpipe.common.spec.options import DecodeOptions, Mode
    from specpipe.services.client.loadgen import load_dataset
    from specpipe.services.client.sync import Client
    from specpipe.services.launcher import ServicesDeployment

    work = Path(tempfile.mkdtemp(prefix="bench-defaults-"))
    cost_file = synthetic_flat(stage_ms, draft_ms).save(work / "costs.json")
    n = args.requests * concurrency
    prompts = [list(p.ids) for p in load_dataset(f"random:{args.prompt_len}", n, 511, 1)]
    local = build_local(target, 1, ORACLE_DRAFT)
    opts = DecodeOptions(max_new_tokens=args.max_new_tokens, stop_token_ids=())
    plain = []
    for p in prompts:
        g = LockstepGeneration(local.pipeline, None, p, Mode.AUTOREGRESSIVE, opts)
        plain.append(g.run())
    dep = ServicesDeployment(
        target, "oracle", 1, threads=1, emulate_costs=cost_file, log_dir=work / "logs",
        scheduling={"tune_calibration_tokens": args.calibration_tokens},
    )  # fmt: skip
    dep.start()
    out: dict = {
        "stage_ms": stage_ms, "draft_ms": draft_ms, "concurrency": concurrency, "variants": {}
    }  # fmt: skip
    where = f"stage {stage_ms:g} ms draft {draft_ms:g} ms, {concurrency} clients"
    try:
        base = dict(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        cap = 64 * concurrency
        calib = [list(p.ids) for p in load_dataset(f"random:{args.prompt_len}", cap, 7, 1)]
        t0 = time.perf_counter()  # the default calibrates
        served = asyncio.run(calibrate(dep.router_address, calib, concurrency, base))
        out["calibration"] = {"requests": served, "wall_s": round(time.perf_counter() - t0, 1)}
        for name, kw in VARIANTS.items():
            m = measure(dep.router_address, prompts, concurrency, {**base, **kw})
            m["identical"] = sum(t == p for t, p in zip(m.pop("tokens"), plain, strict=True))
            out["variants"][name] = m
            log(f"{where}  {name:14s} {m}")
        with Client(dep.router_address, timeout=30) as client:
            (t,) = client.describe().tuning
            out["chosen"] = t.reason
            out["arms"] = tuning_arms(t)
        log(f"  {where}: calibration {out['calibration']}; chosen: {out['chosen']}")
    finally:
        dep.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", default="20/2,20/40", help="stage/draft ms per forward, ...")
    ap.add_argument("--requests", type=int, default=6, help="measured per variant and client")
    ap.add_argument("--concurrency", default="1", help="closed-loop clients per variant, e.g. 1,4")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--calibration-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64, help="the tiny model's hidden size")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    target = make_model(Path(tempfile.mkdtemp(prefix="bench-defaults-model-")), 4, args.hidden, 512)
    rows = []
    for pair in args.costs.split(","):
        stage_ms, draft_ms = (float(x) for x in pair.split("/"))
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            rows.append(run_costs(args, target, stage_ms, draft_ms, concurrency))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print(
        "| stage / draft ms | clients | variant | TBT ms | tokens/s | tokens/step | settings "
        "| identical |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for name, m in r["variants"].items():
            print(
                f"| {r['stage_ms']:g} / {r['draft_ms']:g} | {r['concurrency']} | {name} | "
                f"{m['tbt_ms']} | {m['tokens_per_s']} | {m['tokens_per_step']} | "
                f"{', '.join(m['settings'])} | {m['identical']}/{m['requests']} |"
            )
        print(f"| | | calibration: {r['calibration']['requests']} requests; chosen: "
              f"{r['chosen']} | | | | | |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
