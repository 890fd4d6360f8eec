"""The forward of `bench_host.py`'s deployment, alone (issue 34, point 6 "a lean forward"):
the torch operations one stage step and one draft step issue, and the CPU time they take.

The model is `bench_host.py`'s tiny random Llama (8 layers, hidden 64, one head of 64,
vocabulary 512), served as 4 stages of 2 layers and as its own draft (all 8 layers and
the head; the draft's as `load_draft` serves it, `lean_draft`). Each request has `--context` cached tokens and adds a tree layer of `--rows`
rows per step (what a step of the emulated deployment computes), at 1 and 8 requests.

- **ops**: aten operations (a `TorchDispatchMode`, every op counted, views included; "kernels":
  those that are not views, aliases or no-op casts) of the model's forward on a prepared
  step (`StageModel.forward_batch`, plus `logits` for the draft), of the step's input
  building (`StageRuntime._inputs`: `paged_batch.pack`'s index tensors and mask), of the
  whole step (`StageRuntime.forward_many`: the host's bookkeeping tensors too), and per
  decoder layer ((7-layer forward - 2-layer forward) / 5).
- **CPU per forward**: process CPU seconds (fair on a shared machine) of the same calls,
  `--repeats` times in a row after a warm-up, best of `--rounds` rounds, one torch thread
  (what `specpipe up` gives each of this deployment's 5 model processes on 2 cores).

`--baseline DIR` (a copy of another version's common/model) times that version's
`StageModel` too, with the same weights on the same prepared steps, the two taking turns
in every round, so that a comparison on a loaded machine sees the same load; the
after / before column is the median over rounds of the two's ratio:

    git archive a2cf155 common/model | tar -x -C /tmp/base
    .venv/bin/python benchmarks/bench_forward.py --baseline /tmp/base/common/model

Writes results/forward/<label>.json and .md (the tables printed).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import torch
from bench_serve import make_model
from specpipe.common.model.lean_draft import lean_draft
from specpipe.common.model.loading import load_stage
from specpipe.common.model.packed_linear import packing_applies
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation, Prune
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

Forward = Callable[[], object]
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

    def __init__(
        self,
        layers: LayerRange,
        requests: int,
        context: int,
        rows: int,
        dtype: torch.dtype = torch.float32,
        lean: bool = False,
    ) -> None:
        """`lean`: the model as a draft serves it (`load_draft`: `lean_draft`)."""
        model = load_stage(tiny_llama(), layers, dtype)
        if lean:
            model = lean_draft(model)
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
    def prepared(self) -> Iterator[tuple[Callable[[nn.Module], Forward], Forward]]:
        """(a forward of a given model on a prepared step, the step's input building),
        while the step is prepared (abandoned after): each repeats its work with the same
        inputs (the K/V writes rewrite the same slots)."""
        step = self.stage.prepare_step(self.tree_layer())
        try:
            ((x, positions, batch),) = step.inputs
            (run,) = self.stage._runs(step.batch)
            first, last = self.stage.is_first, self.stage.model.layer_range.is_last

            def forward_of(model: nn.Module) -> Forward:
                @torch.inference_mode()
                def forward() -> object:
                    hidden = model.embed(x) if first else x
                    hidden = model.forward_batch(hidden, positions, batch)
                    return model.logits(hidden) if last else hidden

                return forward

            @torch.inference_mode()
            def build() -> object:
                return self.stage._inputs(run)

            yield forward_of, build
        finally:
            self.stage.abandon_step(step)

    def close(self) -> None:
        for rid in self.rids:
            self.stage.release(rid)


def count(fn: Forward) -> AtenOps:
    with AtenOps() as counter:
        fn()
    return counter


def count_warm(fn: Forward) -> AtenOps:
    """The ops of a forward's second call: a version's first forward also builds its
    cached constants (RoPE's frequencies), which a per-layer difference would count."""
    fn()
    return count(fn)


def cpu_us(fns: dict[str, Forward], repeats: int, rounds: int) -> dict[str, list[float]]:
    """Per callable, the mean process CPU microseconds of one call in each of `rounds`
    rounds of `repeats` calls; the callables take turns in every round, so that a
    comparison sees the same load."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.process_time()
            for _ in range(repeats):
                fn()
            times[name].append((time.process_time() - t0) / repeats * 1e6)
    return times


def ratio(times: dict[str, list[float]]) -> float | None:
    """The median over rounds of after / before (None without a baseline): steadier than
    either's best on a loaded machine, since the two ran side by side in each round."""
    if "before" not in times:
        return None
    return statistics.median(a / b for a, b in zip(times["after"], times["before"], strict=True))


def baseline_class(path: Path) -> type[nn.Module]:
    """The `StageModel` of another version of common/model (a copy of the folder), imported
    as a package of its own beside this one."""
    root = Path(tempfile.mkdtemp(prefix="bench-forward-baseline-"))
    shutil.copytree(path, root / "baseline_model")
    sys.path.insert(0, str(root))
    return importlib.import_module("baseline_model.layers").StageModel


def models(dep: Deployment, baseline: type[nn.Module] | None) -> dict[str, nn.Module]:
    """This version's model of `dep` and, given a baseline, the same weights in its."""
    out: dict[str, nn.Module] = {}
    if baseline is not None:
        ours = dep.stage.model
        plain = load_stage(tiny_llama(), ours.layer_range, ours.dtype, pack=False)
        model = baseline(dep.cfg, ours.layer_range).to(ours.dtype)
        model.load_state_dict(plain.state_dict())
        if packing_applies(ours.dtype, "cpu"):  # as load_stage does
            importlib.import_module("baseline_model.packed_linear").pack_linears(model)
        out["before"] = model.eval().requires_grad_(False)
    out["after"] = dep.stage.model
    return out


def measure(name: str, layers: LayerRange, requests: int, args, baseline) -> dict:
    draft = layers.is_first and layers.is_last  # served lean (`load_draft`)
    dep = Deployment(layers, requests, args.context, args.rows, args.dtype, lean=draft)
    with torch.inference_mode():
        acts = dep.tree_layer()
        step_ops = count(lambda: dep.stage.forward_many(acts))
    dep.drop_tree()
    with dep.prepared() as (forward_of, build):
        forwards = {k: forward_of(m) for k, m in models(dep, baseline).items()}
        ops = {k: count_warm(fn) for k, fn in forwards.items()}
        build_ops = count(build)
        times = cpu_us({**forwards, "build": build}, args.repeats, args.rounds)
        best = {k: min(v) for k, v in times.items()}
    dep.close()
    return {
        "process": name,
        "layers": f"{layers.start}:{layers.end}",
        "requests": requests,
        "rows": args.rows,
        "forward_ops": {k: c.total for k, c in ops.items()},
        "forward_kernels": {k: c.kernels for k, c in ops.items()},
        "forward_cpu_us": {k: best[k] for k in forwards},
        "forward_cpu_ratio": ratio(times),
        "build_ops": build_ops.total,
        "build_cpu_us": best["build"],
        "step_ops": step_ops.total,
        "forward_op_names": {k: dict(c.ops.most_common()) for k, c in ops.items()},
    }


def per_layer(requests: int, args, baseline) -> dict:
    """One decoder layer's ops and CPU: (7-layer forward - 2-layer) / 5, both without the
    head."""
    recs: dict[int, dict] = {}
    for end in (2, 7):
        dep = Deployment(LayerRange(0, end, 8), requests, args.context, args.rows, args.dtype)
        with dep.prepared() as (forward_of, _):
            forwards = {k: forward_of(m) for k, m in models(dep, baseline).items()}
            ops = {k: count_warm(fn) for k, fn in forwards.items()}
            times = cpu_us(forwards, args.repeats, args.rounds)
        recs[end] = {k: (ops[k].total, ops[k].kernels, min(times[k])) for k in forwards}
        dep.close()
    return {
        "requests": requests,
        **{
            k: {
                f: (recs[7][k][i] - recs[2][k][i]) / 5
                for i, f in enumerate(("ops", "kernels", "cpu_us"))
            }
            for k in recs[2]
        },
    }


def arrow(values: dict[str, float], fmt: str) -> str:
    """'before -> after', or the one value."""
    return " -> ".join(format(v, fmt) for v in values.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="after")
    ap.add_argument("--baseline", type=Path, help="a copy of another version's common/model")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    args = ap.parse_args()
    args.dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    baseline = baseline_class(args.baseline) if args.baseline else None
    processes = {
        "stage 0 (embeds)": LayerRange(0, 2, 8),
        "stage 1": LayerRange(2, 4, 8),
        "stage 3 (last: + head)": LayerRange(6, 8, 8),
        "draft (8 layers + head)": LayerRange(0, 8, 8),
    }
    record: dict = {
        "label": args.label,
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    record["per_layer"] = [per_layer(n, args, baseline) for n in (1, 8)]
    record["processes"] = [
        measure(name, layers, n, args, baseline)
        for n in (1, 8)
        for name, layers in processes.items()
    ]
    versions = " (before -> after)" if baseline else ""
    lines = [
        f"## {args.label}{versions}: torch {torch.__version__}, {args.dtype}, {args.threads} thread, "
        f"{args.rows} rows per request over {args.context} cached tokens",
        "",
        "| per decoder layer | aten ops | kernels | CPU us |",
        "|---|---|---|---|",
    ]
    for r in record["per_layer"]:
        v = {k: r[k] for k in ("before", "after") if k in r}
        lines.append(
            f"| {r['requests']} requests | {arrow({k: x['ops'] for k, x in v.items()}, '.0f')} | "
            f"{arrow({k: x['kernels'] for k, x in v.items()}, '.0f')} | "
            f"{arrow({k: x['cpu_us'] for k, x in v.items()}, '.0f')} |"
        )
    lines += [
        "",
        "| process | requests | forward: aten ops | kernels | CPU us (best) | after / before "
        "(median) | input building: ops | CPU us | whole step: ops |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["processes"]:
        lines.append(
            f"| {r['process']} | {r['requests']} | {arrow(r['forward_ops'], 'd')} | "
            f"{arrow(r['forward_kernels'], 'd')} | {arrow(r['forward_cpu_us'], '.0f')} | "
            f"{'' if r['forward_cpu_ratio'] is None else format(r['forward_cpu_ratio'], '.2f')} | "
            f"{r['build_ops']} | {r['build_cpu_us']:.0f} | {r['step_ops']} |"
        )
    text = "\n".join(lines)
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.label}.json").write_text(json.dumps(record, indent=1))
    (OUT / f"{args.label}.md").write_text(text + "\n")
    print(f"saved {OUT / args.label}.json")


if __name__ == "__main__":
    main()
