"""The forward of `bench_host.py`'s deployment, alone (issue 34, point 6 "a lean forward"):
the torch operations one stage step and one draft step issue, and the CPU time they take.

The model is `bench_host.py`'s tiny random Llama (8 layers, hidden 64, one head of 64,
vocabulary 512), served as 4 stages of 2 layers and as its own draft (all 8 layers and
the head). Each request has `--context` cached tokens and adds a tree layer of `--rows`
rows per step (what a step of the emulated deployment computes), at 1 and 8 requests.

- **ops**: aten operations (a `TorchDispatchMode`, every op counted, views included; "kernels":
  those that are not views, aliases or no-op casts) of the model's forward on a prepared
  step (`StageModel.forward_batch`, plus `logits` for the draft), of the step's input
  building (`StageRuntime.prepare_step`: `paged_batch.pack`'s index tensors and mask), and
  per decoder layer ((7-layer forward - 2-layer forward) / 5).
- **CPU per forward**: process CPU seconds (fair on a shared machine) of the same calls,
  `--repeats` times in a row after a warm-up, best of `--rounds` rounds, one torch thread
  (a step this small runs on one; more only adds thread wake-ups).

    .venv/bin/python benchmarks/bench_forward.py --label after

Writes results/forward/<label>.json and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import torch
from bench_serve import make_model
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation, Prune
from torch.utils._python_dispatch import TorchDispatchMode

OUT = Path(__file__).resolve().parent / "results" / "forward"


@cache
def tiny_llama() -> Path:
    """bench_host.py's model, saved once per process (its weights' scale matters: a
    model of tiny weights computes on denormals, which are slow)."""
    return make_model(Path(tempfile.mkdtemp(prefix="bench-forward-")), 8, 64, 512)


NOT_KERNELS = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "slice",
               "select", "split", "split_with_sizes", "unsqueeze", "squeeze", "expand",
               "alias", "as_strided", "detach", "lift_fresh", "narrow", "unbind", "to",
               "_to_copy_noop", "resolve_conj", "resolve_neg", "chunk"}  # fmt: skip


class AtenOps(TorchDispatchMode):
    """Counts every aten operation dispatched in its block, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def kernels(self) -> int:
        return sum(v for k, v in self.ops.items() if k not in NOT_KERNELS)


class Deployment:
    """One process of the deployment: a stage (`layers`) or the draft (every layer and the
    head), with `requests` open requests of `context` cached tokens."""

    def __init__(self, layers: LayerRange, requests: int, context: int, rows: int) -> None:
        model = load_stage(tiny_llama(), layers, torch.float32)
        self.cfg = model.cfg
        self.stage = StageRuntime(model, max_cache_bytes=64 << 20)
        self.rows, self.next_id = rows, 1000
        self.rids = [f"r{i}" for i in range(requests)]
        for rid in self.rids:
            self.stage.open(rid, context + 4 * rows + 16)
            self.stage.forward_many([self._act(rid, torch.arange(context), None, None)])

    def _act(self, rid: str, positions, node_ids, parent_ids) -> Activation:
        n = positions.numel()
        act = Activation(rid, positions, node_ids=node_ids, parent_ids=parent_ids)
        if node_ids is None:
            act = Activation(rid, positions, committed=True)
        g = torch.Generator().manual_seed(n)
        if self.stage.is_first:
            act.tokens = torch.randint(0, self.cfg.vocab_size, (n,), generator=g)
        else:
            act.hidden = torch.randn(n, self.cfg.hidden_size, generator=g)
        return act

    def tree_layer(self) -> list[Activation]:
        """Each request's next tree layer: `rows` siblings under the committed prefix."""
        acts = []
        for rid in self.rids:
            cache = self.stage._cache(rid)
            ids = torch.arange(self.next_id, self.next_id + self.rows)
            positions = torch.full((self.rows,), cache.n_committed)
            acts.append(self._act(rid, positions, ids, torch.full((self.rows,), -1)))
        return acts

    def drop_tree(self) -> None:
        """Prune the step's rows (nothing committed), so the next step is the same shape."""
        self.next_id += self.rows
        empty = torch.empty(0, dtype=torch.int64)
        for rid in self.rids:
            self.stage.prune(rid, Prune(empty, empty, self.next_id - 1))

    @contextlib.contextmanager
    def prepared(self) -> Iterator[tuple[Callable[[], object], Callable[[], object]]]:
        """(the model's forward on a prepared step, the step's input building), while the
        step is prepared (abandoned after): each callable repeats its work with the same
        inputs (the K/V writes rewrite the same slots)."""
        step = self.stage.prepare_step(self.tree_layer())
        try:
            ((x, positions, batch),) = step.inputs
            (run,) = self.stage._runs(step.batch)
            model, draft = self.stage.model, self.stage.model.layer_range.is_last

            @torch.inference_mode()
            def forward() -> object:
                hidden = model.embed(x) if self.stage.is_first else x
                hidden = model.forward_batch(hidden, positions, batch)
                return model.logits(hidden) if draft else hidden

            @torch.inference_mode()
            def build() -> object:
                return self.stage._inputs(run)

            yield forward, build
        finally:
            self.stage.abandon_step(step)

    def close(self) -> None:
        for rid in self.rids:
            self.stage.release(rid)


