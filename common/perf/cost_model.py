"""Measured stage costs and the projected time between tokens of a recorded run.

Tokens per step and hit rate come from the algorithm; time between tokens on a pipeline
with one device per stage is projected from a run's per-step trace (how many rows every
stage and the draft computed) and each stage's measured cost for that many rows
(docs/architecture.md, "4. Modes and baselines"). Stages run in parallel, so a step costs
as much as its slowest stage; in `specpipe` the draft runs in parallel too (its own
device, the relaxed speculative window); in `specinfer` the draft must finish the whole
tree before the pass starts.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..runtime.stage import StageRuntime
from ..spec.messages import Activation, Prune
from .clock import device_timer, measuring_costs

_MEASURE_ID = "__cost_probe__"


@dataclass
class CostCurve:
    """Seconds to run n rows through one runtime at a fixed context length: interpolated
    between measured row counts, and beyond the last one extrapolated along the last
    segment (a batch of many requests can exceed the rows measured; a flat curve stays
    flat)."""

    rows: list[int]
    seconds: list[float]

    def __call__(self, n: int) -> float:
        if n <= 0:
            return 0.0
        if n > self.rows[-1] and len(self.rows) > 1:
            (r0, r1), (s0, s1) = self.rows[-2:], self.seconds[-2:]
            return float(s1 + (s1 - s0) * (n - r1) / (r1 - r0))
        return float(np.interp(n, self.rows, self.seconds))

    @classmethod
    def from_dict(cls, d: dict) -> CostCurve:
        rows, seconds = [int(r) for r in d["rows"]], [float(s) for s in d["seconds"]]
        if not rows or len(rows) != len(seconds) or rows != sorted(set(rows)) or rows[0] < 1:
            raise ValueError("a cost curve needs increasing row counts >= 1, one time each")
        if min(seconds) < 0:
            raise ValueError("a cost curve's seconds must not be negative")
        return cls(rows, seconds)

    def to_dict(self) -> dict[str, list]:
        return {"rows": self.rows, "seconds": self.seconds}


class StepProbe:
    """Synthetic stage steps: `requests` open requests with `context` cached rows each,
    and batches of n fresh tree rows split among them as evenly as they go (the rows of
    one pipeline step of SpecPipe-DB). Used by cost measurement and `specpipe selfcheck`.
    Release with `close` (or use it as a context manager)."""

    def __init__(self, runtime: StageRuntime, context: int, requests: int = 1, max_rows: int = 256):
        self.runtime, self.context = runtime, context
        self.ids = [f"{_MEASURE_ID}{r}" for r in range(max(1, requests))]
        self._gen = torch.Generator().manual_seed(0)
        self._next_id = 0
        opened = []
        try:
            for rid in self.ids:
                runtime.open(rid, context + max_rows + 1)
                opened.append(rid)
                if context:
                    runtime.forward(
                        Activation(
                            rid, torch.arange(context), committed=True, **self._payload(context)
                        )
                    )
        except BaseException:
            for rid in opened:
                runtime.release(rid)
            raise

    def _payload(self, n: int) -> dict[str, torch.Tensor]:
        cfg, rt = self.runtime.model.cfg, self.runtime
        if rt.is_first:
            return {"tokens": torch.randint(0, cfg.vocab_size, (n,), generator=self._gen)}
        return {"hidden": torch.randn(n, cfg.hidden_size, generator=self._gen).to(rt.model.dtype)}

    def batch(self, rows: int) -> list[Activation]:
        """One step's activations: `rows` tree rows (children of the committed prefix)."""
        k = min(len(self.ids), rows)
        acts = []
        for r, rid in enumerate(self.ids[:k]):
            m = rows // k + (r < rows % k)
            node_ids = torch.arange(self._next_id, self._next_id + m)
            self._next_id += m
            acts.append(
                Activation(
                    rid,
                    positions=torch.full((m,), self.context),
                    node_ids=node_ids,
                    parent_ids=torch.full((m,), -1),
                    **self._payload(m),
                )
            )
        return acts

    def drop(self) -> None:
        """Prune every tree row so far (the cache holds the context again)."""
        empty = torch.empty(0, dtype=torch.int64)
        for rid in self.ids:
            self.runtime.prune(rid, Prune(empty, empty, horizon=self._next_id - 1))

    def close(self) -> None:
        for rid in self.ids:
            self.runtime.release(rid)

    def __enter__(self) -> StepProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stage_step(runtime: StageRuntime, acts: Sequence[Activation]) -> None:
    """One step of a stage as its service computes it: the batched forward and, on the
    last stage, the LM head of the rows (its verifier's one head call for the round, at
    most every row: the runtime itself returns final hidden states)."""
    outs = runtime.forward_many(acts)
    if runtime.is_last:
        hidden = [o.hidden for o in outs if isinstance(o, Activation) and o.hidden is not None]
        if hidden:
            runtime.model.logits(torch.cat(hidden))


