"""Lossless decoding: every mode emits exactly what plain decoding of the target emits."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from specpipe.common.model.config import ModelConfig
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.common.spec.sampling import SamplingParams
from transformers import AutoModelForCausalLM

PROMPT = [5, 17, 33, 2, 8, 90, 41, 12, 60]
MIN_MARGIN = 1e-3  # top-1 minus top-2 logit of every greedy reference step (fp32 noise ~1e-5)


@functools.cache
def hf_greedy(model_dir: Path, prompt: tuple[int, ...], n: int) -> list[int]:
    """Greedy tokens of transformers' own model, recomputing the full sequence each time.

    Computed in fp64, and every step's margin between the best and second-best logit is
    checked: our engine runs fp32 with other shapes, which moves logits by ~1e-5, so a
    margin far above that makes the token comparison exact on any machine."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([seq])).logits[0, -1]
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] > MIN_MARGIN, f"near-tie after {seq}: pick another prompt"
            seq.append(int(logits.argmax()))
    return seq[len(prompt) :]


def generate(target, mode, stages, draft=None, prompt=PROMPT, dtype=torch.float32, **opts):
    dep = build_local(target, stages, draft, dtype)
    gen = LockstepGeneration(dep.pipeline, dep.draft, prompt, mode, DecodeOptions(**opts))
    gen.run()
    return gen


def stage_counts(model_dir: Path) -> list[int]:
    layers = ModelConfig.from_dir(model_dir).num_layers
    return sorted({1, 2, 3, layers})


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen_dir"])
@pytest.mark.parametrize("mode", [Mode.SPECPIPE, Mode.SPECINFER])
@pytest.mark.parametrize("draft_kind", ["oracle", "unrelated"])
def test_speculative_greedy_equals_transformers(fixture, mode, draft_kind, request) -> None:
    target = request.getfixturevalue(fixture)
    draft = (
        ORACLE_DRAFT if draft_kind == "oracle" else request.getfixturevalue("unrelated_draft_dir")
    )
    expect = hf_greedy(target, tuple(PROMPT), 24)
    for stages in stage_counts(target):
        gen = generate(target, mode, stages, draft, max_new_tokens=24, width=4, prefill_chunk=4)
        assert gen.output == expect, f"S={stages}"


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen_dir"])
def test_pp_and_autoregressive_greedy_equal_transformers(fixture, request) -> None:
    target = request.getfixturevalue(fixture)
    expect = hf_greedy(target, tuple(PROMPT), 24)
    assert generate(target, Mode.AUTOREGRESSIVE, 1, max_new_tokens=24).output == expect
    for stages in stage_counts(target):
        gen = generate(target, Mode.PP, stages, max_new_tokens=24, prefill_chunk=3)
        assert gen.output == expect, f"S={stages}"


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
def test_pp_emits_one_token_per_s_steps(llama_dir, stages) -> None:
    gen = generate(llama_dir, Mode.PP, stages, max_new_tokens=12)
    assert gen.stats.decode_steps == 12 * stages
    assert gen.stats.tokens_per_step == pytest.approx(1 / stages)


def test_oracle_draft_fills_the_pipeline(llama_dir) -> None:
    stages, n = 5, 60
    gen = generate(llama_dir, Mode.SPECPIPE, stages, ORACLE_DRAFT, max_new_tokens=n, width=8)
    s = gen.stats
    assert s.hit_rate >= 0.95
    # The first token needs S steps to cross the empty pipeline; afterwards ~1 per step.
    after_warmup = (s.new_tokens - 1) / (s.decode_steps - stages)
    assert after_warmup >= 0.9
    assert s.tokens_per_step > 3 / stages


def test_unrelated_draft_misses_but_stays_exact(llama_dir, unrelated_draft_dir) -> None:
    gen = generate(llama_dir, Mode.SPECPIPE, 3, unrelated_draft_dir, max_new_tokens=30, width=4)
    assert gen.stats.hit_rate < 0.5
    assert gen.output == hf_greedy(llama_dir, tuple(PROMPT), 30)


