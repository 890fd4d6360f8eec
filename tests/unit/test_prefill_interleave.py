"""A long prompt's prefill does not fill a stage's rounds (issue 35, deliverable 2): a
round takes every decode ready and prefill chunks up to the step's budget of rows x
keys, and the router sizes chunks by rows x keys, not rows alone."""

from __future__ import annotations

import asyncio
import itertools

import torch
from hypothesis import given
from hypothesis import strategies as st
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime.loader import LoadedModel
from specpipe.common.runtime.ordering import Pending
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.growth import chunk_spans, prefill_chunks
from specpipe.common.spec.messages import Activation
from specpipe.services.compute_round import prefill_cells
from specpipe.services.stage_service import StageService
from specpipe.v1 import stage_pb2

t = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731


@given(
    start=st.integers(0, 40_000),
    length=st.integers(1, 40_000),
    chunk=st.integers(1, 4096),
    cells=st.integers(1, 1 << 22),
)
def test_chunks_cover_the_prompt_within_rows_and_cells(start, length, chunk, cells) -> None:
    spans = chunk_spans(start, start + length, chunk, cells)
    assert spans[0][0] == start and spans[-1][1] == start + length
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    for s, e in spans:
        assert 1 <= e - s <= chunk
        assert e - s == 1 or (e - s) * e <= cells  # a chunk of one row always goes


def test_a_chunk_deep_in_a_long_prompt_has_fewer_rows() -> None:
    chunks = prefill_chunks("r", list(range(32_001)), 128, 0, 1 << 20)
    assert sum(len(c) for c in chunks) == 32_000
    assert len(chunks[0]) == 128 and len(chunks[-1]) == 32
    assert max(prefill_cells(c) for c in chunks) <= 1 << 20
    assert [len(c) for c in prefill_chunks("r", list(range(1001)), 128)][:2] == [128, 128]


def test_a_round_takes_the_decodes_and_prefill_within_its_budget(llama_dir) -> None:
    async def main() -> None:
        model = load_stage(llama_dir, LayerRange(0, 2, 5), torch.float64)
        runtime = StageRuntime(model, step_bytes=1 << 20)
        svc = StageService(LoadedModel(runtime, "m", "h", 256, ()))
        try:
            for rid in ("long", "short"):
                req = stage_pb2.OpenStageRequest(
                    request_id=rid, capacity=256, next_hop="tcp://127.0.0.1:9"
                )
                await svc.Open(req, None)
            long, short = svc._requests["long"], svc._requests["short"]
            for seq, c in enumerate(prefill_chunks("long", [i % 90 for i in range(193)], 16)):
                long.order.add_activation(seq, Pending(c, 0))
            short.order.add_activation(
                0,
                Pending(Activation("short", t(0), node_ids=t(0), parent_ids=t(-1), tokens=t(5)), 0),
            )
            budget = runtime.step_budget.prefill_cells
            assert 16 * 192 <= budget < 16 * 16 * sum(range(1, 13))  # not all in one round
            rounds = []
            while work := svc.rounds._collect():
                svc.rounds.compute(work)
                rounds.append({w.st.request_id: [p.act for _, p in w.turns] for w in work})
            assert "short" in rounds[0]  # the decode is not behind the prefill
            assert len(rounds) > 1
            for r in rounds:
                chunks = r.get("long", [])
                assert len(chunks) == 1 or sum(prefill_cells(a) for a in chunks) <= budget
            assert sum(len(a) for r in rounds for a in r.get("long", [])) == 192
        finally:
            await svc.stop()

    asyncio.run(main())
