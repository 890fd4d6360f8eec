"""The heterogeneous-node planner against brute force, model sizes against loaded stages,
and node profiles: flat and measured JSON, schema errors, emulated costs of a split."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from specpipe.common.model.config import ModelConfig
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange, plan_stages
from specpipe.common.perf.planner import (
    ModelSizes,
    NodeKind,
    NodeSpeed,
    PlanError,
    assign_kinds,
    plan_split,
)
from specpipe.common.perf.profile import (
    MeasureSettings,
    NodeProfile,
    ProfileError,
    emulated_costs,
    measure_profile,
)
from specpipe.common.runtime.stage import StageRuntime


def sizes_of(layers: int, layer: int = 10, embed: int = 30, head: int = 40, kv: int = 1):
    return ModelSizes(layers, layer, embed, head, kv)


def fits(sizes: ModelSizes, kind: NodeKind, r: LayerRange, kv_tokens: int) -> bool:
    need = sizes.stage_bytes(r.size, r.is_first, r.is_last, kv_tokens)
    return need <= kind.speed.memory_bytes


def brute_force(sizes, kinds, kv_tokens, stages=None, ranges=None) -> float:
    """The least slowest-stage time over every split and every sequence of kinds."""
    n, best = sizes.num_layers, float("inf")
    total = sum(k.count for k in kinds)
    counts = [stages] if stages else range(1, min(n, total) + 1)
    for s in counts:
        if ranges is not None:
            splits = [ranges]
        else:
            splits = [
                [LayerRange(a, b, n) for a, b in itertools.pairwise((0, *cuts, n))]
                for cuts in itertools.combinations(range(1, n), s - 1)
            ]
        for split in splits:
            for seq in itertools.product(range(len(kinds)), repeat=s):
                if any(seq.count(k) > kinds[k].count for k in range(len(kinds))):
                    continue
                if not all(
                    fits(sizes, kinds[k], r, kv_tokens) for k, r in zip(seq, split, strict=True)
                ):
                    continue
                t = max(
                    kinds[k].speed.stage_seconds(r.size, r.is_first, r.is_last)
                    for k, r in zip(seq, split, strict=True)
                )
                best = min(best, t)
    return best


def check_valid(plan, sizes, kinds, kv_tokens, stages=None) -> None:
    """Contiguous, covering, within memory and counts, and its times are its nodes'."""
    by_name = {k.name: k for k in kinds}
    assert plan.stages[0].layers.start == 0 and plan.stages[-1].layers.end == sizes.num_layers
    for x, y in itertools.pairwise(plan.stages):
        assert x.layers.end == y.layers.start
    for name, kind in by_name.items():
        assert sum(s.node == name for s in plan.stages) <= kind.count
    for s in plan.stages:
        kind = by_name[s.node]
        assert fits(sizes, kind, s.layers, kv_tokens)
        r = s.layers
        assert s.step_seconds == kind.speed.stage_seconds(r.size, r.is_first, r.is_last)
    if stages is not None:
        assert len(plan.stages) == stages


def random_case(rng: random.Random, memory: bool):
    n = rng.randint(1, 7)
    sizes = sizes_of(n, layer=rng.randint(1, 5), embed=rng.randint(0, 6), head=rng.randint(0, 6))
    kinds = []
    for i in range(rng.randint(1, 3)):
        speed = NodeSpeed(
            layer=rng.choice([0.5, 1.0, 2.5, 3.0]) * rng.randint(1, 4),
            stage=rng.choice([0.0, 0.5, 1.0]),
            embed=rng.choice([0.0, 1.0]),
            head=rng.choice([0.0, 1.0, 4.0]),
            memory_bytes=rng.randint(4, 30) if memory else 10**9,
        )
        kinds.append(NodeKind(f"k{i}", rng.randint(1, 3), speed))
    return sizes, kinds, rng.randint(0, 2) if memory else 0


