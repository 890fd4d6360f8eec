"""A lean forward (issue 34, point 6): operations per decoder layer of one stage step and
the CPU time of a step, for comparing the code before and after a change to the layers.

- **ops per layer**: aten operations one stage step dispatches (every op, views
  included, and those that run a kernel), as the difference between a 3-layer and a
  1-layer stage of tiny width, halved (the count does not depend on sizes), at 1 and 8
  requests of one tree row each;
- **CPU time per step**: process CPU seconds (fair on a shared machine) of one
  `StageRuntime.forward_many` on a Qwen2.5-1.5B-shaped stage of `--layers` layers with
  random weights (bf16 linears packed for oneDNN, as `load_stage` does), 1 and 8
  requests of one row over 1,000 cached tokens each; median of `--repeats` after one
  warm-up.

    .venv/bin/python benchmarks/bench_lean.py --label after

Results: benchmarks/results/engine/lean-<label>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_engine import ALIASES, RESULTS, OpCounter, Requests, qwen_coder_1_5b, tree_rows
from specpipe.common.model.layers import StageModel
from specpipe.common.model.packed_linear import pack_linears, packing_applies
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime.stage import StageRuntime


def stage_of(layers: int, dtype: torch.dtype, **over) -> StageRuntime:
    """A first stage of `layers` layers (of 2 * layers) with random weights."""
    cfg = qwen_coder_1_5b(num_layers=2 * layers, **over)
    with torch.device("meta"):
        model = StageModel(cfg, LayerRange(0, layers, 2 * layers))
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones(p.shape) if "norm" in name else torch.randn(p.shape, generator=g))
            if "norm" not in name:
                p.mul_(0.02)
    model = model.to(dtype).eval().requires_grad_(False)
    if packing_applies(dtype, "cpu"):
        pack_linears(model)
    return StageRuntime(model, max_cache_bytes=4 << 30)


def count_ops(layers: int, requests: int) -> tuple[int, int]:
    """(all ops, ops that run a kernel) of one step of `requests` one-row requests."""
    tiny = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4, head_dim=16)
    stage = stage_of(layers, torch.float32, **tiny)
    reqs = Requests(stage, requests, 1)
    reqs.step()
    acts = [tree_rows(rid, 1, reqs.next_id) for rid in reqs.rids]
    with OpCounter() as counter:
        stage.forward_many(acts)
    reqs.close()
    total = sum(counter.ops.values())
    return total, total - sum(v for k, v in counter.ops.items() if k in ALIASES)


def ops_per_layer(requests: int) -> dict:
    (a3, k3), (a1, k1) = count_ops(3, requests), count_ops(1, requests)
    return {"requests": requests, "ops": (a3 - a1) / 2, "kernels": (k3 - k1) / 2}


def cpu_per_step(layers: int, dtype: torch.dtype, requests: int, repeats: int) -> float:
    stage = stage_of(layers, dtype)
    reqs = Requests(stage, requests, 1)
    reqs.step()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        reqs.step()
        times.append(time.process_time() - t0)
    reqs.close()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="after")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    record: dict = {"label": args.label, "torch": torch.__version__, "layers": args.layers}
    record["ops_per_layer"] = [ops_per_layer(n) for n in (1, 8)]
    for r in record["ops_per_layer"]:
        print(f"ops per layer, {r['requests']} requests: {r['ops']} ({r['kernels']} kernels)")
    record["cpu_ms_per_step"] = {}
    for name in ("bfloat16", "float32"):
        for n in (1, 8):
            ms = cpu_per_step(args.layers, getattr(torch, name), n, args.repeats) * 1e3
            record["cpu_ms_per_step"][f"{name} x{n}"] = ms
            print(f"CPU per step, {args.layers} layers, {name}, {n} requests: {ms:.1f} ms")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"lean-{args.label}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
