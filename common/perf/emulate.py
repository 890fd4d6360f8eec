"""Emulated devices: every forward of a stage or the draft paced to a cost model
(docs/architecture.md, "11. How performance is stated").

On a machine with fewer cores than services, the wall clock of a multi-process
deployment measures CPU contention, not the pipeline. With `--emulate-costs FILE` a
stage or the draft makes each forward take max(real, modelled) seconds, sleeping the
rest on its compute thread (its event loop keeps answering health checks and calls):
the processes then overlap as they would on one device each, and the wall-clock time
between tokens of the real services can be set beside the projection of the same run
under the same model (`EmulatedCosts.at`); the gap is the system's own overhead. It is
faithful only while every real forward is shorter than its modelled time (overruns are
counted and logged).

A cost file (JSON) is one of:

- flat, accelerator-like: `{"flat": {"stage": 0.02, "draft": 0.005}}` (or `{"flat": S}`
  for both): every forward costs that many seconds whatever its rows. Leaving "draft"
  out leaves draft forwards unpaced (a draft device fast enough never to hold a step
  back).
- measured: a `DeploymentCosts` as its `to_dict()` writes it, `{"context": C, "stages":
  [{"rows": [...], "seconds": [...]}, ...], "draft": {...} | null}`: one curve per stage
  (or one for every stage), seconds per row count at context length C. This is what
  `benchmarks/bench_specpipe.py` saves per S under "costs" (`costs_from_results`).
- measured at several context lengths: `{"contexts": [<measured>, <measured>, ...]}`:
  seconds are linear in the context length between (and beyond) the nearest two, the
  share of attention that grows with the context.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..spec.messages import Activation
from .clock import device_timer, measuring_costs
from .cost_model import BUDGET_ROWS, CostCurve, DeploymentCosts

log = logging.getLogger(__name__)

# A flat curve is flat over every row count a step budget considers (and beyond).
FLAT_ROWS = (1, BUDGET_ROWS[-1])
MODELLED_KEPT = 4096  # a pacer's modelled times kept (`Pacer._modelled`), at most


@dataclass(frozen=True)
class ForwardCost:
    """One service's cost model: seconds of a forward of `rows` rows whose context is
    `context` rows, from curves measured at one or more context lengths."""

    contexts: tuple[int, ...]
    curves: tuple[CostCurve, ...]

    def __call__(self, rows: int, context: int | None = None) -> float:
        if rows <= 0:
            return 0.0
        if len(self.curves) == 1 or context is None:
            return self.curves[0](rows)
        i = 1  # the segment [i-1, i] holding `context`, or the nearest one
        while i < len(self.contexts) - 1 and context > self.contexts[i]:
            i += 1
        (c0, c1), (f0, f1) = self.contexts[i - 1 : i + 1], self.curves[i - 1 : i + 1]
        s0, s1 = f0(rows), f1(rows)
        return max(0.0, s0 + (s1 - s0) * (context - c0) / (c1 - c0))


@dataclass
class EmulatedCosts:
    """A cost file: the deployment's costs at one or more context lengths."""

    levels: list[DeploymentCosts]  # by increasing context length
    source: str = ""

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("a cost model needs costs at one context length at least")
        self.levels.sort(key=lambda c: c.context)
        contexts = [c.context for c in self.levels]
        if len(set(contexts)) != len(contexts):
            raise ValueError(f"two cost levels at the same context length: {contexts}")
        counts = {len(c.stages) for c in self.levels}
        drafts = {c.draft is None for c in self.levels}
        if len(counts) != 1 or len(drafts) != 1:
            raise ValueError("every context level needs the same stage and draft curves")

    @classmethod
    def flat(cls, stage: float, draft: float | None = None) -> EmulatedCosts:
        """Every stage forward costs `stage` seconds and every draft forward `draft`
        (None: the draft is not paced)."""

        def curve(sec: float) -> CostCurve:
            return CostCurve(list(FLAT_ROWS), [float(sec)] * len(FLAT_ROWS))

        draft_curve = curve(draft) if draft is not None else None
        costs = DeploymentCosts(0, [curve(stage)], draft_curve, {"model": "flat"})
        return cls([costs], "flat")

    @classmethod
    def from_dict(cls, d: dict, source: str = "") -> EmulatedCosts:
        if "flat" in d:
            flat = d["flat"]
            if isinstance(flat, dict):
                stage, draft = flat.get("stage"), flat.get("draft")
            else:
                stage = draft = flat
            if stage is None or float(stage) < 0 or (draft is not None and float(draft) < 0):
                raise ValueError('flat costs need "stage" seconds >= 0 (and "draft", if any)')
            out = cls.flat(float(stage), None if draft is None else float(draft))
            out.source = source or "flat"
            return out
        levels = d.get("contexts", [d])
        return cls([DeploymentCosts.from_dict(c) for c in levels], source)

    @classmethod
    def load(cls, path: str | Path) -> EmulatedCosts:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()), str(path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cost file {path}: {e}") from None

    def to_dict(self) -> dict[str, object]:
        if len(self.levels) == 1:
            return self.levels[0].to_dict()
        return {"contexts": [c.to_dict() for c in self.levels]}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @property
    def num_stages(self) -> int:
        """Stage curves in the file (1: the same curve for every stage)."""
        return len(self.levels[0].stages)

    @property
    def has_draft(self) -> bool:
        return self.levels[0].draft is not None

    def check_stages(self, stages: int) -> None:
        if self.num_stages not in (1, stages):
            raise ValueError(
                f"cost file {self.source or '?'} has {self.num_stages} stage curves; "
                f"the deployment has {stages} stages (give one curve, or one per stage)"
            )

    def stage(self, index: int | None = None) -> ForwardCost:
        """The cost model of stage `index` (0-based; None: the file's only stage curve)."""
        if self.num_stages == 1:
            index = 0
        elif index is None or not 0 <= index < self.num_stages:
            raise ValueError(
                f"cost file {self.source or '?'} has {self.num_stages} stage curves: "
                f"say which one this stage paces to (0..{self.num_stages - 1}), not {index}"
            )
        return self._forward(lambda c: c.stages[index])

    def draft(self) -> ForwardCost | None:
        return self._forward(lambda c: c.draft) if self.has_draft else None

    def _forward(self, pick: Callable[[DeploymentCosts], CostCurve | None]) -> ForwardCost:
        curves = tuple(pick(c) for c in self.levels)
        return ForwardCost(tuple(c.context for c in self.levels), curves)  # type: ignore[arg-type]

    def at(self, context: int, stages: int | None = None) -> DeploymentCosts:
        """The deployment's costs at one context length, as the projections take them
        (`projected_tbt`, `step_seconds_of_trace`), with one curve per stage when
        `stages` is given."""
        rows = sorted({r for c in self.levels for s in [*c.stages, c.draft] if s for r in s.rows})

        def curve(cost: ForwardCost) -> CostCurve:
            return CostCurve(rows, [cost(r, context) for r in rows])

        n = stages or self.num_stages
        if stages is not None:
            self.check_stages(stages)
        stage_curves = [curve(self.stage(min(i, self.num_stages - 1))) for i in range(n)]
        draft = self.draft()
        notes = {**self.levels[0].notes, "emulated": self.source or "?"}
        return DeploymentCosts(context, stage_curves, curve(draft) if draft else None, notes)


def costs_from_results(path: str | Path, stages: int) -> EmulatedCosts:
    """The measured costs bench_specpipe.py recorded for S = `stages` (results.json)."""
    results = json.loads(Path(path).read_text())
    entry = results["by_stages"].get(str(stages))
    if entry is None:
        raise ValueError(f"{path} has no costs for S={stages}: {sorted(results['by_stages'])}")
    return EmulatedCosts([DeploymentCosts.from_dict(entry["costs"])], f"{path}#S={stages}")


def batch_shape(acts: Sequence[Activation]) -> tuple[int, int]:
    """Rows of a batched forward, and their context length: the mean over rows of the
    request's context (its furthest position + 1), since each request attends to its own
    cache."""
    rows = context = 0
    for a in acts:  # one pass, each count read once: it runs before every paced forward
        positions = a.positions
        n = positions.numel()
        if n:
            rows += n
            # a step's few rows as a list: a torch reduction costs tens of us cold
            top = max(positions.tolist()) if n <= 64 else int(positions.max())
            context += n * (top + 1)
    return (rows, round(context / rows)) if rows else (0, 0)


@dataclass
class Deadline:
    """When an emulated forward ends (`Pacer.launch`): `at` on the pacer's clock, and
    its `seconds`, max(real, modelled)."""

    clock: Callable[[], float]
    sleep: Callable[[float], None]
    at: float = float("-inf")
    seconds: float = 0.0

    def wait(self) -> None:
        """Until the forward's modelled end (at once once it has passed)."""
        rest = self.at - self.clock()
        if rest > 0:
            self.sleep(rest)


@dataclass
class Pacer:
    """Makes every forward take its modelled time: the caller runs the real forward
    inside `forward(rows, context)`, which then sleeps the rest on the calling thread."""

    cost: ForwardCost
    name: str = ""
    clock: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], None] = time.sleep
    forwards: int = 0
    modelled_seconds: float = 0.0
    real_seconds: float = 0.0
    overruns: int = 0  # forwards whose real time exceeded the model (not faithful)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _warned_at: float = field(default=-1e9, repr=False)
    # modelled seconds by (rows, context): a step's shape recurs (one curve: its rows
    # alone), and a curve's evaluation costs tens of us cold, every paced forward
    _modelled: dict[tuple[int, int | None], float] = field(default_factory=dict, repr=False)

    @contextlib.contextmanager
    def forward(
        self, rows: int, context: int | None = None, device: torch.device | str = "cpu"
    ) -> Iterator[None]:
        """The real forward runs in the block; its time is `device`'s (the one device
        timer, `clock.device_timer`, synchronized: the pacer measures each forward to
        sleep the rest of its modelled time)."""
        with self.launch(rows, context, device) as done:
            yield
        done.wait()

    @contextlib.contextmanager
    def launch(
        self, rows: int, context: int | None = None, device: torch.device | str = "cpu"
    ) -> Iterator[Deadline]:
        """As `forward`, on an emulated device whose launches are asynchronous: the real
        forward runs in the block and the rest of its modelled time is waited for where
        its outputs are handed on (`Deadline.wait`), so host work done in between
        overlaps the emulated device's as it would a real one's."""
        done = Deadline(self.clock, self.sleep)
        if rows <= 0:  # nothing computed (a round of prunes only): not a forward
            yield done
            return
        start = self.clock()
        if device == "cpu" or getattr(device, "type", None) == "cpu":
            yield done  # the host's work is done when the block ends: its clock is exact
            real = self.clock() - start
        else:
            with measuring_costs(), device_timer(device, self.clock) as elapsed:
                yield done
            real = elapsed.seconds
        modelled = self._modelled_seconds(rows, context)
        done.at, done.seconds = self.clock() + max(modelled - real, 0.0), max(real, modelled)
        with self._lock:
            self.forwards += 1
            self.modelled_seconds += modelled
            self.real_seconds += real
            over = real > modelled > 0
            self.overruns += over
        if over and start - self._warned_at > 10.0:
            self._warned_at = start
            log.warning(
                "%s: a forward of %d rows took %.1f ms, more than its modelled %.1f ms "
                "(%d such of %d): the emulation is slower than its model",
                self.name or "emulated device", rows, 1e3 * real, 1e3 * modelled,
                self.overruns, self.forwards,
            )  # fmt: skip

    def _modelled_seconds(self, rows: int, context: int | None) -> float:
        one_curve = len(getattr(self.cost, "curves", ())) == 1  # its rows alone count
        key = (rows, None if one_curve else context)
        seconds = self._modelled.get(key)
        if seconds is None:
            if len(self._modelled) >= MODELLED_KEPT:
                self._modelled.clear()
            seconds = self._modelled[key] = self.cost(rows, context)
        return seconds

    def summary(self) -> dict[str, float]:
        with self._lock:
            return {
                "forwards": self.forwards,
                "modelled_seconds": round(self.modelled_seconds, 6),
                "real_seconds": round(self.real_seconds, 6),
                "overruns": self.overruns,
            }


def paced(
    pacer: Pacer | None, acts: Sequence[Activation], device: torch.device | str = "cpu"
) -> contextlib.AbstractContextManager:
    """Around a batched forward of `acts` on `device`: paced with a pacer, as is without
    one."""
    if pacer is None:
        return contextlib.nullcontext()
    return pacer.forward(*batch_shape(acts), device=device)


def launched(
    pacer: Pacer | None, acts: Sequence[Activation], device: torch.device | str = "cpu"
) -> contextlib.AbstractContextManager[Deadline | None]:
    """Around a batched forward of `acts` on `device` whose outputs are handed on later:
    with a pacer, the forward's `Deadline` (wait for it at hand-off); None without one."""
    if pacer is None:
        return contextlib.nullcontext()
    return pacer.launch(*batch_shape(acts), device=device)


def paced_call(
    pacer: Pacer | None,
    fn: Callable,
    rows: int,
    context: int,
    device: torch.device | str = "cpu",
) -> Callable:
    """`fn`, its every call one paced forward of `rows` rows at `context` on `device`."""
    if pacer is None or rows <= 0:
        return fn

    @functools.wraps(fn)
    def run(*args):
        with pacer.forward(rows, context, device):
            return fn(*args)

    return run
