"""Prefix caching (issue 23, point 3): time to first token of 8 requests that share a
1,000-token system prompt, with and without the prefix cache, through the real services.

Two deployments of the same target run side by side (`ServicesDeployment`: a router and
S = 2 stage processes each, TCP, pp mode, no draft: the time to first token is the
prefill's), one with the prefix cache (the default) and one with `--no-prefix-cache`.
Each round draws a fresh 1,000-token system prompt (so its first request is cold on
both) and sends 8 requests, one after another, each the system prompt followed by a
user turn of its own (24 tokens), asking for 4 tokens; the client measures the time from
sending a request to its first token. Rounds alternate between the two deployments (the
order swapped every round), and each request position's figure is the best of
`--rounds` (the machine is shared: the minimum is the figure least disturbed by other
processes). The tokens of both deployments are compared (the prefix cache is exact:
equal in fp32 here; in bf16 a hit's prefill groups rows differently from a cold run's,
which changes rounding, as a different `prefill_chunk` does).

Models (random weights, made here): `--shape deep` (default), a tiny-but-deep Qwen2
(hidden 256, 24 layers, 4 query / 2 K/V heads, vocabulary 2,048): prefill compute is
small, so the figure shows what skipping chunks saves beside the services' fixed costs;
`--shape qwen1.5b`, Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12 / 2 heads of 128,
vocabulary 151,936; bf16 by default), where the prefill dominates.

    .venv/bin/python benchmarks/bench_prefix.py --rounds 3
    .venv/bin/python benchmarks/bench_prefix.py --shape qwen1.5b --rounds 2

Results go to benchmarks/results/engine/prefix-<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from specpipe.common.model.synthetic import QWEN25_1_5B

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "engine"
SYSTEM_TOKENS = 1000
USER_TOKENS = 24
REQUESTS = 8

SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)
SHAPES = {
    "deep": dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
    # Qwen2.5-Coder-1.5B's shape (the package's one copy of it)
    "qwen1.5b": {k: QWEN25_1_5B[k] for k in SHAPE_KEYS},
}


def make_model(root: Path, shape: str, dtype: torch.dtype) -> Path:
    """A Qwen2 checkpoint of `shape` with random weights, made without the slow default
    initialisation (meta device, then filled)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        **SHAPES[shape],
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=SHAPES[shape]["vocab_size"] - 1,
        torch_dtype=dtype,
    )
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(dtype))
    path = root / f"target-{shape}"
    model.save_pretrained(path)
    return path


def request_prompts(round_: int, vocab: int) -> list[list[int]]:
    """A fresh system prompt for the round; each request adds a user turn of its own."""
    g = torch.Generator().manual_seed(1000 + round_)
    system = torch.randint(1, vocab - 1, (SYSTEM_TOKENS,), generator=g).tolist()
    return [
        [*system, *torch.randint(1, vocab - 1, (USER_TOKENS,), generator=g).tolist()]
        for _ in range(REQUESTS)
    ]


def ttft(address: str, prompt: list[int]) -> tuple[float, list[int], int]:
    """Seconds from sending the request to its first token; its tokens; prefill steps."""
    from specpipe.client import Client

    with Client(address, timeout=1200) as client:
        t0 = time.perf_counter()
        stream = client.stream(
            prompt_ids=prompt, mode="pp", max_new_tokens=4, ignore_eos=True, prefill_chunk=128
        )
        first = None
        for chunk in stream:
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
        done = stream.result()
    assert first is not None
    return first, list(done.token_ids), int(done.stats["prefill_steps"])


def stage_counters(dep) -> list[dict]:
    import grpc
    from specpipe.v1 import dataplane_pb2, stage_pb2_grpc

    out = []
    for name, child in dep.children.items():
        if child.kind != "stage":
            continue
        with grpc.insecure_channel(child.info["grpc"]) as ch:
            d = stage_pb2_grpc.StageStub(ch).Describe(dataplane_pb2.DescribeRequest(), timeout=30)
        out.append(
            {
                "stage": name,
                "prefix_caching": d.prefix_caching,
                "queries": d.prefix_cache_queries,
                "hits": d.prefix_cache_hits,
                "blocks_cached": d.cache_blocks_cached,
            }
        )
    return out


