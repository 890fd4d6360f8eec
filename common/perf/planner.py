"""Which node kind hosts which layers (docs/planning.md): the split minimizing the
slowest stage.

A pipeline step waits for its slowest stage. Given node kinds (each with a count, its
speed at the regime planned for, and its memory), choose the number of stages, the kind
of each and contiguous layer ranges minimizing the largest stage step time, subject to
every stage's memory: its layers' weights, the embedding on the first stage, the final
norm and LM head on the last, and the KV cache of its layers for the tokens planned.
Exact dynamic programming over (layers placed, nodes of each kind used); the same
program with the cuts fixed assigns kinds to a given split (even, parameter-balanced).
Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..model.config import ModelConfig
from ..model.partition import LayerRange

GIB = 1 << 30
MAX_STATES = 4_000_000  # (layers + 1) x node-count combinations the program may visit


class PlanError(ValueError):
    """No split fits (or the request for one makes no sense): the message says why."""


@dataclass(frozen=True)
class NodeSpeed:
    """One node kind's costs at one regime (rows per step, context length): seconds of
    one forward, and the bytes it offers for weights and KV cache."""

    layer: float  # one decoder layer
    stage: float  # a stage's forward beyond its layers (positions, masks, caches)
    embed: float  # the first stage's embedding
    head: float  # the last stage's final norm and LM head
    memory_bytes: int

    def stage_seconds(self, layers: int, first: bool, last: bool) -> float:
        return self.stage + layers * self.layer + first * self.embed + last * self.head


@dataclass(frozen=True)
class NodeKind:
    name: str
    count: int
    speed: NodeSpeed


@dataclass(frozen=True)
class ModelSizes:
    """Bytes of the target's pieces, from its config: a plan needs no weights."""

    num_layers: int
    layer_bytes: int  # one decoder layer's weights
    embed_bytes: int  # the embedding (first stage)
    head_bytes: int  # the final norm and LM head (last stage)
    kv_bytes_per_token: int  # one layer's K and V of one token

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtype_bytes: int) -> ModelSizes:
        d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        attention = d * q + 2 * d * kv + q * d
        attention += (q + 2 * kv) * cfg.qkv_bias + d * cfg.o_bias
        mlp = 3 * d * cfg.intermediate_size + (2 * cfg.intermediate_size + d) * cfg.mlp_bias
        layer = attention + mlp + 2 * d  # and two RMSNorm weights
        return cls(
            num_layers=cfg.num_layers,
            layer_bytes=layer * dtype_bytes,
            embed_bytes=cfg.vocab_size * d * dtype_bytes,
            head_bytes=(cfg.vocab_size * d + d) * dtype_bytes,
            kv_bytes_per_token=2 * kv * dtype_bytes,
        )

    def stage_bytes(self, layers: int, first: bool, last: bool, kv_tokens: int) -> int:
        """Weights of a stage of `layers` layers plus their KV cache for `kv_tokens`."""
        weights = layers * self.layer_bytes + first * self.embed_bytes + last * self.head_bytes
        return weights + layers * self.kv_bytes_per_token * kv_tokens


@dataclass(frozen=True)
class PlannedStage:
    node: str
    layers: LayerRange
    step_seconds: float
    memory_bytes: int  # what it needs: weights and KV cache

    @property
    def layers_text(self) -> str:
        return f"{self.layers.start}:{self.layers.end}"


@dataclass(frozen=True)
class Plan:
    stages: tuple[PlannedStage, ...]

    @property
    def step_seconds(self) -> float:
        return max(s.step_seconds for s in self.stages)

    @property
    def ranges(self) -> list[LayerRange]:
        return [s.layers for s in self.stages]

    def to_dict(self) -> dict[str, object]:
        return {
            "stages": [
                {"node": s.node, "layers": s.layers_text, "step_seconds": s.step_seconds}
                for s in self.stages
            ],
            "step_seconds": self.step_seconds,
        }


