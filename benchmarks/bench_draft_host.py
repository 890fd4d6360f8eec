"""The draft's host work per batched forward, in process (issue 34; `bench_host.py`
measures the deployed draft, this one the parts of a forward).

Records the draft's calls of `bench_host.py`'s workload (a tiny random Llama, 8 layers,
hidden 64, its own draft; specpipe, greedy, W = 4, 64 tokens; `--concurrency` clients,
closed loop) from the in-process lockstep engine, then replays them as the draft service
computes them: each lockstep step's proposals of several requests as one batch, their
prunes first in one pass (`DraftRuntime.prune_many`), then one `step_many`. Prints CPU
microseconds (the thread's CPU time, fair on a shared machine) per batch and per part:
the prunes, the step's host preparation (`StageRuntime.prepare_step`: block tables,
positions, attention metadata), the embedding and the model's layers (`forward_batch`),
the LM head, top-k and candidates (`draft._top_children_many`) and the rest of the step
(its outputs split per request, locks, bookkeeping); per lockstep step, the batches,
model forwards and tree rows asked for and computed (rows a prune dropped before they ran
are not); the draft service's own work around a batch's step (`service_overhead`:
metrics, timing, pacing, the aligner, answers); and `_top_children_many` alone, per
call, for 1 and 8 requests of 4 nodes.

    python benchmarks/bench_draft_host.py                 # 1 and 8 clients, ~1 minute
    python benchmarks/bench_draft_host.py --concurrency 1 --gap-ms 10   # idle between batches
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_serve import make_model  # noqa: E402

PARTS = ("prune_many", "prepare_step", "embed", "forward_batch", "_top_children_many", "step_many")


def record(target: Path, concurrency: int, requests: int) -> list[tuple[str, tuple]]:
    """The draft's calls of the lockstep run, in order, a ("step", ()) between steps."""
    from specpipe.common.perf.timeline import Ask, closed_loop
    from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
    from specpipe.common.runtime.lockstep import LockstepEngine
    from specpipe.common.spec.options import DecodeOptions
    from specpipe.services.client.loadgen import load_dataset

    local = build_local(target, 4, ORACLE_DRAFT)
    draft, calls = local.draft, []
    for name in ("open", "prefill", "propose", "prune", "release"):
        real = getattr(draft, name)

        def recorded(*args, _real=real, _name=name):
            calls.append((_name, args))
            return _real(*args)

        setattr(draft, name, recorded)
    engine = LockstepEngine(local.pipeline, draft)
    step = engine.step
    engine.step = lambda: (calls.append(("step", ())), step())  # type: ignore[method-assign]
    prompts = [list(p.ids) for p in load_dataset("random:32", requests, 511, concurrency)]
    opts = DecodeOptions(max_new_tokens=64, width=4)
    closed_loop(engine, [Ask(p, "specpipe", opts) for p in prompts], concurrency)
    return calls


