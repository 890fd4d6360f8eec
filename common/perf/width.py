"""Tree width from measurement (`--width auto`).

A wider tree raises the hit rate h but makes every stage compute more rows per step. With
S stages a token costs on average (h + (1 - h) * S) steps, so the expected time per token
is step_cost(W) * (h(W) + (1 - h(W)) * S). Both factors are measured on this deployment:
the stage and draft cost curves by timing forwards, h(W) by short calibration runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..runtime.loader import InProcessDeployment
from ..runtime.lockstep import LockstepGeneration
from ..spec.options import DEFAULT_TOP_K_CHILDREN, DecodeOptions, Mode
from ..spec.sampling import SamplingParams
from .cost_model import DeploymentCosts

CANDIDATE_WIDTHS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class WidthOption:
    width: int
    hit_rate: float
    step_seconds: float
    steps_per_token: float

    @property
    def seconds_per_token(self) -> float:
        return self.step_seconds * self.steps_per_token


@dataclass(frozen=True)
class WidthChoice:
    width: int
    options: list[WidthOption]
    stages: int
    context: int

    def explain(self) -> str:
        lines = [
            f"width auto: S={self.stages}, context {self.context}; "
            "expected s/token = step cost x (h + (1-h) S)"
        ]
        for o in self.options:
            mark = "  <- chosen" if o.width == self.width else ""
            lines.append(
                f"  W={o.width:>3}  hit rate {o.hit_rate:5.3f}  step {o.step_seconds * 1e3:8.2f} ms"
                f"  steps/token {o.steps_per_token:5.2f}  -> {o.seconds_per_token * 1e3:8.2f} ms/token{mark}"
            )
        return "\n".join(lines)


def evaluate_widths(
    hit_rates: dict[int, float], costs: DeploymentCosts, num_stages: int
) -> WidthChoice:
    """Expected time per token for each width from measured hit rates and cost curves."""
    options = []
    for w, h in sorted(hit_rates.items()):
        # Steady state: stages 1..S-1 each hold one tree layer, the last stage the root.
        step = costs.step_seconds([w] * (num_stages - 1) + [1], [w], draft_parallel=True)
        options.append(WidthOption(w, h, step, h + (1 - h) * num_stages))
    best = min(options, key=lambda o: o.seconds_per_token)
    return WidthChoice(best.width, options, num_stages, costs.context)


def measure_hit_rates(
    deployment: InProcessDeployment,
    prompts: Sequence[Sequence[int]],
    widths: Sequence[int],
    sampling: SamplingParams,
    top_k_children: int,
    tokens: int,
) -> dict[int, float]:
    """Fraction of emitted tokens that were already in the tree, per width."""
    rates = {}
    for w in widths:
        hits = emitted = 0
        for prompt in prompts:
            opts = DecodeOptions(
                max_new_tokens=tokens, sampling=sampling, width=w, top_k_children=top_k_children
            )
            gen = LockstepGeneration(
                deployment.pipeline, deployment.draft, prompt, Mode.SPECPIPE, opts
            )
            gen.run()
            hits += gen.stats.hits
            emitted += gen.stats.new_tokens
        rates[w] = hits / emitted if emitted else 0.0
    return rates


def choose_width(
    deployment: InProcessDeployment,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | None = None,
    top_k_children: int = DEFAULT_TOP_K_CHILDREN,
    widths: Sequence[int] = CANDIDATE_WIDTHS,
    calibration_tokens: int = 16,
    costs: DeploymentCosts | None = None,
) -> WidthChoice:
    """Measure hit rate per width on `prompts` and stage costs, pick the fastest width."""
    if deployment.draft is None:
        raise ValueError("width auto needs a draft")
    sampling = sampling or SamplingParams()
    stages = deployment.pipeline.stages
    if costs is None:
        context = max(len(p) for p in prompts) + calibration_tokens
        costs = DeploymentCosts.measure(stages, deployment.draft.runtime, sorted(widths), context)
    rates = measure_hit_rates(
        deployment, prompts, widths, sampling, top_k_children, calibration_tokens
    )
    return evaluate_widths(rates, costs, len(stages))
