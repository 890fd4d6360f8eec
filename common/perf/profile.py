"""Node profiles (docs/planning.md): how fast one kind of node runs the target's pieces
and how much memory it offers, measured (`specpipe profile`) or written by hand.

A profile prices any stage on that node: a stage holding layers [a, b) of a forward of
n rows at context c costs

    stage(n, c) + (b - a) * layer(n, c) + [a = 0] * embed(n, c) + [b = L] * head(n, c)

(`stage`: what a forward costs beyond its layers: positions, masks, cache bookkeeping).
The planner (`planner.py`) takes these numbers at one regime; `emulated_costs` turns a
split into the per-stage cost file `--emulate-costs` paces to. The JSON schema, flat and
measured, is in docs/planning.md.

One module: a measured profile and one written by hand are the same `NodeProfile` with
one JSON schema, and the measurement is what fills it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..model.config import ModelConfig
from ..model.partition import LayerRange
from .cost_model import BUDGET_ROWS, CostCurve, DeploymentCosts, measure_runtime
from .emulate import FLAT_ROWS, EmulatedCosts, ForwardCost
from .planner import NodeSpeed

PROFILE_FORMAT = 1
GIB = 1 << 30
PROFILE_CONTEXTS = (128, 512, 2048)  # cached rows the curves are measured at by default
PROFILE_REQUESTS = 8  # a forward's rows belong to up to this many requests (batched)
# What must agree between the target a profile was measured with and the one planned:
# a decoder layer's shape (the number of layers may differ).
SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
)
_FLAT_KEYS = {
    "name",
    "seconds_per_layer",
    "seconds_head",
    "memory_gib",
    "seconds_embed",
    "seconds_stage",
    "seconds_draft",
    "dtype",
    "nodeSelector",
    "resources",
}
_MEASURED_KEYS = {
    "format",
    "name",
    "memory_gib",
    "layer",
    "stage",
    "embed",
    "head",
    "draft",
    "dtype",
    "model",
    "device",
    "measured",
    "nodeSelector",
    "resources",
}


class ProfileError(ValueError):
    """A node profile that cannot be used (bad JSON, a missing or wrong field)."""


@dataclass(frozen=True)
class NodeProfile:
    name: str
    layer: ForwardCost  # one decoder layer
    stage: ForwardCost  # a stage's forward beyond its layers
    embed: ForwardCost  # the first stage's embedding
    head: ForwardCost  # the last stage's final norm and LM head
    memory_bytes: int
    draft: ForwardCost | None = None  # the draft model's whole forward, if measured
    dtype: str | None = None  # the weights' dtype it was measured with
    model: dict[str, Any] | None = None  # the target's shape it was measured with
    node_selector: dict[str, Any] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # device, when measured: kept

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    def at(self, rows: int, context: int) -> NodeSpeed:
        """Costs at `rows` rows a forward and `context`; never negative (a curve measured
        with noise can slope down, and beyond its last row count it is extrapolated)."""

        def cost(f: ForwardCost) -> float:
            return max(0.0, f(rows, context))

        return NodeSpeed(
            layer=cost(self.layer),
            stage=cost(self.stage),
            embed=cost(self.embed),
            head=cost(self.head),
            memory_bytes=self.memory_bytes,
        )

    def stage_cost(self, layers: LayerRange) -> ForwardCost:
        """The cost of a stage holding `layers` on this node, at this profile's row counts
        and context lengths."""
        parts = (self.layer, self.stage, self.embed, self.head)
        contexts = sorted({c for p in parts for c in p.contexts})
        rows = sorted({r for p in parts for c in p.curves for r in c.rows})

        def seconds(n: int, c: int) -> float:
            return self.at(n, c).stage_seconds(layers.size, layers.is_first, layers.is_last)

        curves = tuple(CostCurve(rows, [seconds(n, c) for n in rows]) for c in contexts)
        return ForwardCost(tuple(contexts), curves)

    def check_model(self, cfg: ModelConfig) -> None:
        """A measured profile prices layers of the shape it was measured with only."""
        if self.model is None:
            return
        theirs = {k: self.model.get(k) for k in SHAPE_FIELDS}
        ours = {k: getattr(cfg, k) for k in SHAPE_FIELDS}
        if theirs != ours:
            diff = ", ".join(f"{k} {theirs[k]} vs {ours[k]}" for k in ours if theirs[k] != ours[k])
            raise ProfileError(
                f"node profile {self.name!r} was measured with another model "
                f"({self.model.get('name', '?')}: {diff}); profile the node with this target"
            )

    # -- JSON ----------------------------------------------------------------------------
    @classmethod
    def flat(
        cls,
        name: str,
        seconds_per_layer: float,
        seconds_head: float,
        memory_gib: float,
        seconds_embed: float = 0.0,
        seconds_stage: float = 0.0,
        seconds_draft: float | None = None,
        **kw: Any,
    ) -> NodeProfile:
        """Accelerator-like: every forward costs the same whatever its rows and context."""
        draft = None if seconds_draft is None else flat_cost(seconds_draft)
        return cls(
            name=name,
            layer=flat_cost(seconds_per_layer),
            stage=flat_cost(seconds_stage),
            embed=flat_cost(seconds_embed),
            head=flat_cost(seconds_head),
            memory_bytes=round(memory_gib * GIB),
            draft=draft,
            **kw,
        )

    @classmethod
    def from_dict(cls, d: Any) -> NodeProfile:
        if not isinstance(d, dict):
            raise ProfileError("a node profile is a JSON object")
        name = d.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ProfileError('a node profile needs a "name" (a non-empty string)')
        flat = "seconds_per_layer" in d
        allowed = _FLAT_KEYS if flat else _MEASURED_KEYS
        unknown = sorted(set(d) - allowed)
        if unknown:
            form = "flat" if flat else "measured"
            raise ProfileError(
                f"node profile {name!r}: unknown field(s) {unknown} for the {form} form "
                f"(allowed: {sorted(allowed)})"
            )
        common = dict(
            dtype=_optional_str(d, "dtype", name),
            node_selector=_optional_dict(d, "nodeSelector", name),
            resources=_optional_dict(d, "resources", name),
        )
        memory = _seconds(d, "memory_gib", name, required=True)
        if not memory > 0:
            raise ProfileError(f'node profile {name!r}: "memory_gib" must be positive')
        if flat:
            return cls.flat(
                name,
                seconds_per_layer=_seconds(d, "seconds_per_layer", name, required=True),
                seconds_head=_seconds(d, "seconds_head", name, required=True),
                memory_gib=memory,
                seconds_embed=_seconds(d, "seconds_embed", name) or 0.0,
                seconds_stage=_seconds(d, "seconds_stage", name) or 0.0,
                seconds_draft=_seconds(d, "seconds_draft", name),
                **common,
            )
        if "layer" not in d:
            raise ProfileError(
                f'node profile {name!r}: give "seconds_per_layer", "seconds_head" and '
                '"memory_gib" (flat form), or measured curves ("format", "layer", ...: '
                "what `specpipe profile` writes)"
            )
        if d.get("format") != PROFILE_FORMAT:
            raise ProfileError(
                f'node profile {name!r}: "format" must be {PROFILE_FORMAT}, got {d.get("format")!r}'
            )
        model = d.get("model")
        if model is not None and not isinstance(model, dict):
            raise ProfileError(f'node profile {name!r}: "model" must be an object')
        extra = {k: d[k] for k in ("device", "measured") if k in d}
        return cls(
            name=name,
            layer=_cost(d, "layer", name),
            stage=_cost(d, "stage", name),
            embed=_cost(d, "embed", name),
            head=_cost(d, "head", name),
            memory_bytes=round(memory * GIB),
            draft=_cost(d, "draft", name) if d.get("draft") is not None else None,
            model=model,
            extra=extra,
            **common,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": PROFILE_FORMAT, "name": self.name}
        if self.dtype:
            out["dtype"] = self.dtype
        out["memory_gib"] = round(self.memory_gib, 4)
        out.update(self.extra)
        if self.model is not None:
            out["model"] = self.model
        for key in ("layer", "stage", "embed", "head", "draft"):
            cost = getattr(self, key)
            out[key] = cost_to_list(cost) if cost is not None else None
        if self.node_selector:
            out["nodeSelector"] = self.node_selector
        if self.resources:
            out["resources"] = self.resources
        return out

    @classmethod
    def load(cls, path: str | Path) -> NodeProfile:
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as e:
            raise ProfileError(f"node profile {path}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise ProfileError(f"node profile {path}: not JSON ({e})") from None
        try:
            return cls.from_dict(raw)
        except ProfileError as e:
            raise ProfileError(f"{path}: {e}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path


def flat_cost(seconds: float) -> ForwardCost:
    return ForwardCost((0,), (CostCurve(list(FLAT_ROWS), [float(seconds)] * len(FLAT_ROWS)),))


def cost_to_list(cost: ForwardCost) -> list[dict[str, Any]]:
    return [
        {"context": c, **curve.to_dict()}
        for c, curve in zip(cost.contexts, cost.curves, strict=True)
    ]


def _cost(d: dict, key: str, name: str) -> ForwardCost:
    """`[{"context": C, "rows": [...], "seconds": [...]}, ...]` -> a ForwardCost."""
    levels = d.get(key)
    if not isinstance(levels, list) or not levels:
        raise ProfileError(
            f'node profile {name!r}: "{key}" must be a list of curves '
            '[{"context": C, "rows": [...], "seconds": [...]}, ...]'
        )
    try:
        pairs = sorted(
            ((int(level["context"]), CostCurve.from_dict(level)) for level in levels),
            key=lambda p: p[0],
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f'node profile {name!r}: "{key}": {e}') from None
    contexts = [c for c, _ in pairs]
    if len(set(contexts)) != len(contexts) or contexts[0] < 0:
        raise ProfileError(f'node profile {name!r}: "{key}": one curve per context >= 0')
    return ForwardCost(tuple(contexts), tuple(c for _, c in pairs))


def _seconds(d: dict, key: str, name: str, required: bool = False) -> float | None:
    value = d.get(key)
    if value is None:
        if required:
            raise ProfileError(f'node profile {name!r}: "{key}" is missing')
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e12:
        raise ProfileError(f'node profile {name!r}: "{key}" must be a number >= 0, got {value!r}')
    return float(value)


def _optional_dict(d: dict, key: str, name: str) -> dict[str, Any]:
    value = d.get(key, {})
    if not isinstance(value, dict):
        raise ProfileError(f'node profile {name!r}: "{key}" must be an object')
    return value


def _optional_str(d: dict, key: str, name: str) -> str | None:
    value = d.get(key)
    if value is not None and not isinstance(value, str):
        raise ProfileError(f'node profile {name!r}: "{key}" must be a string')
    return value


# -- a split as emulated devices ------------------------------------------------------------
def emulated_costs(
    stages: Sequence[tuple[NodeProfile, LayerRange]], draft: ForwardCost | None = None
) -> EmulatedCosts:
    """The cost file `specpipe up --emulate-costs` paces a split to: stage k's curve is its
    node's cost for its layers (`NodeProfile.stage_cost`), at every context length any of
    the profiles was measured at; `draft` paces the draft (None: unpaced)."""
    costs = [p.stage_cost(r) for p, r in stages]
    contexts = sorted({c for f in [*costs, *([draft] if draft else [])] for c in f.contexts})
    rows = sorted({r for f in costs for c in f.curves for r in c.rows})

    def curve(f: ForwardCost, context: int) -> CostCurve:
        return CostCurve(rows, [f(n, context) for n in rows])

    levels = [
        DeploymentCosts(c, [curve(f, c) for f in costs], curve(draft, c) if draft else None)
        for c in contexts
    ]
    for level in levels:
        level.notes["split"] = " ".join(f"{p.name}:{r.start}:{r.end}" for p, r in stages)
    return EmulatedCosts(levels, "node profiles")


# -- measuring this node ---------------------------------------------------------------------
@dataclass(frozen=True)
class MeasureSettings:
    rows: tuple[int, ...] = BUDGET_ROWS
    contexts: tuple[int, ...] = PROFILE_CONTEXTS
    requests: int = PROFILE_REQUESTS
    repeats: int = 3


def model_shape(cfg: ModelConfig, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "num_layers": cfg.num_layers,
        **{k: getattr(cfg, k) for k in SHAPE_FIELDS},
    }


def measure_profile(
    name: str,
    target: str | Path,
    device: str,
    dtype: torch.dtype,
    memory_bytes: int,
    settings: MeasureSettings = MeasureSettings(),
    draft: str | Path | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> NodeProfile:
    """Measure this node on the target's layers: stages of one layer in the middle, of
    up to four, the first layer (with the embedding) and the last (with norm and head),
    each loaded alone (a node need not hold the model) and timed by `measure_runtime`
    at every context and row count; their differences are the parts of a stage.
    `memory_bytes`: what the node offers for weights and KV cache (taken before any
    of this was loaded)."""
    from ..model.loading import load_stage
    from ..runtime.stage import StageRuntime

    cfg = ModelConfig.from_dir(target)
    n = cfg.num_layers
    if n < 3:
        raise ProfileError(f"profiling needs a target of 3 layers or more, {target} has {n}")
    max_context = cfg.max_position_embeddings - max(settings.rows) - 1
    contexts = sorted({min(c, max_context) for c in settings.contexts if c >= 0})
    if not contexts or contexts[0] < 0:
        raise ProfileError(f"no context length fits the model's {cfg.max_position_embeddings}")
    many = min(4, n - 2)

    def measure(model_dir: str | Path, layers: LayerRange | None, what: str) -> list[CostCurve]:
        started = time.perf_counter()
        runtime = StageRuntime(load_stage(model_dir, layers, dtype, device))
        curves = [
            measure_runtime(runtime, settings.rows, c, settings.repeats, settings.requests)
            for c in contexts
        ]
        del runtime
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        log(f"{what}: {time.perf_counter() - started:.1f} s")
        return curves

    one = measure(target, LayerRange(1, 2, n), "one middle layer")
    several = (
        measure(target, LayerRange(1, 1 + many, n), f"{many} middle layers") if many > 1 else one
    )
    first = measure(target, LayerRange(0, 1, n), "the first layer and the embedding")
    last = measure(target, LayerRange(n - 1, n, n), "the last layer, norm and LM head")
    draft_curves = measure(draft, None, "the draft") if draft is not None else None

    def part(fn: Callable[[float, float, float, float], float]) -> ForwardCost:
        curves = []
        for o, s, f, la in zip(one, several, first, last, strict=True):
            seconds = [
                max(0.0, fn(*x))
                for x in zip(o.seconds, s.seconds, f.seconds, la.seconds, strict=True)
            ]
            curves.append(CostCurve(list(settings.rows), seconds))
        return ForwardCost(tuple(contexts), tuple(curves))

    def layer_of(o: float, s: float) -> float:
        """The slope between one layer and several; where noise made it not positive,
        the mean over the several (every second counted as the layers')."""
        if many > 1 and s > o:
            return (s - o) / (many - 1)
        return s / many

    return NodeProfile(
        name=name,
        layer=part(lambda o, s, f, la: layer_of(o, s)),
        stage=part(lambda o, s, f, la: o - layer_of(o, s)),
        embed=part(lambda o, s, f, la: f - o),
        head=part(lambda o, s, f, la: la - o),
        memory_bytes=memory_bytes,
        draft=ForwardCost(tuple(contexts), tuple(draft_curves)) if draft_curves else None,
        dtype=str(dtype).removeprefix("torch."),
        model=model_shape(cfg, Path(target).name),
        extra={
            "device": device_facts(device),
            "measured": {
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "requests": settings.requests,
                "repeats": settings.repeats,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "draft": Path(draft).name if draft is not None else None,
            },
        },
    )


def device_facts(device: str) -> dict[str, Any]:
    dev = torch.device(device)
    facts: dict[str, Any] = {"type": dev.type, "spec": device}
    if dev.type == "cuda":
        facts["name"] = torch.cuda.get_device_name(dev)
        facts["total_gib"] = round(torch.cuda.get_device_properties(dev).total_memory / GIB, 2)
    else:
        import platform

        facts["name"] = platform.processor() or platform.machine()
    return facts
