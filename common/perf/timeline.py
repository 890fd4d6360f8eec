"""Projected serving of many requests from a lockstep run (SpecPipe-DB; docs/architecture.md,
"11. How performance is stated").

`closed_loop` drives the lockstep engine as `specpipe bench serve` drives the router:
`concurrency` clients, each sending its next request when the previous one finished;
every engine step runs all active requests' rows together, and the engine records the
rows every stage and the draft computed per step over all requests. `project` prices
that trace with cost curves of batched forwards: a step costs as much as its slowest
stage (specpipe: or the draft's forwards of the step one after another, the j-th forwards
of all requests batched; it runs beside the stages on its own device); in
specinfer the draft builds a pass's tree before the pass enters the pipeline, so the
draft forwards of the passes that enter at a step (batched over those requests, one
forward per tree layer) are added to that step, as if the pipeline waited for them.
Every token then has a projected time: per request TTFT (from its arrival) and TBT, and
the run's throughput, as the load generator reports them through the services.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..runtime.lockstep import LockstepEngine, Run, add_forwards
from ..spec.options import DecodeOptions, Mode
from ..spec.stats import DecodeStats
from .cost_model import DeploymentCosts, step_seconds_of_trace


@dataclass
class Ask:
    """One request of a load: prompt, mode and options."""

    prompt: Sequence[int]
    mode: Mode | str
    opts: DecodeOptions


@dataclass
class Served:
    """One request of a closed-loop lockstep run: when it joined and what it did."""

    join_step: int  # the engine step it first took part in
    stats: DecodeStats
    tokens: list[int] = field(default_factory=list)

    @property
    def token_steps(self) -> list[int]:
        """Engine steps (1-based counts) at whose end each of its tokens was emitted."""
        s = self.stats
        return [self.join_step + s.prefill_steps + e for e in s.emit_steps]


@dataclass
class LoadRun:
    """A closed-loop run of the lockstep engine: its step trace and every request."""

    mode: str
    concurrency: int
    # per engine step: rows of each stage over all requests, then the draft's
    trace: list[list[int]]
    served: list[Served] = field(default_factory=list)
    # per engine step: the rows of each (batched) draft forward
    draft_forwards: list[list[int]] = field(default_factory=list)


def closed_loop(engine: LockstepEngine, asks: Sequence[Ask], concurrency: int) -> LoadRun:
    """Run `asks` through `engine`, at most `concurrency` at once, each next one joining
    at the step after a request finished (a closed-loop client)."""
    pending = list(asks)
    served: list[Served] = []
    start = engine.steps
    active: list[tuple[Served, Run]] = []

    def admit() -> None:
        while pending and len(active) < concurrency:
            ask = pending.pop(0)
            run = engine.add(ask.prompt, ask.mode, ask.opts)
            active.append((Served(engine.steps - start, run.stats, run.tokens), run))
            served.append(active[-1][0])

    admit()
    while active:
        engine.step()
        active[:] = [(s, run) for s, run in active if not run.controller.done]
        admit()
    while engine.runs:  # carry out the last Finish commands
        engine.step()
    mode = str(Mode(asks[0].mode).value) if asks else ""
    return LoadRun(mode, concurrency, engine.trace[start:], served, engine.draft_forwards[start:])


def schedule(runs: Sequence[DecodeStats], concurrency: int) -> LoadRun:
    """The closed-loop run of requests whose runs alone were `runs`, without running a
    model again: in the lockstep engine requests do not interact (without a row budget
    every request computes what it would alone), so each adds its own trace from the
    step it joins, and the next request joins when one finishes (what `closed_loop`
    records, from traces recorded one request at a time)."""
    free = [0] * concurrency  # when each client sends its next request
    served, length = [], 0
    for stats in runs:
        join = heapq.heappop(free)
        served.append(Served(join, stats))
        heapq.heappush(free, join + len(stats.trace))
        length = max(length, join + len(stats.trace))
    width = len(runs[0].trace[0]) if runs else 0
    trace = [[0] * width for _ in range(length)]
    forwards: list[list[int]] = [[] for _ in range(length)]
    for s in served:
        for i, (row, f) in enumerate(zip(s.stats.trace, s.stats.draft_forwards, strict=True)):
            t = s.join_step + i
            trace[t] = [a + b for a, b in zip(trace[t], row, strict=True)]
            forwards[t] = add_forwards(forwards[t], f)
    return LoadRun(runs[0].mode if runs else "", concurrency, trace, served, forwards)


def _pass_entries(served: Sequence[Served]) -> dict[int, list[list[int]]]:
    """specinfer: per engine step, the tree-layer sizes of every pass entering then
    (a pass enters when stage 1 gets rows after the prefill)."""
    entries: dict[int, list[list[int]]] = defaultdict(list)
    for s in served:
        st = s.stats
        passes = iter(st.draft_layers)
        for i, row in enumerate(st.trace[st.prefill_steps :]):
            if row[0] > 0:
                layers = next(passes, None)
                if layers is None:
                    break
                entries[s.join_step + st.prefill_steps + i].append(layers)
    return entries


def step_clock(load: LoadRun, costs: DeploymentCosts) -> list[float]:
    """clock[i]: the projected time at the end of engine step i (1-based; clock[0] = 0)."""
    seconds = step_seconds_of_trace(load.trace, costs, load.mode, load.draft_forwards)
    if load.mode == Mode.SPECINFER.value and costs.draft is not None:
        for step, passes in _pass_entries(load.served).items():
            depth = max(len(p) for p in passes)
            rows = [sum(p[d] for p in passes if d < len(p)) for d in range(depth)]
            seconds[step] += sum(costs.draft(n) for n in rows)
    return [0.0, *np.cumsum(seconds).tolist()]


def _ms(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    out = {"mean": round(1e3 * float(np.mean(values)), 3)}
    return out | {f"p{q}": round(1e3 * float(np.percentile(values, q)), 3) for q in (50, 90, 99)}


def project(load: LoadRun, costs: DeploymentCosts) -> dict[str, object]:
    """Throughput and latency percentiles of `load` on one device per stage under
    `costs`, in the keys of the load generator's summary (milliseconds)."""
    clock = step_clock(load, costs)
    ttft, tbt, tokens, end = [], [], 0, 0.0
    for s in load.served:
        times = [clock[k] for k in s.token_steps]
        if not times:
            continue
        tokens += len(times)
        end = max(end, times[-1])
        ttft.append(times[0] - clock[s.join_step])
        if len(times) > 1:
            tbt.append((times[-1] - times[0]) / (len(times) - 1))
    steps = len(load.trace)
    return {
        "requests": len(load.served),
        "duration_s": round(end, 4),
        "output_throughput": round(tokens / end, 3) if end else 0.0,
        "total_output_tokens": tokens,
        "ttft_ms": _ms(ttft),
        "tbt_ms": _ms(tbt),
        "engine_steps": steps,
        "tokens_per_engine_step": round(tokens / steps, 4) if steps else 0.0,
        "mean_tokens_per_step": round(
            float(np.mean([s.stats.tokens_per_step for s in load.served])), 4
        )
        if load.served
        else 0.0,
    }