class Parts:
    """CPU seconds of the timed methods while a batch runs (the prompts' prefill, open
    and release are not counted), and of the batches themselves; and the batches' work:
    forwards (model calls), rows asked for (proposals' nodes) and rows computed (those a
    prune had not dropped before they ran)."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys((*PARTS, "batch"), 0.0)
        self.counting = False
        self.forwards = self.rows_asked = self.rows_run = 0

    def count(self, runtime) -> None:
        """Count the forwards and rows of `runtime`'s (a `StageRuntime`'s) steps."""
        prepare, forward = runtime.prepare_step, runtime.model.forward_batch

        def prepare_counted(acts):
            step = prepare(acts)
            if self.counting:
                self.rows_asked += sum(len(a) for a in acts if not a.committed)
                self.rows_run += sum(len(b) for b in step.batch if not b.act.committed)
            return step

        def forward_counted(*args, **kwargs):
            self.forwards += self.counting
            return forward(*args, **kwargs)

        runtime.prepare_step, runtime.model.forward_batch = prepare_counted, forward_counted

    def time(self, obj, name: str) -> None:
        real = getattr(obj, name)

        def run(*args, **kwargs):
            start = time.thread_time()
            try:
                return real(*args, **kwargs)
            finally:
                if self.counting:
                    self.spent[name] += time.thread_time() - start

        setattr(obj, name, run)


def batches_of(calls: list[tuple[str, tuple]]) -> Iterator[tuple[str, list, list]]:
    """The recorded calls as the service batches them: ("batch", prunes, proposals) per
    batch (a lockstep step's; a request's second call starts the next), and the calls
    between as (name, args, [])."""
    from specpipe.common.runtime.draft import Proposal

    asks: list = []
    prunes: list = []
    for name, args in calls:
        rid = args[0] if name == "prune" else args[0].request_id if name == "propose" else None
        if (name == "step" or name not in ("prune", "propose") or
                any(a.layer.request_id == rid for a in asks)) and (asks or prunes):  # fmt: skip
            yield "batch", prunes, asks
            asks, prunes = [], []
        if name == "prune":
            prunes.append((args[0], args[1]))
        elif name == "propose":
            asks.append(Proposal(*args))
        elif name != "step":
            yield name, list(args), []
    if asks or prunes:
        yield "batch", prunes, asks


def replay(
    target: Path, calls: list[tuple[str, tuple]], gap: float = 0.0
) -> tuple[int, dict[str, float]]:
    """Batches, and CPU seconds per part (PARTS, and "batch": prunes and step together);
    "forwards", "rows_asked" and "rows_run" counted (`Parts.count`). `gap`: seconds slept
    before each batch (not counted), as a deployed draft idles between its forwards."""
    from specpipe.common.runtime import draft as draft_module
    from specpipe.common.runtime.loader import load_draft

    draft = load_draft(target)
    if not hasattr(draft, "prune_many"):  # before session 41: the service pruned one by one
        draft.prune_many = lambda prunes: [draft.prune(*p) for p in prunes]  # type: ignore
    parts = Parts()
    parts.count(draft.runtime)
    parts.time(draft, "prune_many")
    parts.time(draft, "step_many")
    parts.time(draft.runtime, "prepare_step")
    parts.time(draft.runtime.model, "embed")
    parts.time(draft.runtime.model, "forward_batch")
    top_children = draft_module._top_children_many
    parts.time(draft_module, "_top_children_many")
    batches = 0
    for name, prunes, asks in batches_of(calls):
        if name != "batch":
            draft_call = getattr(draft, name)
            draft_call(*prunes)
            continue
        if gap:
            time.sleep(gap)
        parts.counting, start = True, time.thread_time()
        if prunes:
            draft.prune_many(prunes)
        if asks:
            draft.step_many(asks)
        parts.spent["batch"] += time.thread_time() - start
        parts.counting = False
        batches += 1
    draft_module._top_children_many = top_children
    counts = {"forwards": parts.forwards, "rows_asked": parts.rows_asked}
    return batches, {**parts.spent, **counts, "rows_run": parts.rows_run}


def service_overhead(target: Path, calls: list[tuple[str, tuple]], repeats: int) -> float:
    """CPU microseconds per batch the draft service adds around its step (`DraftService.
    _compute_batch` and `_deliver`, less `_propose`: metrics, timing, pacing, the
    aligner, answers), the same batches through an unstarted service; the cheapest of
    `repeats`."""
    from specpipe.services.draft_service import DraftService, _Ask

    async def once() -> float:
        service = DraftService(target, transport_kind=None)
        inner = [0.0]
        propose = service._propose

        def timed(asks):
            start = time.thread_time()
            try:
                return propose(asks)
            finally:
                inner[0] += time.thread_time() - start

        service._propose = timed  # type: ignore[method-assign]
        spent, batches = 0.0, 0
        for name, prunes, asks in batches_of(calls):
            if name != "batch":
                getattr(service.runtime, name)(*prunes)
                continue
            of: dict[str, list] = {}
            for rid, prune in prunes:
                of.setdefault(rid, []).append(prune)
            items = [_Ask(of.pop(a.layer.request_id, []), a) for a in asks]
            start = time.thread_time()
            service._deliver(items, service._compute_batch(items))
            spent += time.thread_time() - start
            batches += 1
            await asyncio.sleep(0)  # the answers' callbacks run
        return 1e6 * (spent - inner[0]) / batches

    return min(asyncio.run(once()) for _ in range(repeats))


def per_call(fn: Callable[[], object], n: int = 2000) -> float:
    """Best of five: CPU microseconds per call."""
    for _ in range(n // 10):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - start) / n)
    return 1e6 * best


def _nodes(request_id: str):
    """A tree layer of 4 nodes, as the forward outputs it (random final hidden states)."""
    from specpipe.common.spec.messages import Activation

    ids = torch.arange(4)
    parents = torch.zeros(4, dtype=torch.int64)
    return Activation(request_id, ids, False, ids + 1, parents, hidden=torch.randn(4, 64))


def top_children(target: Path) -> dict[int, float]:
    from specpipe.common.runtime import draft as draft_module
    from specpipe.common.runtime.loader import load_draft

    head = load_draft(target).runtime.model.logits
    torch.manual_seed(0)
    out = {}
    for requests in (1, 8):
        asks = [(_nodes(f"r{i}"), 4, 0.0) for i in range(requests)]
        out[requests] = per_call(lambda a=asks: draft_module._top_children_many(a, head))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3, help="replays; the cheapest is shown")
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="sleep before each batch (a deployed draft idles between forwards)")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = make_model(Path(tempfile.mkdtemp(prefix="bench-draft-host-")), 8, 64, 512)
    for conc in args.concurrency:
        calls = record(target, conc, max(4, 2 * conc))
        batches, spent = min(
            (replay(target, calls, args.gap_ms / 1e3) for _ in range(args.repeats)),
            key=lambda r: r[1]["batch"],
        )
        us = {k: 1e6 * v / batches for k, v in spent.items() if k in (*PARTS, "batch")}
        inside = ("prepare_step", "embed", "forward_batch", "_top_children_many")
        rest = us["step_many"] - sum(us[k] for k in inside)
        asks = sum(name == "propose" for name, _ in calls)
        steps = sum(name == "step" for name, _ in calls)
        print(
            f"{conc} client(s): {steps} lockstep steps; per step {batches / steps:.2f} batches"
            f", {spent['forwards'] / steps:.2f} model forwards, tree rows asked "
            f"{spent['rows_asked'] / steps:.2f}, computed {spent['rows_run'] / steps:.2f}"
        )
        print(
            f"{conc} client(s): {batches} batches, {asks / batches:.1f} proposals each; CPU us "
            f"per batch {us['batch']:.0f}: prunes {us['prune_many']:.0f}, preparation "
            f"{us['prepare_step']:.0f}, embedding {us['embed']:.0f}, model forward "
            f"{us['forward_batch']:.0f}, LM head, top-k and candidates "
            f"{us['_top_children_many']:.0f}, the rest of the step {rest:.0f}"
        )
        service = service_overhead(target, calls, max(args.repeats, 5))
        print(f"{conc} client(s): the service around a batch's step, CPU us {service:.0f}")
    tops = top_children(target)
    print("_top_children_many, CPU us per call: " + ", ".join(
        f"{n} request(s) of 4 nodes {us:.1f}" for n, us in tops.items()))  # fmt: skip


if __name__ == "__main__":
    main()
