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
from specpipe.common.spec.options import MAX_PREFILL_CHUNKS
from specpipe.services.prefill_slices import Slice, prefill_cells
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
    least = -(-length // MAX_PREFILL_CHUNKS)
    assert len(spans) <= max(MAX_PREFILL_CHUNKS, -(-length // chunk))
    for s, e in spans:
        assert 1 <= e - s <= max(chunk, least) or e == start + length
        assert e - s <= least or (e - s) * e <= cells  # the fewest rows always go


def test_a_chunk_deep_in_a_long_prompt_has_fewer_rows() -> None:
    chunks = [c.activation() for c in prefill_chunks("r", list(range(32_001)), 128, 0, 1 << 20)]
    assert sum(len(c) for c in chunks) == 32_000
    assert len(chunks[0]) == 128 and len(chunks[-1]) == 32
    assert max(prefill_cells(c) for c in chunks) <= 1 << 20
    assert [len(c) for c in prefill_chunks("r", list(range(1001)), 128)][:2] == [128, 128]


async def _open_long_and_short(svc: StageService):
    """Requests "long" (to prefill) and "short" (to decode) open on `svc`."""
    for rid in ("long", "short"):
        req = stage_pb2.OpenStageRequest(request_id=rid, capacity=256, next_hop="tcp://127.0.0.1:9")
        await svc.Open(req, None)
    return svc._requests["long"], svc._requests["short"]


def test_a_round_takes_the_decodes_and_prefill_within_its_budget(llama_dir) -> None:
    async def main() -> None:
        model = load_stage(llama_dir, LayerRange(0, 2, 5), torch.float64)
        runtime = StageRuntime(model, step_bytes=1 << 20)
        svc = StageService(LoadedModel(runtime, "m", "h", 256, ()))
        try:
            long, short = await _open_long_and_short(svc)
            for seq, c in enumerate(prefill_chunks("long", [i % 90 for i in range(193)], 16)):
                long.order.add_activation(seq, Pending(c.activation(), 0))
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


def test_beside_decodes_a_step_takes_prefill_that_costs_what_they_do() -> None:
    from specpipe.common.runtime.prefill_pace import MIN_PREFILL_CELLS, PrefillPace

    pace = PrefillPace(ceiling=1 << 20)
    assert pace.cells == 1 << 20  # nothing measured yet: the memory bound
    pace.observe(decode_rows=9, cells=0, seconds=0.010)
    pace.observe(decode_rows=0, cells=1 << 19, seconds=0.060)  # 114 ns per cell
    assert abs(pace.cells - 0.010 / (0.060 / (1 << 19))) < 2
    pace.observe(decode_rows=0, cells=100, seconds=0.5)  # too small to say: not measured
    pace.observe(decode_rows=9, cells=1 << 19, seconds=0.070)  # beside decodes: less theirs
    assert 80_000 < pace.cells < 90_000
    for _ in range(50):  # a very slow prefill: never below the floor
        pace.observe(decode_rows=0, cells=1 << 17, seconds=5.0)
    assert pace.cells == MIN_PREFILL_CELLS


def test_beside_a_decode_a_costly_chunk_is_computed_in_slices_and_sent_whole(llama_dir) -> None:
    """A chunk that costs more than a round beside decodes may take: its first rows in one
    round, the rest in the next; the next hop gets one output of every row, equal to the
    chunk computed at once (fp64)."""
    from specpipe.common.runtime.prefill_pace import MIN_PREFILL_CELLS

    tokens = [i % 90 for i in range(250)]

    async def main():
        model = load_stage(llama_dir, LayerRange(0, 2, 5), torch.float64)
        svc = StageService(LoadedModel(StageRuntime(model), "m", "h", 256, ()))
        runtime = svc.runtime
        runtime.prefill_pace.decode_seconds, runtime.prefill_pace.cell_seconds = 1e-3, 1.0
        assert runtime.prefill_pace.cells == MIN_PREFILL_CELLS
        try:
            long, short = await _open_long_and_short(svc)
            chunks = prefill_chunks("long", [*tokens, 1], 150)  # 150 rows, then 100 at 150
            for seq, c in enumerate(chunks):
                long.order.add_activation(seq, Pending(c.activation(), 0))
            short.order.add_activation(
                0,
                Pending(Activation("short", t(0), node_ids=t(0), parent_ids=t(-1), tokens=t(5)), 0),
            )
            sent, slices = [], 0
            while work := svc.rounds._collect():
                svc.rounds.compute(work)
                for w in work:
                    if w.st is long:
                        sent += [o for o in w.outputs if o is not None]
                        slices += sum(isinstance(p, Slice) for _, p in w.turns)
                        # a round beside a decode: one chunk, or a slice within the budget
                        if short.order.pending or any(x.st is short for x in work):
                            cells = sum(prefill_cells(p.act) for _, p in w.turns)
                            assert len(w.turns) == 1 or cells <= MIN_PREFILL_CELLS
                if short.order.next_seq == 1 and not short.order.pending:  # keep it decoding
                    short.order.add_activation(1, Pending(Activation(
                        "short", t(1), node_ids=t(1), parent_ids=t(0), tokens=t(6)), 0))  # fmt: skip
            return sent, slices
        finally:
            await svc.stop()

    sent, slices = asyncio.run(main())
    assert slices >= 2
    assert [len(o) for o in sent] == [150, 100]  # one output per chunk, every row
    whole = StageRuntime(load_stage(llama_dir, LayerRange(0, 2, 5), torch.float64))
    whole.open("long", 256)
    for c, o in zip(prefill_chunks("long", [*tokens, 1], 150), sent, strict=True):
        ref = whole.forward(c.activation())
        assert torch.equal(ref.positions, o.positions)
        assert torch.allclose(ref.hidden, o.hidden, rtol=1e-10, atol=1e-12)
