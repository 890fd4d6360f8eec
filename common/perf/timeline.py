"""Projected serving of many requests from a lockstep run (SpecPipe-DB, DESIGN 2.4 and 6).

`closed_loop` drives the lockstep engine as `specpipe bench serve` drives the router:
`concurrency` clients, each sending its next request when the previous one finished;
every engine step runs all active requests' rows together, and the engine records the
rows every stage and the draft computed per step over all requests. `project` prices
that trace with cost curves of batched forwards: a step costs as much as its slowest
stage (specpipe: or the draft, which runs beside the stages on its own device); in
specinfer the draft builds a pass's tree before the pass enters the pipeline, so the
draft forwards of the passes that enter at a step (batched over those requests, one
forward per tree layer) are added to that step, as if the pipeline waited for them.
Every token then has a projected time: per request TTFT (from its arrival) and TBT, and
the run's throughput, as the load generator reports them through the services.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..runtime.lockstep import LockstepEngine, Run
from ..spec.options import DecodeOptions, Mode
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
    run: Run

    @property
    def token_steps(self) -> list[int]:
        """Engine steps (1-based counts) at whose end each of its tokens was emitted."""
        s = self.run.stats
        return [self.join_step + s.prefill_steps + e for e in s.emit_steps]


@dataclass
class LoadRun:
    """A closed-loop run of the lockstep engine: its step trace and every request."""

    mode: str
    concurrency: int
    # per engine step: rows of each stage over all requests, then the draft's
    trace: list[list[int]]
    served: list[Served] = field(default_factory=list)


def closed_loop(engine: LockstepEngine, asks: Sequence[Ask], concurrency: int) -> LoadRun:
    """Run `asks` through `engine`, at most `concurrency` at once, each next one joining
    at the step after a request finished (a closed-loop client)."""
    pending = list(asks)
    served: list[Served] = []
    start = engine.steps
    active: list[Served] = []

    def admit() -> None:
        while pending and len(active) < concurrency:
            ask = pending.pop(0)
            s = Served(engine.steps - start, engine.add(ask.prompt, ask.mode, ask.opts))
            active.append(s)
            served.append(s)

    admit()
    while active:
        engine.step()
        active[:] = [s for s in active if not s.run.controller.done]
        admit()
    while engine.runs:  # carry out the last Finish commands
        engine.step()
    mode = str(Mode(asks[0].mode).value) if asks else ""
    return LoadRun(mode, concurrency, engine.trace[start:], served)


def _pass_entries(served: Sequence[Served]) -> dict[int, list[list[int]]]:
    """specinfer: per engine step, the tree-layer sizes of every pass entering then
    (a pass enters when stage 1 gets rows after the prefill)."""
    entries: dict[int, list[list[int]]] = defaultdict(list)
    for s in served:
        st = s.run.stats
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
    seconds = step_seconds_of_trace(load.trace, costs, load.mode)
    if load.mode == Mode.SPECINFER.value and costs.draft is not None:
        for step, passes in _pass_entries(load.served).items():
            depth = max(len(p) for p in passes)
            rows = [sum(p[d] for p in passes if d < len(p)) for d in range(depth)]
            seconds[step] += sum(costs.draft(n) for n in rows)
    return [0.0, *np.cumsum(seconds).tolist()]


def _ms(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    return {f"p{q}": round(1e3 * float(np.percentile(values, q)), 3) for q in (50, 90, 99)}


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
            float(np.mean([s.run.stats.tokens_per_step for s in load.served])), 4
        )
        if load.served
        else 0.0,
    }
