"""Our model code against transformers' own implementation."""

from __future__ import annotations

import pytest
import torch
from specpipe.common.model.config import ModelConfig
from specpipe.common.model.layers import StageModel
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import (
    LayerRange,
    parameter_layer_costs,
    split_layers,
    split_layers_by_cost,
)
from transformers import AutoModelForCausalLM


def run_chain(stages: list[StageModel], tokens: torch.Tensor) -> torch.Tensor:
    """Causal forward of a whole sequence through a chain of stages; returns logits."""
    positions = torch.arange(tokens.numel())
    hidden = stages[0].embed(tokens)
    for stage in stages:
        hidden = stage(hidden, positions)
    return stages[-1].logits(hidden)


# Model comparisons run in fp64: ours and transformers' reduce in other orders (other
# kernels, other shapes), and in fp32 that differs by ~1e-5 from one CPU to the next. In
# fp64 the difference is ~1e-13, so a tight tolerance checks the math, not the machine.
F64 = torch.float64
TIGHT = dict(atol=1e-9, rtol=1e-9)


def hf_logits(model_dir, tokens: torch.Tensor) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=F64).eval()
    with torch.no_grad():
        return hf(tokens[None]).logits[0].double()


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen_dir"])
def test_full_model_logits_match_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(fixture)
    tokens = torch.tensor([3, 17, 42, 5, 88, 13, 2, 64, 31, 7, 19])
    ours = run_chain([load_stage(model_dir, dtype=F64)], tokens)
    ref = hf_logits(model_dir, tokens)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours.double(), ref, **TIGHT)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen_dir"])
def test_every_stage_split_equals_whole_model(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(fixture)
    cfg = ModelConfig.from_dir(model_dir)
    tokens = torch.tensor([9, 8, 7, 6, 5, 4, 3])
    whole = run_chain([load_stage(model_dir, dtype=F64)], tokens)
    for num_stages in range(1, cfg.num_layers + 1):
        ranges = split_layers(cfg.num_layers, num_stages)
        stages = [load_stage(model_dir, r, F64) for r in ranges]
        torch.testing.assert_close(run_chain(stages, tokens), whole, **TIGHT)


def test_stage_loads_only_its_share(llama_dir) -> None:
    cfg = ModelConfig.from_dir(llama_dir)
    middle = load_stage(llama_dir, LayerRange(1, 3, cfg.num_layers))
    whole = load_stage(llama_dir)
    assert middle.embed_tokens is None and middle.lm_head is None and len(middle.layers) == 2
    layer_bytes = sum(p.numel() * 4 for p in whole.layers[0].parameters())
    assert middle.num_bytes() == 2 * layer_bytes


def test_tied_head_shares_embedding(qwen_dir) -> None:
    model = load_stage(qwen_dir)
    assert ModelConfig.from_dir(qwen_dir).tie_word_embeddings
    assert torch.equal(model.lm_head.weight, model.embed_tokens.weight)


def test_bfloat16_stays_close_to_float32(llama_dir) -> None:
    tokens = torch.tensor([1, 2, 3, 4, 5, 6])
    f32 = run_chain([load_stage(llama_dir)], tokens)
    bf16 = run_chain([load_stage(llama_dir, dtype=torch.bfloat16)], tokens)
    assert bf16.dtype == torch.float32  # logits are always returned in fp32
    rel = (bf16 - f32).norm() / f32.norm()
    assert rel < 0.05


@pytest.mark.parametrize(
    ("layers", "stages", "weights", "expect"),
    [
        (5, 1, None, [(0, 5)]),
        (5, 2, None, [(0, 2), (2, 5)]),
        (5, 5, None, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
        (12, 3, [1.0, 2.0, 1.0], [(0, 3), (3, 9), (9, 12)]),
        (4, 3, [100.0, 1.0, 1.0], [(0, 2), (2, 3), (3, 4)]),
    ],
)
def test_split_layers(layers, stages, weights, expect) -> None:
    got = [(r.start, r.end) for r in split_layers(layers, stages, weights)]
    assert got == expect


def test_split_layers_rejects_more_stages_than_layers() -> None:
    with pytest.raises(ValueError, match="cannot split"):
        split_layers(3, 4)


def _max_cost(costs: list[float], ranges) -> float:
    return max(sum(costs[r.start : r.end]) for r in ranges)


@pytest.mark.parametrize("seed", range(20))
def test_cost_split_is_contiguous_and_optimal(seed: int) -> None:
    import itertools
    import random

    rng = random.Random(seed)
    n = rng.randint(1, 9)
    stages = rng.randint(1, n)
    costs = [rng.uniform(0.1, 5.0) for _ in range(n)]
    ranges = split_layers_by_cost(costs, stages)
    assert ranges[0].start == 0 and ranges[-1].end == n and len(ranges) == stages
    assert all(a.end == b.start for a, b in itertools.pairwise(ranges))
    best = min(
        _max_cost(costs, [LayerRange(a, b, n) for a, b in itertools.pairwise((0, *cuts, n))])
        for cuts in itertools.combinations(range(1, n), stages - 1)
    )
    assert _max_cost(costs, ranges) == pytest.approx(best)


def test_balanced_split_gives_the_lm_head_stage_fewer_layers(llama_dir) -> None:
    from dataclasses import replace

    from specpipe.common.model.partition import plan_stages

    cfg = replace(ModelConfig.from_dir(llama_dir), num_layers=8, vocab_size=48 * 40)
    costs = parameter_layer_costs(cfg)
    assert costs[-1] > 2 and costs[0] == 1.0
    ranges = plan_stages(cfg, 4, "balanced")
    assert ranges[-1].size < ranges[0].size
    assert _max_cost(costs, ranges) < _max_cost(costs, plan_stages(cfg, 4, "even"))


def test_sliding_window_models_are_capped_to_the_window(llama_dir) -> None:
    import json

    raw = json.loads((llama_dir / "config.json").read_text())
    mistral = ModelConfig.from_dict({**raw, "model_type": "mistral", "sliding_window": 64})
    assert mistral.max_position_embeddings == 64
    qwen_off = ModelConfig.from_dict(
        {**raw, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": False}
    )
    assert qwen_off.max_position_embeddings == raw["max_position_embeddings"]
