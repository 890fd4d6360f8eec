"""Which decoder layers each pipeline stage holds: layer ranges, splits and their parsing."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .config import ModelConfig


@dataclass(frozen=True)
class LayerRange:
    """Decoder layers ``[start, end)`` of a model with ``num_layers`` layers."""

    start: int
    end: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.num_layers:
            raise ValueError(
                f"invalid layer range [{self.start}, {self.end}) for {self.num_layers} layers"
            )

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.num_layers

    @property
    def size(self) -> int:
        return self.end - self.start


def split_layers(
    num_layers: int, num_stages: int, weights: list[float] | None = None
) -> list[LayerRange]:
    """Split layers into contiguous stages, in proportion to `weights` (e.g. measured speed)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    weights = weights or [1.0] * num_stages
    if len(weights) != num_stages or min(weights) <= 0:
        raise ValueError("need one positive weight per stage")
    total = sum(weights)
    bounds, acc = [0], 0.0
    for i, w in enumerate(weights[:-1]):
        acc += w
        # Round to the nearest boundary but leave at least one layer for every stage.
        b = round(acc / total * num_layers)
        b = max(b, bounds[-1] + 1)
        b = min(b, num_layers - (num_stages - 1 - i))
        bounds.append(b)
    bounds.append(num_layers)
    return [LayerRange(a, b, num_layers) for a, b in itertools.pairwise(bounds)]


def split_layers_by_cost(layer_costs: list[float], num_stages: int) -> list[LayerRange]:
    """Contiguous stages minimizing the slowest stage's cost (a pipeline step waits for it).

    `layer_costs[i]` is layer i's cost with the embedding folded into the first layer and
    the final norm + LM head into the last. Exact linear partition by dynamic programming.
    """
    n = len(layer_costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} stages")
    prefix = list(itertools.accumulate(layer_costs, initial=0.0))
    inf = float("inf")
    # best[s][i]: smallest max-stage cost covering layers [0, i) with s stages; cut[s][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                c = max(best[s - 1][j], prefix[i] - prefix[j])
                if c < best[s][i]:
                    best[s][i], cut[s][i] = c, j
    bounds, i = [n], n
    for s in range(num_stages, 0, -1):
        i = cut[s][i]
        bounds.append(i)
    bounds.reverse()
    return [LayerRange(a, b, n) for a, b in itertools.pairwise(bounds)]


def parameter_layer_costs(cfg: ModelConfig) -> list[float]:
    """Per-layer cost proxy: weights read per step (small batches are memory-bound), with the
    LM head folded into the last layer. A large-vocabulary head is worth several layers
    (Qwen2.5-1.5B: 233M head parameters against 47M per layer)."""
    d, h, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = d * h * 2 + d * kv * 2 + 3 * d * cfg.intermediate_size
    costs = [1.0] * cfg.num_layers
    costs[-1] += cfg.vocab_size * d / layer
    return costs


def plan_stages(cfg: ModelConfig, num_stages: int, split: str = "even") -> list[LayerRange]:
    if split == "even":
        return split_layers(cfg.num_layers, num_stages)
    if split == "balanced":
        return split_layers_by_cost(parameter_layer_costs(cfg), num_stages)
    raise ValueError(f"unknown split {split!r} (even or balanced)")


def _bounds(text: str) -> tuple[int, int] | None:
    """`START:END` -> (START, END); None if the text is not of that form."""
    a, sep, b = text.strip().partition(":")
    if not sep or not a.isdigit() or not b.isdigit():
        return None
    return int(a), int(b)


def parse_layer_range(text: str, num_layers: int) -> LayerRange:
    """`START:END` (e.g. a stage's `--layers`) -> the layer range of that model."""
    bounds = _bounds(text)
    if bounds is None:
        raise ValueError(f"layer range must look like START:END, got {text!r}")
    return LayerRange(*bounds, num_layers)


def parse_layer_ranges(text: str, num_layers: int) -> list[LayerRange]:
    """`0:7,7:14,...` (`specpipe up --layers`) -> contiguous layer ranges covering the model."""
    ranges = []
    for part in text.split(","):
        bounds = _bounds(part)
        if bounds is None:
            raise ValueError(f"--layers: expected START:END,START:END,..., got {text!r}")
        ranges.append(LayerRange(*bounds, num_layers))
    if ranges[0].start != 0 or ranges[-1].end != num_layers:
        raise ValueError(f"--layers must cover layers 0 to {num_layers}, got {text!r}")
    for x, y in itertools.pairwise(ranges):
        if x.end != y.start:
            raise ValueError(f"--layers ranges must be contiguous, got {text!r}")
    return ranges
