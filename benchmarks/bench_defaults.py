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


def measure(address: str, prompts, kwargs: dict) -> dict:
    results, tokens, wall = asyncio.run(stream_all(address, prompts, 1, kwargs))
    stats = [r.stats for r in results]
    return {
        "requests": len(results),
        "tbt_ms": round(1e3 * statistics.mean(r.tbt for r in results), 2),
        "tokens_per_step": round(statistics.mean(float(s["tokens_per_step"]) for s in stats), 3),
        "settings": sorted({label(s) for s in stats}),
        "tokens": tokens,
        "wall_s": round(wall, 2),
    }


def run_costs(args, target: Path, stage_ms: float, draft_ms: float) -> dict:
    from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
    from specpipe.common.runtime.lockstep import LockstepGeneration
    from specpipe.common.spec.options import DecodeOptions, Mode
    from specpipe.services.client.loadgen import load_dataset
    from specpipe.services.client.sync import Client
    from specpipe.services.launcher import ServicesDeployment

    work = Path(tempfile.mkdtemp(prefix="bench-defaults-"))
    cost_file = synthetic_flat(stage_ms, draft_ms).save(work / "costs.json")
    n = args.requests
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
    out: dict = {"stage_ms": stage_ms, "draft_ms": draft_ms, "variants": {}}
    try:
        base = dict(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        calib = [list(p.ids) for p in load_dataset(f"random:{args.prompt_len}", 64, 7, 1)]
        t0, served = time.perf_counter(), 0
        with Client(dep.router_address, timeout=120) as client:  # the default calibrates
            while served < len(calib):
                client.generate(prompt_ids=calib[served], **base)
                served += 1
                tuning = client.describe().tuning
                if tuning and "measuring" not in tuning[0].reason:
                    break
        out["calibration"] = {"requests": served, "wall_s": round(time.perf_counter() - t0, 1)}
        for name, kw in VARIANTS.items():
            m = measure(dep.router_address, prompts, {**base, **kw})
            m["identical"] = sum(t == p for t, p in zip(m.pop("tokens"), plain, strict=True))
            out["variants"][name] = m
            log(f"stage {stage_ms:g} ms draft {draft_ms:g} ms  {name:14s} {m}")
        with Client(dep.router_address, timeout=30) as client:
            (t,) = client.describe().tuning
            out["chosen"] = t.reason
            out["arms"] = len(t.arms)
        log(f"  calibration {out['calibration']}, {out['arms']} arms; chosen: {out['chosen']}")
    finally:
        dep.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", default="20/2,20/40", help="stage/draft ms per forward, ...")
    ap.add_argument("--requests", type=int, default=6, help="measured per variant")
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
        rows.append(run_costs(args, target, stage_ms, draft_ms))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print("| stage / draft ms | variant | TBT ms | tokens/step | settings | identical |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        for name, m in r["variants"].items():
            print(
                f"| {r['stage_ms']:g} / {r['draft_ms']:g} | {name} | {m['tbt_ms']} | "
                f"{m['tokens_per_step']} | {', '.join(m['settings'])} | "
                f"{m['identical']}/{m['requests']} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
