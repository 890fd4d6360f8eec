"""Projected serving of many requests from closed-loop lockstep runs."""

from __future__ import annotations

import pytest
from specpipe.common.perf.cost_model import (
    CostCurve,
    DeploymentCosts,
    projected_tbt,
    specinfer_draft_seconds,
)
from specpipe.common.perf.timeline import Ask, closed_loop, project, schedule
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
from specpipe.common.runtime.lockstep import LockstepEngine, LockstepGeneration
from specpipe.common.spec.options import DecodeOptions, Mode

S = 3
ROWS = [1, 4, 16, 64]


def costs(stage=lambda n: 0.01 + 0.002 * n, draft=lambda n: 0.004 + 0.001 * n) -> DeploymentCosts:
    curve = lambda fn: CostCurve(ROWS, [fn(n) for n in ROWS])  # noqa: E731
    return DeploymentCosts(16, [curve(stage)] * S, curve(draft))


@pytest.fixture(scope="module")
def dep(llama_dir):
    return build_local(llama_dir, S, ORACLE_DRAFT)


def opts(n: int = 8) -> DecodeOptions:
    return DecodeOptions(max_new_tokens=n, width=4, depth=3)


@pytest.mark.parametrize("mode", ["specpipe", "pp", "specinfer"])
def test_one_request_projects_as_the_single_request_projection(dep, mode) -> None:
    draft = None if mode == "pp" else dep.draft
    load = closed_loop(LockstepEngine(dep.pipeline, draft), [Ask([5, 9, 2], mode, opts())], 1)
    gen = LockstepGeneration(dep.pipeline, draft, [5, 9, 2], mode, opts())
    assert gen.run() == load.served[0].tokens
    s, c = gen.stats, costs()
    passes = specinfer_draft_seconds(s.draft_layers, c) if mode == "specinfer" else ()
    decode = slice(s.prefill_steps, None)
    want = projected_tbt(s.trace[decode], s.emit_steps, c, mode, passes, s.draft_forwards[decode])
    got = project(load, c)
    assert got["tbt_ms"]["p50"] == pytest.approx(1e3 * want, abs=1e-3)
    assert got["total_output_tokens"] == 8 and got["requests"] == 1


def test_closed_loop_keeps_concurrency_and_every_request_is_exact(dep) -> None:
    prompts = [[5, 9, 2], [7], [1, 2, 3, 4, 5], [8, 8], [3, 1]]
    load = closed_loop(
        LockstepEngine(dep.pipeline, dep.draft), [Ask(p, Mode.SPECPIPE, opts()) for p in prompts], 2
    )
    assert [s.join_step for s in load.served][:2] == [0, 0]
    assert all(s.join_step > 0 for s in load.served[2:])  # joined as others finished
    for p, s in zip(prompts, load.served, strict=True):
        alone = LockstepGeneration(dep.pipeline, dep.draft, p, Mode.SPECPIPE, opts()).run()
        assert s.tokens == alone
    assert len(load.trace) == max(s.token_steps[-1] for s in load.served)


@pytest.mark.parametrize("mode", ["specpipe", "specinfer"])
def test_schedule_of_runs_alone_is_the_closed_loop_run(dep, mode) -> None:
    """Requests do not interact in lockstep: the closed-loop run of five requests is
    their runs alone, each shifted to the step it joins."""
    prompts = [[5, 9, 2], [7], [1, 2, 3, 4, 5], [8, 8], [3, 1]]
    asks = [Ask(p, mode, opts(6 + i)) for i, p in enumerate(prompts)]
    load = closed_loop(LockstepEngine(dep.pipeline, dep.draft), asks, 2)
    alone = []
    for a in asks:
        gen = LockstepGeneration(dep.pipeline, dep.draft, a.prompt, a.mode, a.opts)
        gen.run()
        alone.append(gen.stats)
    again = schedule(alone, 2)
    assert again.trace == load.trace
    assert [s.join_step for s in again.served] == [s.join_step for s in load.served]
    c = costs()
    assert project(again, c) == project(load, c)


def test_pp_with_flat_costs_emits_one_token_per_s_steps_per_request(dep) -> None:
    flat = costs(stage=lambda n: 0.01, draft=lambda n: 0.0)
    for k in (1, 3):
        asks = [Ask([5, 9, 2], Mode.PP, opts()) for _ in range(k)]
        got = project(closed_loop(LockstepEngine(dep.pipeline, None), asks, k), flat)
        assert got["tbt_ms"]["p50"] == pytest.approx(S * 10.0)
        tokens_per_second = k * 8 / got["duration_s"]
        assert got["output_throughput"] == pytest.approx(tokens_per_second, rel=1e-3)


def test_concurrent_requests_draft_forwards_batch_layer_by_layer(dep) -> None:
    """With K layers a step each request runs K draft forwards one after another; the
    j-th forwards of all requests are one batched forward, priced one after another."""
    o = DecodeOptions(max_new_tokens=10, width=2, layers_per_step=2)
    asks = [Ask(p, Mode.SPECPIPE, o) for p in ([5, 9, 2], [7, 1])]
    load = closed_loop(LockstepEngine(dep.pipeline, dep.draft), asks, 2)
    assert [s.join_step for s in load.served] == [0, 0]
    per_request = [s.stats.draft_forwards for s in load.served]
    for t, batched in enumerate(load.draft_forwards):
        mine = [f[t] for f in per_request if t < len(f)]
        assert len(batched) == max(map(len, mine), default=0)
        assert batched == [sum(f[j] for f in mine if j < len(f)) for j in range(len(batched))]
    assert max(map(len, load.draft_forwards)) == 2
    # a draft ten times a stage's cost bounds the step: each forward counts
    slow = costs(stage=lambda n: 0.001, draft=lambda n: 0.01)
    got = project(load, slow)["duration_s"]
    forwards = sum(map(len, load.draft_forwards[: max(s.token_steps[-1] for s in load.served)]))
    assert got == pytest.approx(0.01 * forwards, rel=0.15)
    assert schedule([s.stats for s in load.served], 2).draft_forwards == load.draft_forwards
