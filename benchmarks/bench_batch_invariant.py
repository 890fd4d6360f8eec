"""Batch-invariant bf16 rows (`common/model/batch_invariant.py`, issue 34's peer target:
tokens equal to the served-dtype reference): which operations give a tree row other bits
than the same row decoded alone, and what making them invariant costs.

Part 1, `--check`: a chain of three tokens decoded one row a step (plain decoding) and
the same chain inside one tree batch of 7 rows, through a whole bf16 model (Qwen2.5-1.5B
from the model store when it is there, else a random stage of its shape), invariance
off and on; per operation kind, how many calls give the chain's row other bits than the
same operation on that row's input alone (the linears, RMSNorm), or other bits from the
same query (attention), and whether the final hidden states are equal.

Part 2, costs: process CPU time (all threads; the median of `--repeats` after a warm-up)
of one stage forward over `--layers` layers of Qwen2.5-1.5B's shape (random weights,
packed as served), per row count (1: plain decoding; more: a verification's tree rows,
one request's or several requests') and context, invariance off and on in alternation,
and of a prefill chunk.

    python benchmarks/bench_batch_invariant.py --check --out benchmarks/results/batch-invariant.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from specpipe.common.model import layers as model_layers
from specpipe.common.model.batch_invariant import make_batch_invariant
from specpipe.common.model.loading import load_stage
from specpipe.common.model.packed_linear import pack_linears
from specpipe.common.model.partition import LayerRange
from specpipe.common.model.synthetic import QWEN25_1_5B, random_stage
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation

MODEL = Path.home() / ".cache/specpipe/models/qwen2.5-coder-1.5b-instruct"
BF16 = torch.bfloat16


def ids(*x: int) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


@contextmanager
def recorded(calls: list):
    """Every projection, attention, RMSNorm and RoPE call of the model's forward, as (kind,
    input, output, the call again on another input or None)."""
    project, attend, norm, rope = (
        model_layers.project,
        model_layers.attend_layer,
        model_layers.RMSNorm.forward,
        model_layers.apply_rope,
    )

    def rec_project(layer, x):
        y = project(layer, x)
        calls.append(
            (f"linear {layer.in_features}->{layer.out_features}", x, y, lambda z: project(layer, z))
        )
        return y

    def rec_attend(q, step, layer):
        y = attend(q, step, layer)
        calls.append(("attention", q, y, None))
        return y

    def rec_norm(self, x):
        y = norm(self, x)
        calls.append(("rms_norm", x, y, lambda z: norm(self, z)))
        return y

    def rec_rope(x, cos, sin):
        y = rope(x, cos, sin)
        calls.append(("rope", x, y, None))
        return y

    model_layers.project, model_layers.attend_layer = rec_project, rec_attend
    model_layers.RMSNorm.forward, model_layers.apply_rope = rec_norm, rec_rope
    try:
        yield
    finally:
        model_layers.project, model_layers.attend_layer = project, attend
        model_layers.RMSNorm.forward, model_layers.apply_rope = norm, rope


def check(model) -> dict:
    """Part 1 on `model` (see the module docstring)."""
    stage = StageRuntime(model, max_cache_bytes=64 << 20)
    prompt = list(range(1000, 1040))
    p, chain = len(prompt), [785, 1565, 29696]
    with torch.inference_mode():
        for rid in ("alone", "tree"):
            stage.open(rid, 256)
            stage.forward(Activation(rid, torch.arange(p), committed=True, tokens=ids(*prompt)))
        lone = []
        for i, tok in enumerate(chain):
            calls: list = []
            with recorded(calls):
                out = stage.forward(
                    Activation(
                        "alone", ids(p + i), node_ids=ids(i), parent_ids=ids(i - 1), tokens=ids(tok)
                    )
                )
            lone.append((calls, out.hidden[0]))
        # node, parent, depth, token: the chain (nodes 0-2) with siblings around it
        nodes = [
            (10, -1, 0, 151),
            (0, -1, 0, chain[0]),
            (1, 0, 1, chain[1]),
            (11, 0, 1, 42),
            (12, 10, 1, 7),
            (2, 1, 2, chain[2]),
            (13, 1, 2, 99),
        ]
        tree_calls: list = []
        with recorded(tree_calls):
            out = stage.forward(
                Activation(
                    "tree",
                    ids(*[p + d for _, _, d, _ in nodes]),
                    node_ids=ids(*[n for n, *_ in nodes]),
                    parent_ids=ids(*[q for _, q, _, _ in nodes]),
                    tokens=ids(*[t for *_, t in nodes]),
                )
            )
    row_of = {n: r for r, (n, *_) in enumerate(nodes)}
    result = {"rows": len(nodes), "chain": []}
    for i, (calls, hidden) in enumerate(lone):
        r = row_of[i]
        differ: Counter = Counter()
        for (kind, xa, ya, _), (_, xb, yb, again) in zip(calls, tree_calls, strict=True):
            if again is not None:
                with torch.inference_mode():
                    differ[kind] += not torch.equal(again(xb[r : r + 1])[0], yb[r])
            elif kind == "attention" and torch.equal(xa[0], xb[r]):
                differ[kind] += not torch.equal(ya[0], yb[r])
        result["chain"].append(
            {
                "node": i,
                "row": r,
                "final_hidden_equal": bool(torch.equal(hidden, out.hidden[r])),
                "calls_differing": dict(differ),
                "calls": len(calls),
            }
        )
    return result


def stage_forward_cpu(model, rows: int, context: int, requests: int, repeats: int) -> float:
    """Median process CPU seconds of one forward of `rows` tree rows (split over
    `requests` requests, each a root and its children) at `context` committed keys;
    rows 0: a prefill chunk of `context` rows instead."""
    stage = StageRuntime(model, max_cache_bytes=256 << 20)
    acts = []
    for i in range(requests):
        stage.open(f"r{i}", context + rows + 8)
        if rows:
            pre = Activation(
                f"r{i}", torch.arange(context), committed=True, tokens=torch.arange(context) % 1000
            )
            with torch.inference_mode():
                stage.forward(pre)
            n = rows // requests
            parents = ids(-1, *([0] * (n - 1)))
            positions = torch.full((n,), context + 1)
            positions[0] = context
            acts.append(
                Activation(
                    f"r{i}",
                    positions,
                    node_ids=torch.arange(n),
                    parent_ids=parents,
                    tokens=torch.arange(n) + 7,
                )
            )
        else:
            acts.append(
                Activation(
                    f"r{i}",
                    torch.arange(context),
                    committed=True,
                    tokens=torch.arange(context) % 1000,
                )
            )
    step = stage.prepare_step(acts)
    try:
        ((x, positions, batch),) = step.inputs
        times = []
        with torch.inference_mode():
            for _ in range(repeats + 1):
                t0 = time.process_time()
                model.forward_batch(model.embed(x), positions, batch)
                times.append(time.process_time() - t0)
    finally:
        stage.abandon_step(step)
    return statistics.median(times[1:])


def costs(args) -> list[dict]:
    """Part 2 (see the module docstring)."""
    plain = random_stage(QWEN25_1_5B, LayerRange(0, args.layers, 28), BF16)
    pack_linears(plain)
    invariant = random_stage(QWEN25_1_5B, LayerRange(0, args.layers, 28), BF16)
    pack_linears(invariant)
    make_batch_invariant(invariant)
    cases = [(r, c, 1) for c in args.context for r in args.rows]
    cases += [(r, c, 4) for c in args.context for r in (8, 24)]
    cases += [(0, c, 1) for c in args.prefill]
    out = []
    for rows, context, requests in cases:
        runs: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(args.rounds):  # alternating, the machine is shared
            runs["off"].append(stage_forward_cpu(plain, rows, context, requests, args.repeats))
            runs["on"].append(stage_forward_cpu(invariant, rows, context, requests, args.repeats))
        off, on = (min(runs[k]) * 1e3 for k in ("off", "on"))
        row = {
            "rows": rows or context,
            "prefill": rows == 0,
            "context": context,
            "requests": requests,
            "cpu_ms_off": round(off, 2),
            "cpu_ms_on": round(on, 2),
            "ratio": round(on / off, 3),
        }
        what = (
            f"prefill {context:4d} rows"
            if rows == 0
            else (f"{rows:2d} tree rows x{requests} requests, context {context:4d}")
        )
        print(
            f"{what}: {off:7.2f} -> {on:7.2f} ms CPU per {args.layers} layers ({on / off:.3f}x)",
            flush=True,
        )
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="part 1 too (loads the whole model)")
    ap.add_argument("--no-costs", action="store_true")
    ap.add_argument("--layers", type=int, default=4, help="of Qwen2.5-1.5B's 28, for part 2")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 7, 16, 33])
    ap.add_argument("--context", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--prefill", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {"threads": args.threads, "torch": torch.__version__}
    if args.check:
        real = MODEL.is_dir()
        result["check_model"] = str(MODEL) if real else "random, Qwen2.5-1.5B's shape"
        for on in (False, True):
            if real:
                model = load_stage(MODEL, dtype=BF16, batch_invariant=on)
            else:
                model = random_stage(QWEN25_1_5B, LayerRange(0, 28, 28), BF16)
                pack_linears(model)
                if on:
                    make_batch_invariant(model)
            found = check(model)
            result[f"check_invariant_{'on' if on else 'off'}"] = found
            for c in found["chain"]:
                print(
                    f"invariance {'on ' if on else 'off'}: chain node {c['node']} (row "
                    f"{c['row']} of {found['rows']}): final hidden equal "
                    f"{c['final_hidden_equal']}, calls differing {c['calls_differing']} "
                    f"of {c['calls']}",
                    flush=True,
                )
            del model
    if not args.no_costs:
        result["layers"] = args.layers
        result["costs"] = costs(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