@pytest.mark.parametrize("memory", [False, True], ids=["speed-only", "memory-binding"])
def test_plan_matches_brute_force_on_random_small_cases(memory: bool) -> None:
    rng, checked, infeasible = random.Random(26 + memory), 0, 0
    for _ in range(150):
        sizes, kinds, kv = random_case(rng, memory)
        total = sum(k.count for k in kinds)
        for stages in [None, *range(1, min(total, sizes.num_layers) + 1)]:
            want = brute_force(sizes, kinds, kv, stages)
            if want == float("inf"):
                with pytest.raises(PlanError):
                    plan_split(sizes, kinds, kv, stages)
                infeasible += 1
                continue
            plan = plan_split(sizes, kinds, kv, stages)
            check_valid(plan, sizes, kinds, kv, stages)
            assert plan.step_seconds == pytest.approx(want)
            checked += 1
    assert checked > 300 and (infeasible > 20 if memory else infeasible == 0)


def test_assigning_kinds_to_a_fixed_split_matches_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(100):
        sizes, kinds, kv = random_case(rng, memory=True)
        total = sum(k.count for k in kinds)
        s = rng.randint(1, min(total, sizes.num_layers))
        cuts = sorted(rng.sample(range(1, sizes.num_layers), s - 1))
        ranges = [
            LayerRange(a, b, sizes.num_layers)
            for a, b in itertools.pairwise((0, *cuts, sizes.num_layers))
        ]
        want = brute_force(sizes, kinds, kv, s, ranges)
        if want == float("inf"):
            with pytest.raises(PlanError):
                assign_kinds(sizes, kinds, kv, ranges)
            continue
        plan = assign_kinds(sizes, kinds, kv, ranges)
        assert plan.ranges == ranges
        check_valid(plan, sizes, kinds, kv, s)
        assert plan.step_seconds == pytest.approx(want)


def fast_slow(memory: int = 10**9) -> list[NodeKind]:
    fast = NodeSpeed(layer=1.0, stage=0.0, embed=0.0, head=1.0, memory_bytes=memory)
    slow = NodeSpeed(layer=2.5, stage=0.0, embed=0.0, head=2.5, memory_bytes=10**9)
    return [NodeKind("fast", 2, fast), NodeKind("slow", 2, slow)]


def test_fast_nodes_take_more_layers_and_the_head() -> None:
    sizes = sizes_of(24)
    plan = plan_split(sizes, fast_slow(), kv_tokens=0)
    assert len(plan.stages) == 4
    assert plan.stages[-1].node == "fast"  # the head goes to a fast node
    fast = [s.layers.size for s in plan.stages if s.node == "fast"]
    slow = [s.layers.size for s in plan.stages if s.node == "slow"]
    assert min(fast) > max(slow)
    assert plan.step_seconds == pytest.approx(brute_force(sizes, fast_slow(), 0))
    even = assign_kinds(sizes, fast_slow(), 0, [LayerRange(6 * i, 6 * i + 6, 24) for i in range(4)])
    assert even.step_seconds == pytest.approx(15.0)  # 6 layers on a slow node
    assert plan.step_seconds < even.step_seconds / 1.3


def test_memory_binds_the_fast_nodes() -> None:
    """Fast nodes that hold at most 5 layers (with their KV cache) take 5, not the 8 or 9
    their speed would earn them."""
    sizes = sizes_of(24, layer=10, embed=0, head=0, kv=1)
    kv = 4
    free = plan_split(sizes, fast_slow(), kv)
    bound = plan_split(sizes, fast_slow(memory=5 * 14), kv)
    assert max(s.layers.size for s in free.stages if s.node == "fast") > 5
    assert max(s.layers.size for s in bound.stages if s.node == "fast") <= 5
    assert bound.step_seconds > free.step_seconds
    assert bound.step_seconds == pytest.approx(brute_force(sizes, fast_slow(5 * 14), kv))
    for s in bound.stages:
        assert s.memory_bytes == s.layers.size * 14


