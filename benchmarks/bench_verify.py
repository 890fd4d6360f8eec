"""What a verification round costs at the last stage (`verify_many`, issue 38): the LM
head, the draws and the walk of R requests whose trees reach K levels down in the
round's output, on a Qwen2.5-1.5B-shaped last stage with random weights (its norm and
151,936-token head; the layers before are not part of the round). Each request's rows:
a root, then per level W children of the node the walk reaches (one of them the token
the head draws there, so every walk goes K levels down). Greedy; CPU seconds of the
round (process time, all threads), the median of ROUNDS rounds after a warm-up, one
torch thread; and the head calls and host reads the round made.

    python benchmarks/bench_verify.py [--out results/verify.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from specpipe.common.model.partition import LayerRange
from specpipe.common.model.synthetic import QWEN25_1_5B, random_stage
from specpipe.common.runtime.verifier import RequestVerifier, verify_many
from specpipe.common.spec.messages import Activation
from specpipe.common.spec.sampling import SamplingParams
from specpipe.common.spec.verify import VerifySpec

ROUNDS = 5
WIDTH = 3
PROMPT = 100
SPEC = VerifySpec(SamplingParams(), output_start=PROMPT)


def tree_output(model, k: int, seed: int) -> Activation:
    """One request's rows of a round: a chain of K nodes the greedy walk follows, each
    with W - 1 siblings (their tokens not the drawn one)."""
    g = torch.Generator().manual_seed(seed)
    hidden_size = model.cfg.hidden_size
    dtype = next(model.parameters()).dtype
    ids, parents, tokens, hidden = [], [], [], []
    parent, token = -1, 7
    for level in range(k):
        first = len(ids)
        for j in range(1 if level == 0 else WIDTH):
            ids.append(len(ids))
            parents.append(parent)
            tokens.append(token if j == 0 else (token + 1000 * j) % model.cfg.vocab_size)
            hidden.append(torch.randn(1, hidden_size, generator=g).to(dtype))
        with torch.no_grad():
            token = int(model.logits(hidden[first]).argmax())
        parent = first
    positions = [PROMPT - 1 + len(list(_up(p, parents))) for p in parents]
    return Activation(
        "r",
        torch.tensor(positions),
        node_ids=torch.tensor(ids),
        parent_ids=torch.tensor(parents),
        hidden=torch.cat(hidden),
        row_tokens=torch.tensor(tokens),
    )


def _up(node: int, parents: list[int]):
    while node >= 0:
        yield node
        node = parents[node]


def one_round(model, outputs: list[Activation]) -> tuple[float, int, int]:
    """CPU seconds of one round, its head calls and the depth of the first walk."""
    calls = []

    def head(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return model.logits(h)

    verifiers = [RequestVerifier(f"r{i}", SPEC, head) for i in range(len(outputs))]
    t0 = time.process_time()
    with torch.no_grad():
        found = verify_many(list(zip(verifiers, outputs, strict=True)), head)
    seconds = time.process_time() - t0
    depth = min(len(f[0].tokens) for f in found)  # type: ignore[index]
    return seconds, len(calls), depth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        model = random_stage(QWEN25_1_5B, LayerRange(27, 28, 28), dtype)
        for k in args.k:
            for n in args.requests:
                outs = [tree_output(model, k, seed) for seed in range(n)]
                one_round(model, outs)  # warm-up
                runs = [one_round(model, outs) for _ in range(ROUNDS)]
                row = {
                    "dtype": str(dtype).removeprefix("torch."),
                    "k": k,
                    "requests": n,
                    "rows": sum(len(o) for o in outs),
                    "cpu_s": statistics.median(r[0] for r in runs),
                    "head_calls": runs[0][1],
                    "walk_depth": runs[0][2],
                }
                results.append(row)
                print(
                    f"{row['dtype']:>8} K={k} requests={n:2d} rows={row['rows']:3d}: "
                    f"{row['cpu_s'] * 1e3:7.1f} ms CPU, {row['head_calls']} head calls, "
                    f"walks {row['walk_depth']} deep",
                    flush=True,
                )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
