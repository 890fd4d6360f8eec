"""Tree layers per step from measurement (`--layers-per-step auto`).

With K layers entering stage 1 per step, a step verifies up to K levels of the tree and
emits up to K tokens, but every stage computes K layers' rows and the draft grows K
layers (K forwards) per step. Whether that pays depends on the hardware (on a GPU,
K x w rows cost about as much as w; on a CPU several times more) and on the hit rate,
which can drop with K because the tree must reach K times deeper ahead of the root.

The choice: for each candidate K, a short calibration run measures the hit rate h_K
(the share of tokens that were in the tree: the chance that a verification level hits),
and the stage and draft cost curves give the step cost; the expected time per token is

    step_cost(K) * steps_per_token(h_K, K, S)

with `steps_per_token` the steady state of the pipeline as a two-state chain: a *steady*
step verifies a group of K levels, stopping at the first miss (tokens: the levels up to
and including it; all K hit with probability h^K and the next step is steady again); a
miss *restarts* the tree from the drawn token, which crosses the empty pipeline with the
K - 1 levels grown below it (S steps) and is then verified as a steady group is. K = 1
gives 1 / (h + (1 - h) S).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..runtime.loader import InProcessDeployment
from ..runtime.lockstep import LockstepGeneration
from ..spec.options import DecodeOptions, Mode
from .cost_model import DeploymentCosts

CANDIDATE_LAYERS = (1, 2, 3, 4)


def tokens_per_step(h: float, k: int, stages: int) -> float:
    """Expected tokens per step in steady state (see the module docstring)."""
    h = min(max(h, 0.0), 1.0)
    tokens = sum(j * h ** (j - 1) * (1 - h) for j in range(1, k + 1)) + k * h**k
    # either state is followed by a steady step with probability h^K
    return tokens / (h**k + (1 - h**k) * stages)


def ideal_decode_steps(stages: int, new_tokens: int, k: int) -> int:
    """Steps of a run where every token is a hit: the first root crosses the empty
    pipeline with the K - 1 levels below it (S steps, K tokens), then K tokens a step."""
    return stages - 1 + -(-new_tokens // k)


def step_seconds(costs: DeploymentCosts, k: int, width: int, uses_draft: bool = True) -> float:
    """One steady step: every stage runs K layers of `width` rows, the draft (on its own
    device, in parallel) K forwards of `width` rows; a source without the draft model
    (n-grams) costs the draft nothing."""
    stage = max((c(k * width) for c in costs.stages), default=0.0)
    draft = costs.draft_seconds([width] * k) if uses_draft else 0.0
    return max(stage, draft)


@dataclass(frozen=True)
class LayersOption:
    layers: int
    hit_rate: float
    step_seconds: float
    tokens_per_step: float

    @property
    def seconds_per_token(self) -> float:
        return self.step_seconds / self.tokens_per_step


@dataclass(frozen=True)
class LayersChoice:
    layers: int
    options: list[LayersOption]
    stages: int
    width: int

    def explain(self) -> str:
        lines = [
            f"layers per step auto: S={self.stages}, width {self.width}; expected s/token = "
            "step cost(K layers) / tokens per step(h_K, K, S)"
        ]
        for o in self.options:
            mark = "  <- chosen" if o.layers == self.layers else ""
            lines.append(
                f"  K={o.layers}  hit rate {o.hit_rate:5.3f}  step {o.step_seconds * 1e3:8.2f} ms"
                f"  tokens/step {o.tokens_per_step:5.2f}"
                f"  -> {o.seconds_per_token * 1e3:8.2f} ms/token{mark}"
            )
        return "\n".join(lines)


def evaluate_layers(
    hit_rates: dict[int, float], costs: DeploymentCosts, num_stages: int, width: int
) -> LayersChoice:
    """Expected time per token for each K from measured hit rates and cost curves; the
    fastest K (the smaller one on a tie)."""
    options = [
        LayersOption(k, h, step_seconds(costs, k, width), tokens_per_step(h, k, num_stages))
        for k, h in sorted(hit_rates.items())
    ]
    best = min(options, key=lambda o: (o.seconds_per_token, o.layers))
    return LayersChoice(best.layers, options, num_stages, width)


def measure_hit_rates(
    deployment: InProcessDeployment,
    prompts: Sequence[Sequence[int]],
    opts: DecodeOptions,
    candidates: Sequence[int],
) -> dict[int, float]:
    """Share of emitted tokens that were already in the tree, per K."""
    rates = {}
    for k in candidates:
        hits = emitted = 0
        for prompt in prompts:
            o = replace(opts, layers_per_step=k)
            gen = LockstepGeneration(
                deployment.pipeline, deployment.draft, prompt, Mode.SPECPIPE, o
            )
            gen.run()
            hits += gen.stats.hits
            emitted += gen.stats.new_tokens
        rates[k] = hits / emitted if emitted else 0.0
    return rates


def choose_layers(
    deployment: InProcessDeployment,
    prompts: Sequence[Sequence[int]],
    opts: DecodeOptions,
    candidates: Sequence[int] = CANDIDATE_LAYERS,
    calibration_tokens: int = 16,
    costs: DeploymentCosts | None = None,
) -> LayersChoice:
    """Measure the hit rate per K on `prompts` (short runs with `opts`) and the stage
    costs, pick the fastest K."""
    stages = deployment.pipeline.stages
    if costs is None:
        context = max(len(p) for p in prompts) + calibration_tokens
        rows = sorted({1, *(k * opts.width for k in candidates), opts.width})
        draft = deployment.draft.runtime if deployment.draft is not None else None
        costs = DeploymentCosts.measure(stages, draft, rows, context)
    calib = replace(opts, max_new_tokens=calibration_tokens)
    rates = measure_hit_rates(deployment, prompts, calib, candidates)
    return evaluate_layers(rates, costs, len(stages), opts.width)