@torch.inference_mode()
def measure_runtime(
    runtime: StageRuntime, rows: Sequence[int], context: int, repeats: int = 3, requests: int = 1
) -> CostCurve:
    """Median time of a step (`stage_step`) of n tree rows attending to `context` cached
    rows.

    With `requests` > 1, a batched forward (SpecPipe-DB): the n rows belong to up to
    that many requests (as evenly as they split), each attending to its own `context`
    cached rows, in one `forward_many`."""
    seconds = []
    with measuring_costs(), StepProbe(runtime, context, requests, max(rows)) as probe:
        for n in rows:
            samples = []
            for _ in range(repeats + 1):  # first run warms up
                acts = probe.batch(n)
                with device_timer(runtime.model.device) as elapsed:
                    stage_step(runtime, acts)
                samples.append(elapsed.seconds)
                probe.drop()
            seconds.append(statistics.median(samples[1:]))
    return CostCurve(list(rows), seconds)


BUDGET_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
COST_CONTEXT = 128  # cached rows a service's cost curve is measured at (--measure-costs)


def row_budget(curve: CostCurve, slack: float = 2.0) -> int:
    """Rows one step can take while nearly free: the most measured rows that cost at
    most `slack` times one row (accelerators: dozens; CPUs: a few)."""
    one = curve(1)
    fits = [n for n, sec in zip(curve.rows, curve.seconds, strict=True) if sec <= slack * one]
    return max(fits, default=1)


@dataclass
class DeploymentCosts:
    """Measured cost curves of every stage and of the draft at one context length."""

    context: int
    stages: list[CostCurve]
    draft: CostCurve | None = None
    notes: dict[str, str] = field(default_factory=dict)

    @classmethod
    def measure(
        cls,
        stages: Sequence[StageRuntime],
        draft: StageRuntime | None,
        rows: Sequence[int],
        context: int,
        repeats: int = 3,
        requests: int = 1,
    ) -> DeploymentCosts:
        """`requests` > 1: batched forwards, the rows spread over that many requests."""

        def measure(runtime: StageRuntime) -> CostCurve:
            return measure_runtime(runtime, rows, context, repeats, requests)

        return cls(
            context=context,
            stages=[measure(s) for s in stages],
            draft=measure(draft) if draft is not None else None,
            notes={"requests": str(requests)} if requests > 1 else {},
        )

    def step_seconds(
        self, rows_per_stage: Sequence[int], draft_forwards: Sequence[int], draft_parallel: bool
    ) -> float:
        """A step's cost: its slowest stage, or (`draft_parallel`) the draft's forwards of
        the step one after another if those take longer (each tree layer is grown from
        the one before: K layers a step are K forwards, not one of K times the rows)."""
        stage_time = max(
            (c(n) for c, n in zip(self.stages, rows_per_stage, strict=True)), default=0.0
        )
        return max(stage_time, self.draft_seconds(draft_forwards)) if draft_parallel else stage_time

    def draft_seconds(self, forwards: Sequence[int]) -> float:
        """The draft's forwards of `forwards` rows each, one after another."""
        if self.draft is None:
            return 0.0
        return sum(self.draft(n) for n in forwards)

    def without_draft(self) -> DeploymentCosts:
        """As if the draft had a device fast enough never to hold a step back."""
        return DeploymentCosts(self.context, self.stages, None)

    def flat(self) -> DeploymentCosts:
        """Accelerator-like costs: any row count up to the measured maximum costs as much as
        one row (on a GPU 64 tokens cost about as much as 1: docs/architecture.md,
        "3. The pipeline step")."""

        def flatten(c: CostCurve) -> CostCurve:
            return CostCurve(c.rows, [c.seconds[0]] * len(c.rows))

        draft = flatten(self.draft) if self.draft is not None else None
        return DeploymentCosts(self.context, [flatten(c) for c in self.stages], draft)

    @classmethod
    def from_dict(cls, d: dict) -> DeploymentCosts:
        """What `to_dict` wrote (bench_specpipe.py saves one per S under "costs")."""
        if not d.get("stages"):
            raise ValueError("costs need at least one stage curve")
        return cls(
            context=int(d.get("context", 0)),
            stages=[CostCurve.from_dict(c) for c in d["stages"]],
            draft=CostCurve.from_dict(d["draft"]) if d.get("draft") else None,
            notes={str(k): str(v) for k, v in d.get("notes", {}).items()},
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "context": self.context,
            "stages": [c.to_dict() for c in self.stages],
            "draft": self.draft.to_dict() if self.draft else None,
            "notes": self.notes,
        }


