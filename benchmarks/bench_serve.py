"""Serving throughput of SpecPipe-DB through the real services (not a test).

Starts a local deployment (`specpipe up`'s launcher: router, draft, S stages, each its
own process) on a small random Llama with the target as its own draft (every token a
hit, so the tree is always deep: the regime where batching many requests' trees
matters), then runs `specpipe bench serve`'s load generator at several concurrencies
for specpipe, pp and specinfer, closed loop, greedy. Prints a table and saves JSON (and
a plot with --plot).

Wall-clock figures on a machine with fewer cores than processes measure CPU contention
as much as the pipeline: compare modes and concurrencies measured in the same run.

    python benchmarks/bench_serve.py [--stages 3] [--concurrency 1,2,4,8,16] [--out FILE]
    python benchmarks/bench_serve.py --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --stages 2 --dataset humaneval   # a real pair
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def make_model(root: Path, layers: int, hidden: int, vocab: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=1024,
        initializer_range=0.6,  # peaked distributions, like a trained model's
        bos_token_id=0,
        eos_token_id=vocab - 1,
    )
    path = root / "target"
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def scrape(address: str) -> dict[str, float]:
    """Unlabelled samples of a /metrics page (counters, histogram sums and counts)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


def batching(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Per stage and the draft, over one cell: forwards with rows, requests per forward
    (stages), and rounds that waited for requests of the same step and how long."""

    def delta(name: str, key: str) -> float:
        return after[name].get(key, 0.0) - before[name].get(key, 0.0)

    out = {}
    for name in after:
        if name.startswith("stage"):
            n = delta(name, "specpipe:stage_batch_requests_count")
            waits = delta(name, "specpipe:stage_batch_wait_seconds_count")
            out[name] = {
                "forwards": int(n),
                "requests_per_forward": round(
                    delta(name, "specpipe:stage_batch_requests_sum") / n, 3) if n else None,
                "rounds_waited": int(waits),
                "wait_ms_mean": round(
                    1e3 * delta(name, "specpipe:stage_batch_wait_seconds_sum") / waits, 2
                ) if waits else None,
            }  # fmt: skip
        elif name.startswith("draft"):
            n = delta(name, "specpipe:draft_batch_requests_count")
            # one observation per forward (its longest wait); draft_queue_seconds, one
            # per Propose, before session 44
            waits = delta(name, "specpipe:draft_batch_queue_seconds_count")
            out[name] = {
                "forwards": int(delta(name, "specpipe:draft_forward_seconds_count")),
                "requests_per_forward": round(
                    delta(name, "specpipe:draft_batch_requests_sum") / n, 3) if n else None,
                "longest_queue_ms_mean": round(
                    1e3 * delta(name, "specpipe:draft_batch_queue_seconds_sum") / waits, 2
                ) if waits else None,
            }  # fmt: skip
    return out


def batch_summary(s: dict) -> str:
    """Forwards per stage (requests per forward) and the draft's forwards, of one cell."""
    parts = []
    for name, b in sorted(s.get("batching", {}).items()):
        if b.get("longest_queue_ms_mean") is not None:  # the draft: its forwards' waits
            parts.append(
                f"{name} {b['forwards']} ({b['requests_per_forward']}, "
                f"longest queue {b['longest_queue_ms_mean']} ms)"
            )
        elif "requests_per_forward" in b:
            parts.append(f"{name} {b['forwards']} ({b['requests_per_forward']})")
        else:
            parts.append(f"{name} {b['forwards']}")
    return " ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--modes", default="specpipe,pp,specinfer")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--row-budget", default=None, help="the router's --row-budget")
    ap.add_argument(
        "--batch-wait-ms",
        type=float,
        default=None,
        help="the stages' and draft's --batch-wait-ms (default: theirs, auto; 0: off)",
    )
    ap.add_argument("--target", default=None, help="a store model (default: a tiny random one)")
    ap.add_argument("--draft", default=None, help="with --target: its draft (default: itself)")
    ap.add_argument("--dataset", default=None, help="default random:--prompt-len")
    ap.add_argument("--out", default=str(HERE / "results" / "serve" / "serve.json"))
    ap.add_argument("--plot", action="store_true")
    args = ap.parse_args()

    from specpipe.services.client.loadgen import load_dataset, run_load, summarize
    from specpipe.services.launcher import ServicesDeployment

    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    draft = "oracle"
    if args.target:
        from specpipe.common.model.config import ModelConfig
        from specpipe.common.store.store import ModelStore

        store = ModelStore()
        target = store.root / args.target
        draft = store.root / args.draft if args.draft else "oracle"
        args.vocab = ModelConfig.from_dir(target).vocab_size
    else:
        target = make_model(tmp, args.layers, args.hidden, args.vocab)
    dataset = args.dataset or f"random:{args.prompt_len}"
    scheduling = {"max_running": 64, "max_waiting": 256, "row_budget": args.row_budget}
    wait = None if args.batch_wait_ms is None else args.batch_wait_ms / 1e3
    dep = ServicesDeployment(
        target, draft, args.stages, threads=1, scheduling=scheduling, metrics=True,
        batch_wait=wait,
    )  # fmt: skip
    dep.start()
    addrs = {n: a for n, a in dep.metrics_addresses().items() if n != "router"}
    rows = []
    try:
        for mode in args.modes.split(","):
            for conc in (int(c) for c in args.concurrency.split(",")):
                n = conc * args.requests_per_client
                prompts = load_dataset(dataset, n, args.vocab - 1, seed=conc)
                kwargs = dict(mode=mode, max_new_tokens=args.max_new_tokens, ignore_eos=True)
                if mode != "pp":
                    kwargs["width"] = args.width
                before = {n: scrape(a) for n, a in addrs.items()}
                results, wall = asyncio.run(run_load(dep.router_address, prompts, conc, **kwargs))
                s = summarize(results, wall)
                s["batching"] = batching(before, {n: scrape(a) for n, a in addrs.items()})
                rows.append({"mode": mode, "concurrency": conc, **s})
                print(
                    f"{mode:9s} c={conc:2d}  {s['output_throughput']:8.1f} tok/s  "
                    f"TTFT p50 {s['ttft_ms']['p50']:8.1f} ms  TBT p50 {s['tbt_ms']['p50']:7.1f} "
                    f"p99 {s['tbt_ms']['p99']:7.1f} ms  tokens/step {s['mean_tokens_per_step']:.3f}"
                    f"  failed {s['failed']}  {batch_summary(s)}",
                    flush=True,
                )
    finally:
        dep.stop()
    by = {(r["mode"], r["concurrency"]): r["output_throughput"] for r in rows}
    ratios = {}
    if ("specpipe", 8) in by and ("specpipe", 1) in by:
        ratios["specpipe_8_over_1"] = round(by["specpipe", 8] / by["specpipe", 1], 3)
    if ("specpipe", 8) in by and ("pp", 8) in by:
        ratios["specpipe_over_pp_at_8"] = round(by["specpipe", 8] / by["pp", 8], 3)
    print(json.dumps(ratios))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "args": vars(args),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load_average": os.getloadavg(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows, "ratios": ratios}, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.4))
        for mode in args.modes.split(","):
            pts = [(r["concurrency"], r["output_throughput"]) for r in rows if r["mode"] == mode]
            ax.plot(*zip(*pts, strict=True), marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("output tokens / s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
