"""The services emit exactly the tokens of the in-process engine: every mode, both
transports, greedy and seeded sampling, multi-chunk prefill, stopping at EOS."""

from __future__ import annotations

import pytest
from specpipe.common.runtime.loader import build_local, parse_dtype
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.spec.options import DecodeOptions
from specpipe.common.spec.sampling import SamplingParams

from specpipe.client import Client

from .conftest import DTYPE, EOS, reference, reference_run

MODES = ["specpipe", "pp", "specinfer", "autoregressive"]
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]


def _deployment(request, transport: str):
    return request.getfixturevalue(f"{transport}_deployment")


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
@pytest.mark.parametrize("mode", MODES)
def test_mode_matches_engine(request, transport: str, mode: str) -> None:
    dep = _deployment(request, transport)
    stages = len(dep.ranges)
    n = 24 if transport == "tcp" else 12  # UCX hops are slow on an oversubscribed 2-core box
    with Client(dep.router_address, timeout=60) as client:
        for temperature, seed, prompt in [(0.0, 0, PROMPT), (0.9, 7, PROMPT[:3]), (0.0, 0, [5])]:
            got = client.generate(
                prompt_ids=prompt,
                mode=mode,
                max_new_tokens=n,
                temperature=temperature,
                seed=seed,
                ignore_eos=True,
                prefill_chunk=4,
            )
            ref = reference_run(
                dep.target, dep.draft, stages, prompt, mode, n, temperature, seed, prefill_chunk=4
            )
            assert got.token_ids == ref.output, (mode, temperature, prompt)
            assert got.finish_reason == "length"
            assert got.stats["new_tokens"] == n
            # autoregressive is plain decoding: one stage in the accounting, wherever it runs
            assert got.stats["stages"] == (1 if mode == "autoregressive" else stages)
            # One controller behind both executors: the same step accounting, whenever the
            # draft answered in time (pp, autoregressive and specinfer never wait for it).
            assert got.stats["prefill_steps"] == ref.stats.prefill_steps
            if got.stats["late_draft_answers"] == 0:
                assert got.stats["decode_steps"] == ref.stats.decode_steps, (mode, prompt)
                assert got.stats["hit_rate"] == round(ref.stats.hit_rate, 6)
                assert got.stats["regrowths"] == ref.stats.regrowths
            else:
                assert mode == "specpipe"
                assert got.stats["decode_steps"] >= ref.stats.decode_steps


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_nucleus_sampling_and_eos_stop_match_engine(request, transport: str) -> None:
    dep = _deployment(request, transport)
    stages = len(dep.ranges)
    with Client(dep.router_address, timeout=60) as client:
        got = client.generate(
            prompt_ids=PROMPT,
            mode="specpipe",
            max_new_tokens=40,
            temperature=1.3,
            top_p=0.9,
            top_k=20,
            seed=11,
        )
    want = reference(
        dep.target,
        dep.draft,
        stages,
        PROMPT,
        "specpipe",
        40,
        1.3,
        11,
        top_p=0.9,
        top_k=20,
        stop_token_ids=(EOS,),
    )
    assert got.token_ids == want
    assert got.finish_reason == ("stop" if want[-1] == EOS and len(want) < 40 else "length")


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_every_layers_per_step_and_token_source_is_lossless(request, transport: str) -> None:
    """Several tree layers per step, the n-gram and hybrid sources and eager growth emit
    exactly plain decoding's tokens, greedy and seeded, with the target as its own draft (tcp, S = 2)
    and an unrelated draft (ucx, S = 3)."""
    dep = _deployment(request, transport)
    stages = len(dep.ranges)
    n, layers = (20, (1, 2, 3)) if transport == "tcp" else (10, (2, 3))
    with Client(dep.router_address, timeout=90) as client:
        for temperature, seed, prompt in [(0.0, 0, PROMPT), (0.9, 7, PROMPT[:3])]:
            ref = reference(
                dep.target, dep.draft, stages, prompt, "autoregressive", n, temperature, seed
            )
            common = dict(prompt_ids=prompt, max_new_tokens=n, ignore_eos=True,
                          temperature=temperature, seed=seed)  # fmt: skip
            for k in layers:
                for source in ("draft", "ngram", "hybrid"):
                    got = client.generate(**common, layers_per_step=k, token_source=source)
                    case = (k, source, temperature)
                    assert got.token_ids == ref, case
                    assert (got.stats["layers_per_step"], got.stats["token_source"]) == (k, source)
                eager = client.generate(**common, layers_per_step=k, growth="eager")
                assert eager.token_ids == ref, (k, "eager", temperature)


def test_logprobs_and_verification_at_the_last_stage(tcp_deployment) -> None:
    """With verification at the last stage, a request that asks for logprobs gets, per
    token, the target's own log_softmax there and its top alternatives: those of the
    in-process engine (checked against transformers in tests/unit/test_verify.py), in
    every mode, greedy and seeded, with one and two layers per step."""
    dep = tcp_deployment
    stages = len(dep.ranges)
    local = build_local(dep.target, stages, dep.target, parse_dtype(DTYPE))
    with Client(dep.router_address, timeout=60) as client:
        for mode, k, temperature in [
            ("specpipe", 1, 0.0),
            ("specpipe", 2, 0.9),
            ("specinfer", 1, 0.9),
            ("pp", 1, 0.0),
        ]:
            got = client.generate(
                prompt_ids=PROMPT,
                mode=mode,
                max_new_tokens=12,
                temperature=temperature,
                seed=5,
                ignore_eos=True,
                layers_per_step=k,
                logprobs=3,
            )
            sampling = SamplingParams(temperature=temperature, seed=5)
            opts = DecodeOptions(12, sampling=sampling, layers_per_step=k, logprobs=3)
            ref = LockstepGeneration(local.pipeline, local.draft, PROMPT, mode, opts)
            assert got.token_ids == ref.run(), (mode, k, temperature)
            want = ref.controller.out.logprobs
            assert len(got.logprobs) == len(want) == 12
            for (lp, top), w in zip(got.logprobs, want, strict=True):
                assert lp == pytest.approx(w.logprob, abs=1e-9)
                assert list(top) == list(w.top_ids)
                assert list(top.values()) == pytest.approx(list(w.top_logprobs), abs=1e-9)