def test_auto_takes_the_fewest_stages_among_equally_fast_plans() -> None:
    """A slow kind that cannot speed anything up is not used."""
    sizes = sizes_of(4)
    fast = NodeSpeed(layer=1.0, stage=0.0, embed=0.0, head=0.0, memory_bytes=10**9)
    slow = NodeSpeed(layer=10.0, stage=0.0, embed=0.0, head=0.0, memory_bytes=10**9)
    kinds = [NodeKind("fast", 4, fast), NodeKind("slow", 3, slow)]
    plan = plan_split(sizes, kinds, 0)
    assert [s.node for s in plan.stages] == ["fast"] * 4 and plan.step_seconds == 1.0
    # A fixed overhead per stage: one stage is as fast as any other count.
    flat = NodeSpeed(layer=0.0, stage=1.0, embed=0.0, head=0.0, memory_bytes=10**9)
    assert len(plan_split(sizes, [NodeKind("flat", 4, flat)], 0).stages) == 1


def test_a_node_too_small_for_any_layer_is_a_clear_error() -> None:
    sizes = sizes_of(4, layer=10, kv=2)
    tiny = NodeSpeed(layer=1.0, stage=0.0, embed=0.0, head=0.0, memory_bytes=11)
    with pytest.raises(PlanError, match=r"no node can hold even one layer.*'tiny'"):
        plan_split(sizes, [NodeKind("tiny", 8, tiny)], kv_tokens=1)
    # Enough layers per node, too few nodes for all of them:
    small = NodeSpeed(layer=1.0, stage=0.0, embed=0.0, head=0.0, memory_bytes=100)
    with pytest.raises(PlanError, match="does not fit these nodes"):
        plan_split(sizes_of(40), [NodeKind("small", 2, small)], kv_tokens=0)
    with pytest.raises(PlanError, match="between 1 and"):
        plan_split(sizes, [NodeKind("small", 2, small)], 0, stages=3)


def test_model_sizes_are_the_loaded_stages_bytes(llama_dir, qwen_dir) -> None:
    for model_dir in (llama_dir, qwen_dir):
        cfg = ModelConfig.from_dir(model_dir)
        n = cfg.num_layers
        sizes = ModelSizes.from_config(cfg, torch.float32.itemsize)
        for r in (LayerRange(0, 1, n), LayerRange(1, n - 1, n), LayerRange(n - 1, n, n)):
            runtime = StageRuntime(load_stage(model_dir, r, torch.float32))
            assert sizes.stage_bytes(r.size, r.is_first, r.is_last, 0) == runtime.model.num_bytes()
            # Whole blocks (the paged cache allocates by block), so rounding cannot hide a
            # wrong per-row size.
            rows = 3 * runtime.pool.block_size
            kv = sizes.stage_bytes(r.size, r.is_first, r.is_last, rows) - runtime.model.num_bytes()
            assert kv == runtime.pool.blocks_for(rows) * runtime.pool.block_bytes


# -- node profiles ---------------------------------------------------------------------------
FLAT = {"name": "l40", "seconds_per_layer": 0.004, "seconds_head": 0.006, "memory_gib": 44}


def test_flat_profile_costs_the_same_at_any_rows_and_context() -> None:
    p = NodeProfile.from_dict({**FLAT, "nodeSelector": {"gpu": "l40"}, "resources": {"x": 1}})
    assert p.memory_bytes == 44 << 30 and p.node_selector == {"gpu": "l40"}
    for rows, context in [(1, 0), (8, 2048), (512, 10**5)]:
        at = p.at(rows, context)
        assert (at.layer, at.head, at.embed, at.stage) == (0.004, 0.006, 0.0, 0.0)
    assert p.at(4, 100).stage_seconds(10, first=False, last=True) == pytest.approx(0.046)
    assert p.draft is None and p.model is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"memory_gib": None}, "memory_gib"),
        ({"memory_gib": 0}, "must be positive"),
        ({"seconds_per_layer": -1}, "must be a number >= 0"),
        ({"seconds_head": "fast"}, "must be a number >= 0"),
        ({"seconds_per_layr": 1}, "unknown field"),
        ({"name": ""}, "name"),
        ({"nodeSelector": ["a"]}, "must be an object"),
    ],
)
def test_profile_schema_errors(change: dict, message: str) -> None:
    raw = {k: v for k, v in {**FLAT, **change}.items() if v is not None}
    with pytest.raises(ProfileError, match=message):
        NodeProfile.from_dict(raw)


