"""Sampling: the target's distribution, filtered exactly as transformers filters it."""

from __future__ import annotations

import pytest
import torch
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.common.spec.sampling import (
    SamplingParams,
    draft_probs,
    draw_index,
    position_uniform,
    target_probs,
)
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..conftest import make_tiny_model


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=4),
        SamplingParams(temperature=1.5, top_p=0.6),
        SamplingParams(temperature=0.9, top_k=7, top_p=0.8),
    ],
)
def test_filtering_matches_transformers_warpers(params: SamplingParams) -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 50, dtype=torch.float64) * 3
    ref = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        ref = TopKLogitsWarper(params.top_k)(None, ref)
    if params.top_p < 1:
        ref = TopPLogitsWarper(params.top_p)(None, ref)
    torch.testing.assert_close(target_probs(logits[0], params), torch.softmax(ref[0], -1))


def test_draw_depends_only_on_seed_and_position() -> None:
    assert position_uniform(1, 5) == position_uniform(1, 5)
    assert position_uniform(1, 5) != position_uniform(1, 6)
    assert position_uniform(1, 5) != position_uniform(2, 5)


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert int(draw_index(logits, SamplingParams(), 0)) == 1


def test_never_draws_a_filtered_token() -> None:
    logits = torch.tensor([5.0, 4.0, 0.0, -3.0, 1.0])
    draws = {
        int(draw_index(logits, SamplingParams(1.0, 2, 1.0, seed), p))
        for seed in range(50)
        for p in range(4)
    }
    assert draws == {0, 1}


@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(0.8, 3, 0.9, 7)], ids=["greedy", "sampled"]
)
def test_the_draw_stays_on_the_logits_device(params) -> None:
    """On a GPU the logits stay where the last stage computed them; a host tensor in the
    draw fails there (torch.searchsorted across devices). Logits on the meta device check
    the placement on any machine: an op that mixes them with a host tensor raises."""
    idx = draw_index(torch.randn(97).to("meta"), params, position=3)
    assert idx.device.type == "meta" and idx.dim() == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"seed": -2},
        {"temperature": float("nan")},
    ],
)
def test_invalid_sampling_params(kwargs) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_specpipe_samples_from_the_target_distribution(tmp_path) -> None:
    """Joint distribution of the first two tokens over many seeds vs. the exact target one."""
    vocab = 4
    target = make_tiny_model(
        tmp_path / "t", layers=2, hidden=16, heads=2, kv_heads=1, vocab=vocab, init=0.15
    )
    prompt = [1, 3, 2]
    params = dict(temperature=1.0)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
        seqs = torch.tensor([[*prompt, t] for t in range(vocab)])
        p2 = torch.softmax(hf(seqs).logits[:, -1], -1)
    joint = (p1[:, None] * p2).flatten()

    dep = build_local(target, 2, ORACLE_DRAFT, torch.float64)
    runs = 800
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for seed in range(runs):
        opts = DecodeOptions(
            max_new_tokens=2, sampling=SamplingParams(seed=seed, **params), width=3
        )
        a, b = LockstepGeneration(dep.pipeline, dep.draft, prompt, Mode.SPECPIPE, opts).run()
        counts[a * vocab + b] += 1
    expected = joint * runs
    keep = expected >= 5  # chi-square needs populated cells; pool the rest
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expect = torch.cat([expected[keep], expected[~keep].sum()[None]])
    chi2 = float(((observed - expect) ** 2 / expect.clamp(min=1e-9)).sum())
    dof = int(keep.sum())  # cells - 1 (+1 for the pooled cell)
    # 99.9th percentile of chi-square via the Wilson-Hilferty approximation.
    z = 3.09
    critical = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    assert chi2 < critical, f"chi2={chi2:.1f} dof={dof} critical={critical:.1f}"
    assert (counts > 0).sum() >= 10  # the test really sampled many outcomes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_probs_skip_no_division_they_need(dtype) -> None:
    """Greedy (and temperature 1) take the softmax of the logits as they are: bit for
    bit what dividing by 1 gave; another temperature divides first, as before."""
    logits = (torch.randn(4, 512, generator=torch.Generator().manual_seed(3)) * 5).to(dtype)
    for temperature in (0.0, 1.0):
        expected = torch.softmax(logits.float() / 1.0, dim=-1)
        assert torch.equal(draft_probs(logits, temperature), expected)
    expected = torch.softmax(logits.float() / 0.7, dim=-1)
    assert torch.equal(draft_probs(logits, 0.7), expected)