def plan_split(
    sizes: ModelSizes,
    kinds: Sequence[NodeKind],
    kv_tokens: int,
    stages: int | None = None,
) -> Plan:
    """The best plan: `stages` stages, or (None) as many as make the slowest stage
    fastest, the fewest among equally fast plans."""
    _check(sizes, kinds, kv_tokens, stages)
    return _solve(sizes, kinds, kv_tokens, stages, None)


def assign_kinds(
    sizes: ModelSizes, kinds: Sequence[NodeKind], kv_tokens: int, ranges: Sequence[LayerRange]
) -> Plan:
    """The best kind for each stage of a given split (the same program, cuts fixed)."""
    _check(sizes, kinds, kv_tokens, len(ranges))
    cuts = np.zeros((sizes.num_layers + 1, sizes.num_layers + 1), dtype=bool)
    for r in ranges:
        cuts[r.start, r.end] = True
    return _solve(sizes, kinds, kv_tokens, len(ranges), cuts)


def smallest_stage_bytes(sizes: ModelSizes, kv_tokens: int) -> int:
    """Memory of the smallest stage there is: one layer in the middle, its KV cache."""
    return sizes.stage_bytes(1, False, False, kv_tokens)


def _check(
    sizes: ModelSizes, kinds: Sequence[NodeKind], kv_tokens: int, stages: int | None
) -> None:
    if sizes.num_layers < 1:
        raise PlanError("the model has no layers")
    if not kinds:
        raise PlanError("no nodes to plan on")
    names = [k.name for k in kinds]
    if len(set(names)) != len(names):
        raise PlanError(f"node kinds need distinct names, got {names}")
    for k in kinds:
        s = k.speed
        if k.count < 1:
            raise PlanError(f"node {k.name!r}: count must be >= 1, got {k.count}")
        costs = (s.layer, s.stage, s.embed, s.head)
        if not all(math.isfinite(c) and c >= 0 for c in costs) or s.memory_bytes <= 0:
            raise PlanError(f"node {k.name!r}: costs must be finite and >= 0, memory > 0")
    if kv_tokens < 0:
        raise PlanError(f"KV tokens must be >= 0, got {kv_tokens}")
    total = sum(k.count for k in kinds)
    if stages is not None and not 1 <= stages <= min(total, sizes.num_layers):
        raise PlanError(
            f"{stages} stages: need between 1 and min(nodes, layers) = "
            f"min({total}, {sizes.num_layers})"
        )