def step_seconds_of_trace(
    trace: Sequence[Sequence[int]],
    costs: DeploymentCosts,
    mode: str,
    draft_forwards: Sequence[Sequence[int]] | None = None,
) -> list[float]:
    """Projected duration of every step of a trace. `draft_forwards` holds the rows of
    each draft forward per step (`DecodeStats.draft_forwards`); without it a step's draft
    rows (the trace's last column) count as one forward."""
    forwards = draft_forwards if draft_forwards is not None else [[row[-1]] for row in trace]
    if len(forwards) != len(trace):
        raise ValueError(f"{len(forwards)} steps of draft forwards for a {len(trace)}-step trace")
    return [
        costs.step_seconds(row[:-1], f, draft_parallel=mode == "specpipe")
        for row, f in zip(trace, forwards, strict=True)
    ]


def projected_tbt(
    trace: Sequence[Sequence[int]],
    emit_steps: Sequence[int],
    costs: DeploymentCosts,
    mode: str,
    draft_seconds_per_pass: Sequence[float] = (),
    draft_forwards: Sequence[Sequence[int]] | None = None,
) -> float | None:
    """Time between tokens: from the first emission to the last, per token after the first.

    `emit_steps` are 1-based decode step counts at which tokens were emitted (the trace
    holds decode steps only). For specinfer, `draft_seconds_per_pass` adds the draft work
    done before each pass (a pass spans S steps and starts at steps 0, S, 2S, ...).
    `draft_forwards` as in `step_seconds_of_trace`.
    """
    if len(emit_steps) < 2:
        return None
    clock = [0.0]
    for sec in step_seconds_of_trace(trace, costs, mode, draft_forwards):
        clock.append(clock[-1] + sec)
    first, last = emit_steps[0], emit_steps[-1]
    elapsed = clock[last] - clock[first]
    if draft_seconds_per_pass:
        per_pass = len(trace) // len(draft_seconds_per_pass)
        # Draft work of passes that start after the first emission and end by the last one.
        for i, sec in enumerate(draft_seconds_per_pass):
            if first <= i * per_pass < last:
                elapsed += sec
    return elapsed / (len(emit_steps) - 1)


def specinfer_draft_seconds(
    layer_sizes: Sequence[Sequence[int]], costs: DeploymentCosts
) -> list[float]:
    """Sequential draft time before each SpecInfer pass: one draft forward per tree layer."""
    if costs.draft is None:
        return [0.0] * len(layer_sizes)
    return [sum(costs.draft(n) for n in layers) for layers in layer_sizes]