def test_measured_profile_schema_errors(tmp_path) -> None:
    curve = [{"context": 0, "rows": [1, 8], "seconds": [0.1, 0.2]}]
    good = {
        "format": 1,
        "name": "n",
        "memory_gib": 1,
        **dict.fromkeys(("layer", "stage", "embed", "head"), curve),
    }
    assert NodeProfile.from_dict(good).at(4, 0).layer == pytest.approx(0.1 + 0.1 * 3 / 7)
    for bad, message in [
        ({**good, "format": 2}, "format"),
        ({k: v for k, v in good.items() if k != "layer"}, "seconds_per_layer"),
        ({**good, "head": [{"context": 0, "rows": [8, 1], "seconds": [1, 1]}]}, "increasing"),
        ({**good, "head": {}}, "list of curves"),
    ]:
        with pytest.raises(ProfileError, match=message):
            NodeProfile.from_dict(bad)
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not JSON"):
        NodeProfile.load(path)
    with pytest.raises(ProfileError, match="a JSON object"):
        NodeProfile.from_dict([FLAT])


def test_a_noisy_curve_extrapolated_below_zero_costs_nothing() -> None:
    """A measured curve that slopes down (timing noise) would go negative past its last
    row count; a cost is never negative."""
    down = [{"context": 0, "rows": [1, 4], "seconds": [0.004, 0.001]}]
    raw = {"format": 1, "name": "n", "memory_gib": 1}
    p = NodeProfile.from_dict({**raw, **dict.fromkeys(("layer", "stage", "embed", "head"), down)})
    at = p.at(64, 0)
    assert (at.layer, at.stage, at.embed, at.head) == (0.0, 0.0, 0.0, 0.0)
    assert p.at(4, 0).layer == 0.001


def test_measured_profile_round_trips_and_prices_its_parts(llama_dir, qwen_dir, tmp_path) -> None:
    settings = MeasureSettings(rows=(1, 4), contexts=(8, 32), requests=2, repeats=1)
    p = measure_profile("cpu", llama_dir, "cpu", torch.float32, 3 << 30, settings)
    q = NodeProfile.load(p.save(tmp_path / "node.json"))
    assert q.to_dict() == p.to_dict()
    assert json.loads((tmp_path / "node.json").read_text())["model"]["num_layers"] == 5
    for rows, context in [(1, 8), (4, 32), (2, 20)]:
        at = q.at(rows, context)
        assert min(at.layer, at.stage, at.embed, at.head) >= 0
        assert at == p.at(rows, context)
    assert q.memory_bytes == 3 << 30 and q.dtype == "float32"
    q.check_model(ModelConfig.from_dir(llama_dir))
    with pytest.raises(ProfileError, match="measured with another model"):
        q.check_model(ModelConfig.from_dir(qwen_dir))


def test_emulated_costs_of_a_split_give_each_stage_its_nodes_cost() -> None:
    fast = NodeProfile.from_dict({**FLAT, "name": "fast", "seconds_stage": 0.001})
    slow = NodeProfile.from_dict(
        {**FLAT, "name": "slow", "seconds_per_layer": 0.01, "seconds_embed": 0.002}
    )
    split = [(slow, LayerRange(0, 3, 8)), (fast, LayerRange(3, 8, 8))]
    costs = emulated_costs(split)
    assert costs.num_stages == 2 and not costs.has_draft
    for rows in (1, 64, 300):
        assert costs.stage(0)(rows, 100) == pytest.approx(0.002 + 3 * 0.01)
        assert costs.stage(1)(rows, 100) == pytest.approx(0.001 + 5 * 0.004 + 0.006)


def test_even_and_balanced_splits_are_the_partition_modules(llama_dir) -> None:
    """The baselines the CLI compares against are `plan_stages`' splits."""
    cfg = ModelConfig.from_dir(llama_dir)
    sizes = ModelSizes.from_config(cfg, 4)
    kinds = [NodeKind("a", 2, NodeSpeed(1.0, 0.0, 0.0, 3.0, 10**9))]
    for split in ("even", "balanced"):
        ranges = plan_stages(cfg, 2, split)
        assert assign_kinds(sizes, kinds, 0, ranges).ranges == ranges