def test_tree_regrows_when_the_newest_layer_is_pruned_away(llama_dir, unrelated_draft_dir) -> None:
    """Width 2 and a poor draft: often both nodes of the newest layer hang under the child
    that loses verification; the tree must regrow from the survivors, output stays exact."""
    gen = generate(llama_dir, Mode.SPECPIPE, 4, unrelated_draft_dir, max_new_tokens=40, width=2)
    assert gen.stats.regrowths > 0
    assert gen.output == hf_greedy(llama_dir, tuple(PROMPT), 40)


def test_specinfer_accepts_long_paths_with_oracle(llama_dir) -> None:
    gen = generate(llama_dir, Mode.SPECINFER, 3, ORACLE_DRAFT, max_new_tokens=40, width=4, depth=6)
    assert max(gen.stats.accepted_lengths) == 7  # whole depth plus the bonus token
    assert gen.stats.decode_steps == 3 * len(gen.stats.accepted_lengths)


SAMPLING = [
    SamplingParams(temperature=0.8, seed=3),
    SamplingParams(temperature=1.0, top_k=5, seed=11),
    SamplingParams(temperature=1.3, top_p=0.7, seed=5),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=2),
]


@pytest.mark.parametrize(
    "sampling", SAMPLING, ids=lambda s: f"T{s.temperature}k{s.top_k}p{s.top_p}"
)
def test_fixed_seed_gives_the_same_tokens_in_every_mode(
    llama_dir, unrelated_draft_dir, sampling
) -> None:
    # float64: modes attend over differently shaped caches, so fp32 logits differ by ~1e-6
    # and a draw that lands that close to a CDF step could flip; fp64 isolates the algorithm.
    opts = dict(max_new_tokens=30, sampling=sampling, width=4, dtype=torch.float64)
    ref = generate(llama_dir, Mode.AUTOREGRESSIVE, 1, **opts).output
    assert len(set(ref)) > 3  # really sampled, not a constant
    for mode in Mode:
        for stages in (2, 3):
            for draft in (ORACLE_DRAFT, unrelated_draft_dir):
                out = generate(llama_dir, mode, stages, draft, **opts).output
                assert out == ref, f"{mode} S={stages} draft={draft}"


def test_different_seeds_give_different_samples(llama_dir) -> None:
    outs = {
        tuple(
            generate(
                llama_dir,
                Mode.PP,
                2,
                max_new_tokens=12,
                sampling=SamplingParams(temperature=1.0, seed=s),
            ).output
        )
        for s in range(4)
    }
    assert len(outs) > 1


def test_stops_at_stop_token(llama_dir) -> None:
    full = hf_greedy(llama_dir, tuple(PROMPT), 24)
    stop = full[5]
    gen = generate(
        llama_dir, Mode.SPECPIPE, 3, ORACLE_DRAFT, max_new_tokens=24, stop_token_ids=(stop,)
    )
    assert gen.output == full[: full.index(stop) + 1]
    assert gen.stats.finish_reason == "stop"


def test_prompt_of_one_token(llama_dir) -> None:
    gen = generate(llama_dir, Mode.SPECPIPE, 2, ORACLE_DRAFT, prompt=[7], max_new_tokens=8)
    assert gen.output == hf_greedy(llama_dir, (7,), 8)
    assert gen.stats.prefill_steps == 0


def test_every_request_releases_its_caches(llama_dir) -> None:
    dep = build_local(llama_dir, 3, ORACLE_DRAFT)
    gen = LockstepGeneration(
        dep.pipeline, dep.draft, PROMPT, Mode.SPECPIPE, DecodeOptions(max_new_tokens=5)
    )
    gen.run()
    assert all(s.cache_bytes_used == 0 for s in dep.pipeline.stages)
    assert dep.draft.runtime.cache_bytes_used == 0


