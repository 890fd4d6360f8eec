"""Many requests on one lockstep engine (SpecPipe-DB): every stage runs all requests'
rows in one batched forward, requests join and leave between steps, and each request
emits exactly its single-request tokens."""

from __future__ import annotations

import torch
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
from specpipe.common.runtime.lockstep import LockstepEngine, LockstepGeneration
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.common.spec.sampling import SamplingParams

JOBS = [  # prompt, mode, sampling
    ([5, 17, 33, 2, 8], Mode.SPECPIPE, SamplingParams()),
    ([9, 4], Mode.PP, SamplingParams()),
    ([1, 2, 3, 4, 5, 6, 7], Mode.SPECINFER, SamplingParams(temperature=0.9, seed=3)),
    ([60, 61, 62], Mode.SPECPIPE, SamplingParams(temperature=1.1, top_k=10, seed=8)),
    ([70], Mode.AUTOREGRESSIVE, SamplingParams(temperature=0.7, seed=1)),
    ([40, 41, 42, 43], Mode.SPECPIPE, SamplingParams()),
]


def opts(sampling: SamplingParams, n: int) -> DecodeOptions:
    return DecodeOptions(n, sampling, width=3, depth=3, prefill_chunk=3)


def test_concurrent_requests_emit_their_single_request_tokens(llama_dir, unrelated_draft_dir):
    # fp64: batched and separate forwards differ by rounding only (see test_batched_forward)
    for draft in (ORACLE_DRAFT, unrelated_draft_dir):
        dep = build_local(llama_dir, 3, draft, torch.float64)
        alone = [
            LockstepGeneration(dep.pipeline, dep.draft, p, m, opts(s, 12 + i)).run()
            for i, (p, m, s) in enumerate(JOBS)
        ]
        engine = LockstepEngine(dep.pipeline, dep.draft)
        runs = [engine.add(p, m, opts(s, 12 + i)) for i, (p, m, s) in enumerate(JOBS[:3])]
        for _ in range(4):  # the others join mid-stream
            engine.step()
        runs += [engine.add(p, m, opts(s, 15 + i)) for i, (p, m, s) in enumerate(JOBS[3:])]
        while engine.runs:
            engine.step()
        assert [r.tokens for r in runs] == alone
        assert all(r.done for r in runs) and not engine.runs
        assert all(s.cache_bytes_used == 0 for s in dep.pipeline.stages)
        # Some steps ran several requests' rows in one forward per stage.
        per_request_max = max(max(row[:-1]) for r in runs for row in r.stats.trace)
        assert max(max(row[:-1]) for row in engine.trace) > per_request_max


def test_a_finished_request_leaves_while_others_go_on(llama_dir) -> None:
    dep = build_local(llama_dir, 2, ORACLE_DRAFT, torch.float64)
    engine = LockstepEngine(dep.pipeline, dep.draft)
    short = engine.add([5, 6, 7], Mode.SPECPIPE, DecodeOptions(2))
    long = engine.add([5, 6, 7], Mode.SPECPIPE, DecodeOptions(20))
    while not short.done:
        engine.step()
    assert short.request_id not in engine.runs and not long.done
    engine.release(long)  # cancelled: its state goes everywhere, the engine is empty
    assert not engine.runs and all(s.cache_bytes_used == 0 for s in dep.pipeline.stages)
    assert dep.draft.runtime.cache_bytes_used == 0