def _solve(
    sizes: ModelSizes,
    kinds: Sequence[NodeKind],
    kv_tokens: int,
    stages: int | None,
    cuts: np.ndarray | None,
) -> Plan:
    n = sizes.num_layers
    limit = min(stages or n, n)
    caps = [min(k.count, limit) for k in kinds]
    strides = [math.prod(c + 1 for c in caps[:i]) for i in range(len(caps))]
    num_used = math.prod(c + 1 for c in caps)
    if num_used * (n + 1) > MAX_STATES:
        raise PlanError(
            f"too many combinations of node counts to plan exactly ({num_used} for {n} layers): "
            "give fewer kinds or smaller counts"
        )
    used = np.array(
        [[(u // strides[k]) % (caps[k] + 1) for k in range(len(kinds))] for u in range(num_used)]
    ).reshape(num_used, len(kinds))

    # cost[k][i, j]: stage [i, j) on kind k; inf where empty, over memory or not allowed.
    a, b = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    size = b - a
    first, last = a == 0, b == n
    need = (
        size * (sizes.layer_bytes + sizes.kv_bytes_per_token * kv_tokens)
        + first * sizes.embed_bytes
        + last * sizes.head_bytes
    )
    costs = []
    for k in kinds:
        s = k.speed
        c = s.stage + size * s.layer + first * s.embed + last * s.head
        bad = (size < 1) | (need > s.memory_bytes)
        if cuts is not None:
            bad |= ~cuts
        costs.append(np.where(bad, np.inf, c.astype(float)))

    # best[i, u]: least slowest-stage time covering layers [0, i) using u nodes of each kind.
    best = np.full((n + 1, num_used), np.inf)
    best[0, 0] = 0.0
    from_layer = np.full((n + 1, num_used), -1, dtype=np.int64)
    from_kind = np.full((n + 1, num_used), -1, dtype=np.int64)
    for i in range(n):
        reached = np.isfinite(best[i])
        if not reached.any():
            continue
        for k, cost in enumerate(costs):
            src = np.nonzero(reached & (used[:, k] < caps[k]))[0]
            if not src.size:
                continue
            dst = src + strides[k]
            # cand[x, j']: from (i, src[x]) through a stage [i, i + 1 + j') on kind k.
            cand = np.maximum(best[i, src][:, None], cost[i, i + 1 :][None, :])
            current = best[i + 1 :, dst].T
            better = cand < current
            if not better.any():
                continue
            best[i + 1 :, dst] = np.where(better, cand, current).T
            from_layer[i + 1 :, dst] = np.where(better, i, from_layer[i + 1 :, dst].T).T
            from_kind[i + 1 :, dst] = np.where(better, k, from_kind[i + 1 :, dst].T).T

    counts = used.sum(axis=1)
    final = best[n].copy()
    if stages is not None:
        final[counts != stages] = np.inf
    if not np.isfinite(final).any():
        raise PlanError(_why_infeasible(sizes, kinds, kv_tokens, stages, cuts))
    low = final.min()
    tied = np.nonzero(final <= low * (1 + 1e-12))[0]
    u = int(tied[np.argmin(counts[tied])])  # the fewest stages among equally fast plans
    out, i = [], n
    while i > 0:
        j, k = int(from_layer[i, u]), int(from_kind[i, u])
        kind = kinds[k]
        r = LayerRange(j, i, n)
        out.append(
            PlannedStage(
                node=kind.name,
                layers=r,
                step_seconds=kind.speed.stage_seconds(r.size, r.is_first, r.is_last),
                memory_bytes=sizes.stage_bytes(r.size, r.is_first, r.is_last, kv_tokens),
            )
        )
        i, u = j, u - strides[k]
    return Plan(tuple(reversed(out)))


def _why_infeasible(
    sizes: ModelSizes,
    kinds: Sequence[NodeKind],
    kv_tokens: int,
    stages: int | None,
    cuts: np.ndarray | None,
) -> str:
    kv_text = f"KV cache for {kv_tokens} tokens"
    one = smallest_stage_bytes(sizes, kv_tokens)
    if all(k.speed.memory_bytes < one for k in kinds):
        offers = ", ".join(f"{k.name!r} {gib(k.speed.memory_bytes)}" for k in kinds)
        return (
            f"no node can hold even one layer: one layer needs {gib(one)} "
            f"({gib(sizes.layer_bytes)} weights + "
            f"{gib(sizes.kv_bytes_per_token * kv_tokens)} {kv_text}); the nodes offer {offers}"
        )
    need = sizes.stage_bytes(sizes.num_layers, True, True, kv_tokens)
    offered = sum(k.speed.memory_bytes * k.count for k in kinds)
    if offered < need:
        return (
            f"the model does not fit these nodes: it needs {gib(need)} (weights and "
            f"{kv_text}), the {sum(k.count for k in kinds)} nodes offer {gib(offered)} in all"
        )
    what = "this split" if cuts is not None else f"any split of {sizes.num_layers} layers"
    count = f" into {stages} stages" if stages is not None else ""
    return (
        f"{what}{count} over these nodes exceeds some node's memory (weights, the embedding "
        f"({gib(sizes.embed_bytes)}) on the first stage, the LM head ({gib(sizes.head_bytes)}) "
        f"on the last, and the {kv_text})"
    )


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.3g} GiB"