def count(fn: Callable[[], object]) -> AtenOps:
    with AtenOps() as counter:
        fn()
    return counter


def cpu_us(fn: Callable[[], object], repeats: int, rounds: int) -> float:
    """Best-of-`rounds` mean process CPU microseconds of one call."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(repeats):
            fn()
        best = min(best, (time.process_time() - t0) / repeats)
    return best * 1e6


def measure(name: str, layers: LayerRange, requests: int, args) -> dict:
    dep = Deployment(layers, requests, args.context, args.rows)
    with torch.inference_mode():
        step_ops = count(lambda: (dep.stage.forward_many(dep.tree_layer()), dep.drop_tree()))
    with dep.prepared() as (forward, build):
        fwd, bld = count(forward), count(build)
        forward_us = cpu_us(forward, args.repeats, args.rounds)
        build_us = cpu_us(build, args.repeats, args.rounds)
    rec = {
        "process": name,
        "layers": f"{layers.start}:{layers.end}",
        "requests": requests,
        "rows": args.rows,
        "forward_ops": fwd.total,
        "forward_kernels": fwd.kernels,
        "build_ops": bld.total,
        "step_ops": step_ops.total,
        "forward_cpu_us": forward_us,
        "build_cpu_us": build_us,
        "forward_op_names": dict(fwd.ops.most_common()),
    }
    dep.close()
    return rec


def per_layer(requests: int, args) -> dict:
    """One decoder layer's ops and CPU: (7-layer forward - 2-layer) / 5, both without the
    head."""
    recs = {}
    for end in (2, 7):
        dep = Deployment(LayerRange(0, end, 8), requests, args.context, args.rows)
        with dep.prepared() as (forward, _):
            ops = count(forward)
            recs[end] = (ops.total, ops.kernels, cpu_us(forward, args.repeats, args.rounds))
        dep.close()
    (a7, k7, t7), (a2, k2, t2) = recs[7], recs[2]
    return {
        "requests": requests,
        "ops": (a7 - a2) / 5,
        "kernels": (k7 - k2) / 5,
        "cpu_us": (t7 - t2) / 5,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="after")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    processes = {
        "stage 0 (embeds)": LayerRange(0, 2, 8),
        "stage 1": LayerRange(2, 4, 8),
        "stage 3 (last)": LayerRange(6, 8, 8),
        "draft (8 layers + head)": LayerRange(0, 8, 8),
    }
    record: dict = {"label": args.label, "torch": torch.__version__, "args": vars(args)}
    record["per_layer"] = [per_layer(n, args) for n in (1, 8)]
    record["processes"] = [
        measure(name, layers, n, args) for n in (1, 8) for name, layers in processes.items()
    ]
    lines = [
        f"## {args.label} (torch {torch.__version__}, {args.threads} thread, "
        f"{args.rows} rows per request over {args.context} cached tokens)",
        "",
        "| per decoder layer | aten ops | kernels | CPU us |",
        "|---|---|---|---|",
    ]
    for r in record["per_layer"]:
        lines.append(
            f"| {r['requests']} requests | {r['ops']:.0f} | {r['kernels']:.0f} | {r['cpu_us']:.0f} |"
        )
    lines += [
        "",
        "| process | requests | forward ops (kernels) | forward CPU us | input building ops | "
        "input building CPU us | whole step ops |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in record["processes"]:
        lines.append(
            f"| {r['process']} | {r['requests']} | {r['forward_ops']} ({r['forward_kernels']}) | "
            f"{r['forward_cpu_us']:.0f} | {r['build_ops']} | {r['build_cpu_us']:.0f} | "
            f"{r['step_ops']} |"
        )
    text = "\n".join(lines)
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.label}.json").write_text(json.dumps(record, indent=1))
    (OUT / f"{args.label}.md").write_text(text + "\n")
    print(f"saved {OUT / args.label}.json")


if __name__ == "__main__":
    main()