def run(args) -> dict:
    from specpipe.services.launcher import ServicesDeployment

    dtype = getattr(torch, args.dtype)
    root = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    print(f"making a {args.shape} model ...", flush=True)
    target = make_model(root, args.shape, dtype)
    vocab = SHAPES[args.shape]["vocab_size"]
    deps = {
        label: ServicesDeployment(
            target,
            None,
            2,
            transport="tcp",
            threads=args.threads,
            dtype=args.dtype,
            max_cache_gib=args.cache_gib,
            secure=False,
            prefix_cache=label == "cache",
            startup_timeout=1200,
        )
        for label in ("cache", "no cache")
    }
    times: dict[str, list[list[float]]] = {label: [] for label in deps}
    steps: dict[str, list[list[int]]] = {label: [] for label in deps}
    same = 0  # requests whose tokens both deployments agree on
    try:
        for label, dep in deps.items():
            print(f"starting {label} ...", flush=True)
            dep.start()
            ttft(dep.router_address, list(range(1, 40)))  # warm-up, unrelated prompt
        for r in range(args.rounds):
            prompts = request_prompts(r, vocab)
            order = list(deps) if r % 2 == 0 else list(deps)[::-1]
            outputs = {}
            for label in order:
                got = [ttft(deps[label].router_address, p) for p in prompts]
                times[label].append([t for t, _, _ in got])
                steps[label].append([s for _, _, s in got])
                outputs[label] = [o for _, o, _ in got]
                print(
                    f"  round {r} {label:8s} TTFT ms: "
                    + " ".join(f"{1e3 * t:7.1f}" for t, _, _ in got),
                    flush=True,
                )
            same += sum(a == b for a, b in zip(*outputs.values(), strict=True))
        counters = {label: stage_counters(dep) for label, dep in deps.items()}
    finally:
        for dep in deps.values():
            dep.stop()
    result: dict = {
        "shape": args.shape,
        "dtype": args.dtype,
        "rounds": args.rounds,
        "threads_per_process": args.threads,
        "system_tokens": SYSTEM_TOKENS,
        "user_tokens": USER_TOKENS,
        "identical_requests": f"{same} of {REQUESTS * args.rounds}",
        "stages": counters,
    }
    for label in deps:
        best = [min(col) for col in zip(*times[label], strict=True)]
        med = [statistics.median(col) for col in zip(*times[label], strict=True)]
        result[label] = {
            "best_ms": [round(1e3 * t, 1) for t in best],
            "median_ms": [round(1e3 * t, 1) for t in med],
            "prefill_steps": steps[label][0],
            "later_over_first_best": round(statistics.mean(best[1:]) / best[0], 3),
        }
    return result


def table(rec: dict) -> str:
    lines = [
        "| request | with the prefix cache: best (median) ms | prefill chunks | "
        "without: best (median) ms | prefill chunks |",
        "|---|---|---|---|---|",
    ]
    c, n = rec["cache"], rec["no cache"]
    for i in range(REQUESTS):
        lines.append(
            f"| {i + 1} | {c['best_ms'][i]} ({c['median_ms'][i]}) | {c['prefill_steps'][i]} | "
            f"{n['best_ms'][i]} ({n['median_ms'][i]}) | {n['prefill_steps'][i]} |"
        )
    lines.append(
        f"\nlater / first (mean of requests 2-8 over request 1, best): with the cache "
        f"{c['later_over_first_best']}, without {n['later_over_first_best']}; "
        f"requests with identical tokens: {rec['identical_requests']}"
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", choices=list(SHAPES), default="deep")
    p.add_argument("--dtype", default=None, help="default: float32 (deep), bfloat16 (qwen1.5b)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--cache-gib", type=float, default=1.0, help="KV budget per stage")
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.shape == "qwen1.5b" else "float32")
    rec = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"prefix-{args.shape}.json"
    out.write_text(json.dumps(rec, indent=1))
    print(table(rec))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
