"""A stage step's working memory stays within its budget whatever the prompt (issue 35,
F1), and the attention it computes in parts, query blocks and key blocks equals one
padded call (fp64)."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime.kv_cache import NewRows
from specpipe.common.runtime.paged_batch import keys_needed, plan
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.runtime.step_budget import StepBudget, StepCosts
from specpipe.common.spec.messages import Activation
from torch.utils._python_dispatch import TorchDispatchMode

t = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
CONTEXT = 8192


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    from specpipe.common.model.synthetic import save_random_model

    path = tmp_path_factory.mktemp("long")
    return save_random_model(
        path, layers=2, hidden=32, heads=4, kv_heads=2, max_positions=CONTEXT, seed=3
    )


class PeakBytes(TorchDispatchMode):
    """The most bytes of tensors allocated inside the mode alive at once (views and
    in-place results are not new memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.largest = 0

    def _freed(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            x.untyped_storage().data_ptr()
            for x in (*args, *(kwargs or {}).values())
            if isinstance(x, torch.Tensor) and x.device.type != "meta"
        }
        for x in out if isinstance(out, list | tuple) else (out,):
            if not isinstance(x, torch.Tensor) or x._is_view():
                continue
            if x.untyped_storage().data_ptr() in inputs:
                continue  # written in place (out=, index_copy_)
            n = x.untyped_storage().nbytes()
            self.live += n
            self.peak = max(self.peak, self.live)
            self.largest = max(self.largest, n)
            weakref.finalize(x.untyped_storage(), self._freed, n)
        return out


def stage_of(model_dir, step_bytes: int | None) -> StageRuntime:
    s = StageRuntime(load_stage(model_dir, dtype=torch.float64), step_bytes=step_bytes)
    s.pool.allocate_storage()  # before measuring: the pool is allocated once, at start
    return s


def long_prefill(stage: StageRuntime, rid: str, n: int, chunk: int) -> list[Activation]:
    stage.open(rid, CONTEXT)
    tokens = torch.arange(n) % 50
    return [
        Activation(
            rid, torch.arange(s, min(n, s + chunk)), committed=True, tokens=tokens[s : s + chunk]
        )
        for s in range(0, n, chunk)
    ]


def test_a_long_prompt_sent_at_once_stays_within_the_step_budget(long_dir) -> None:
    budget = 4 << 20
    stage = stage_of(long_dir, budget)
    stage.pool.gather_buffer(8192)
    acts = long_prefill(stage, "long", 6000, 1024)  # every chunk in one round
    with PeakBytes() as mem:
        outs = stage.forward_many(acts)
    assert all(isinstance(o, Activation) for o in outs)
    # working memory: attention in half the budget, the rows of a run in the other half;
    # beside it the step's output (hidden states of every row, held and concatenated)
    output = 6000 * 32 * 8
    assert mem.peak <= budget + 2 * output, (mem.peak, budget)
    assert mem.largest <= budget // 2


def test_without_a_bound_the_same_round_takes_far_more(long_dir) -> None:
    stage = stage_of(long_dir, 1 << 40)  # one part: the padded batch of every chunk
    stage.pool.gather_buffer(8192)
    acts = long_prefill(stage, "long", 3000, 1024)
    with PeakBytes() as mem:
        stage.forward_many(acts)
    assert mem.peak > 16 * (4 << 20)


def script(rid_prefix: str = "") -> list[list[Activation]]:
    """Requests of very different lengths in one step: a long prefill, a tree, a short one."""
    long = Activation("a", torch.arange(700), committed=True, tokens=torch.arange(700) % 50)
    short = Activation("b", torch.arange(9), committed=True, tokens=torch.arange(9) % 50)
    c = Activation("c", torch.arange(300), committed=True, tokens=torch.arange(300) % 40)
    steps = [[long, short, c]]
    steps.append([
        Activation("a", torch.arange(700, 1100), committed=True,
                   tokens=torch.arange(400) % 30),
        Activation("b", t(9, 10, 10), node_ids=t(0, 1, 2), parent_ids=t(-1, 0, 0),
                   tokens=t(3, 4, 5)),
        Activation("c", t(300, 301), node_ids=t(0, 1), parent_ids=t(-1, 0), tokens=t(7, 8)),
    ])  # fmt: skip
    return steps


def run_script(model_dir, step_bytes: int | None, layers: LayerRange):
    stage = StageRuntime(load_stage(model_dir, layers, torch.float64), step_bytes=step_bytes)
    for rid in "abc":
        stage.open(rid, 2048)
    return stage, [stage.forward_many(stage_inputs(step, layers)) for step in script()]


def stage_inputs(step: list[Activation], layers: LayerRange, hidden: int = 32) -> list[Activation]:
    """A step's activations as `layers` takes them: tokens on the first stage, else
    seeded random fp64 hidden states of width `hidden`."""
    if layers.is_first:
        return step
    acts = []
    for a in step:
        torch.manual_seed(len(a) + int(a.positions[0]))
        acts.append(Activation(a.request_id, a.positions, a.committed, a.node_ids,
                               a.parent_ids, hidden=torch.randn(len(a), hidden, dtype=torch.float64)))  # fmt: skip
    return acts


@pytest.mark.parametrize("layers", [LayerRange(0, 1, 2), LayerRange(1, 2, 2)])
@pytest.mark.parametrize("step_bytes", [1 << 20, 3 << 20])
def test_attention_in_parts_and_blocks_equals_one_padded_call_fp64(
    long_dir, layers, step_bytes
) -> None:
    _, whole = run_script(long_dir, 1 << 40, layers)
    small, parts = run_script(long_dir, step_bytes, layers)
    rows = [
        NewRows(np.arange(700), np.arange(1, 701), np.empty((700, 0), np.int64)),
        NewRows(np.arange(9), np.arange(1, 10), np.empty((9, 0), np.int64)),
    ]
    planned = plan(rows, small.step_budget.costs, small.step_budget.attention_bytes)
    assert len(planned) > 1 or planned[0].key_block < planned[0].shape[2]
    for step_whole, step_parts in zip(whole, parts, strict=True):
        for a, b in zip(step_whole, step_parts, strict=True):
            x, y = a.hidden, b.hidden
            assert torch.allclose(x, y, rtol=1e-12, atol=1e-12), (x - y).abs().max()


def test_key_blocks_equal_one_call_fp64(long_dir) -> None:
    """A budget so small that a request's rows are taken 16 at a time over key blocks."""
    _, whole = run_script(long_dir, 1 << 40, LayerRange(0, 2, 2))
    tiny, blocked = run_script(long_dir, 1 << 20, LayerRange(0, 2, 2))
    costs = tiny.step_budget.costs
    rows = [NewRows(np.arange(400), np.arange(701, 1101), np.empty((400, 0), np.int64))]
    parts = plan(rows, costs, tiny.step_budget.attention_bytes)  # the second step's "a"
    assert any(p.key_block < p.shape[2] for p in parts)
    for a, b in zip(whole[-1], blocked[-1], strict=True):
        assert torch.allclose(a.hidden, b.hidden, rtol=1e-12, atol=1e-12)


# -- the plan, for any step ---------------------------------------------------------------
@st.composite
def steps(draw):
    n_req = draw(st.integers(1, 6))
    rows = []
    for _ in range(n_req):
        committed = draw(st.integers(0, 3000))
        if draw(st.booleans()):  # a prefill chunk
            m = draw(st.integers(1, 600))
            rows.append(NewRows(np.arange(m), np.arange(committed + 1, committed + m + 1),
                                np.empty((m, 0), np.int64)))  # fmt: skip
        else:  # tree rows: each sees the prefix and a chain of ancestors
            m = draw(st.integers(1, 40))
            depth = draw(st.integers(1, 5))
            anc = np.full((m, depth), -1, np.int64)
            for i in range(m):
                k = draw(st.integers(1, depth))
                anc[i, :k] = committed + np.arange(k) + i % 3
            rows.append(NewRows(np.arange(m), np.full(m, committed), anc))
    return rows


@settings(max_examples=150, deadline=None)
@given(rows=steps(), budget=st.integers(1 << 20, 64 << 20), heads=st.sampled_from([4, 12, 32]))
def test_no_attention_part_exceeds_the_budget(rows, budget, heads) -> None:
    from specpipe.common.model.config import ModelConfig

    cfg = ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": 1000, "hidden_size": heads * 64,
        "intermediate_size": heads * 128, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": 2, "max_position_embeddings": 4096,
    })  # fmt: skip
    costs = StepCosts.of(cfg, torch.float32)
    parts = plan(rows, costs, budget)
    covered = {i: np.zeros(r.slots.size, int) for i, r in enumerate(rows)}
    for p in parts:
        assert p.bytes(costs) <= budget, (p.shape, p.key_block)
        for g in p.groups:
            covered[g.request][g.start : g.stop] += 1
            assert g.keys >= keys_needed(rows[g.request])[g.start : g.stop].max()
    assert all((c == 1).all() for c in covered.values())
    assert StepBudget(budget, costs).max_rows >= 1
