"""`specpipe bench serve`: load a running router and report throughput and latency."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from .args import DEFAULT_ROUTER_PORT, CliError, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks against a running deployment")
    bsub = bench.add_subparsers(dest="bench_command", required=True, parser_class=type(bench))
    p = bsub.add_parser(
        "serve",
        help="closed-loop (or Poisson) load through the router: throughput, TTFT, TBT, errors",
    )
    p.add_argument("--router", default=f"127.0.0.1:{DEFAULT_ROUTER_PORT}", help="HOST:PORT")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=positive_int, default=8, help="requests in flight")
    p.add_argument("--num-requests", type=positive_int, default=32)
    p.add_argument(
        "--dataset",
        default="chat",
        help="humaneval, chat, random:LEN (random token ids) or a JSONL file "
        '(lines with "prompt" or "prompt_ids")',
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--mode", default="specpipe", help="specpipe, pp, specinfer or autoregressive")
    p.add_argument("--width", type=positive_int, default=None)
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals per second (default: closed loop, as fast as answers come)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    p.add_argument("--out", default=None, help="save the results here (JSON; a .png beside it)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specpipe.services.client import Client, SpecPipeError
    from specpipe.services.client.loadgen import load_dataset, run_load, summarize

    try:
        with Client(args.router, timeout=30, api_key=args.api_key) as c:
            models = c.list_models()
    except SpecPipeError as e:
        raise CliError(f"cannot reach the router at {args.router}: {e.message}") from None
    if not models:
        raise CliError(f"the router at {args.router} serves no model yet")
    try:
        prompts = load_dataset(args.dataset, args.num_requests, models[0].vocab_size, args.seed)
    except (OSError, ValueError, KeyError) as e:
        raise CliError(f"--dataset {args.dataset}: {e}") from None
    kwargs = dict(
        mode=args.mode,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        priority=args.priority,
    )
    if args.width is not None:
        kwargs["width"] = args.width
    bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=args.json)
    results, wall = asyncio.run(
        run_load(
            args.router,
            prompts,
            args.concurrency,
            args.request_rate,
            args.api_key,
            on_done=lambda _: bar.update(1),
            **kwargs,
        )
    )
    bar.close()
    summary = {
        "config": {
            k: getattr(args, k)
            for k in ("concurrency", "num_requests", "dataset", "max_new_tokens", "mode")
        }
        | {"request_rate": args.request_rate, "width": args.width, "model": models[0].id},
        **summarize(results, wall),
    }
    if args.out:
        _save(Path(args.out), summary, results)
    if args.json:
        print(json.dumps(summary))
    else:
        _print(summary)
    return 0 if summary["failed"] == 0 else 1


def _print(s: dict) -> None:
    out = sys.stdout
    print(f"requests {s['completed']}/{s['requests']} in {s['duration_s']} s", file=out)
    print(
        f"throughput {s['output_throughput']} tokens/s, {s['request_throughput']} requests/s",
        file=out,
    )
    for key, name in (("ttft_ms", "TTFT"), ("tbt_ms", "TBT"), ("itl_ms", "ITL")):
        p = s[key]
        print(f"{name:5s} ms  p50 {p['p50']:9.2f}  p90 {p['p90']:9.2f}  p99 {p['p99']:9.2f}")
    print(f"tokens/step (mean over requests) {s['mean_tokens_per_step']}")
    if s["errors"]:
        print(f"errors {s['errors']}")


def _save(path: Path, summary: dict, results) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {"ok": r.ok, "error": r.error, "output_tokens": r.output_tokens, "ttft_s": r.ttft,
         "tbt_s": r.tbt, "latency_s": r.end - r.start}
        for r in results
    ]  # fmt: skip
    path.write_text(json.dumps({"summary": summary, "requests": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the `bench` extra is not installed: JSON only
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, key, label in ((axes[0], "ttft_s", "TTFT (ms)"), (axes[1], "tbt_s", "TBT (ms)")):
        values = [1e3 * r[key] for r in rows if r[key] is not None]
        ax.hist(values, bins=20)
        ax.set_xlabel(label)
        ax.set_ylabel("requests")
    fig.suptitle(
        f"{summary['config']['mode']}, concurrency {summary['config']['concurrency']}: "
        f"{summary['output_throughput']} tokens/s"
    )
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)