@pytest.mark.parametrize(
    ("prompt", "match"), [([], "empty"), ([1, 500], "outside the vocabulary"), ([-1], "outside")]
)
def test_bad_prompts_are_rejected(llama_dir, prompt, match) -> None:
    dep = build_local(llama_dir, 2, None)
    with pytest.raises(ValueError, match=match):
        LockstepGeneration(dep.pipeline, None, prompt, Mode.PP, DecodeOptions(max_new_tokens=4))


def test_speculative_mode_needs_a_draft(llama_dir) -> None:
    dep = build_local(llama_dir, 2, None)
    with pytest.raises(ValueError, match="needs a draft"):
        LockstepGeneration(
            dep.pipeline, None, PROMPT, Mode.SPECPIPE, DecodeOptions(max_new_tokens=4)
        )


# -- several tree layers per step, token sources ---------------------------------------------


def _draft_of(source: str, request) -> str | Path | None:
    """The draft model of a token source (the n-gram source needs none)."""
    if source == "ngram":
        return None
    return ORACLE_DRAFT if source == "oracle" else request.getfixturevalue("unrelated_draft_dir")


def _layers_runs(target, source, stages, request, ks, **opts) -> dict[int, LockstepGeneration]:
    """One request per K on one fp64 deployment (exact comparisons across cache shapes)."""
    dep = build_local(target, stages, _draft_of(source, request), torch.float64)
    out = {}
    for k in ks:
        src = "ngram" if source == "ngram" else "draft"
        o = DecodeOptions(layers_per_step=k, token_source=src, **opts)
        out[k] = LockstepGeneration(dep.pipeline, dep.draft, PROMPT, Mode.SPECPIPE, o)
        out[k].run()
    return out


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen_dir"])
@pytest.mark.parametrize("source", ["oracle", "unrelated", "ngram"])
def test_several_layers_per_step_greedy_equals_transformers(fixture, source, request) -> None:
    target = request.getfixturevalue(fixture)
    expect = hf_greedy(target, tuple(PROMPT), 24)
    for stages in stage_counts(target):
        runs = _layers_runs(target, source, stages, request, (1, 2, 3),
                            max_new_tokens=24, width=4, prefill_chunk=4)  # fmt: skip
        for k, gen in runs.items():
            assert gen.output == expect, f"S={stages} K={k}"


@pytest.mark.parametrize("source", ["oracle", "unrelated", "ngram"])
@pytest.mark.parametrize("sampling", SAMPLING[::3], ids=lambda s: f"T{s.temperature}")
def test_several_layers_per_step_fixed_seed_equals_autoregressive(
    llama_dir, source, sampling, request
) -> None:
    opts = dict(max_new_tokens=24, sampling=sampling, width=4)
    ref = generate(llama_dir, Mode.AUTOREGRESSIVE, 1, dtype=torch.float64, **opts).output
    for stages in (2, 5):
        for k, gen in _layers_runs(llama_dir, source, stages, request, (1, 2, 3), **opts).items():
            assert gen.output == ref, f"S={stages} K={k}"


def test_oracle_draft_gives_the_ideal_tokens_per_step_for_one_and_two_layers(
    llama_dir, request
) -> None:
    """The target as its own draft, every token a hit: the first root crosses the empty
    pipeline with the K - 1 layers below it (S steps, K tokens), then each step verifies
    its group of K layers whole."""
    stages, n = 5, 48
    runs = _layers_runs(llama_dir, "oracle", stages, request, (1, 2), max_new_tokens=n, width=4)
    for k, gen in runs.items():
        st = gen.stats
        assert st.hits == st.new_tokens == n and st.regrowths == 0, f"K={k}"
        assert st.decode_steps == stages - 1 + -(-n // k), f"K={k}"
    assert runs[2].stats.tokens_per_step > 1.6  # more than one token per step
