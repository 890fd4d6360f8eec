"""The step's attention metadata (`paged_batch.pack`): every new row is laid out once, in
the padded query position `out_rows` names, with its request's keys, prefix and
ancestor columns, whether the step is one part or split by the budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from specpipe.common.model.paged_attention import tree_mask
from specpipe.common.runtime.block_pool import BlockPool
from specpipe.common.runtime.kv_cache import NewRows
from specpipe.common.runtime.paged_batch import _one_part, _parts, _whole_requests, pack, plan


class Costs:
    """Attention bytes that make a small budget split requests into parts and groups."""

    key_bytes, cell_bytes, query_bytes = 64, 8, 64

    def attention_bytes(self, b: int, q: int, keys: int) -> int:
        return b * (keys * self.key_bytes + q * keys * self.cell_bytes + q * self.query_bytes)


def random_step(rng: np.random.Generator) -> tuple[list[NewRows], list[np.ndarray]]:
    rows, keys = [], []
    for _ in range(int(rng.integers(1, 7))):
        m, nc, d = int(rng.integers(1, 9)), int(rng.integers(0, 40)), int(rng.integers(0, 4))
        if d:  # tree rows: the prefix, and ancestors among the tree keys after it
            prefix = np.full(m, nc)
            anc = np.where(rng.random((m, d)) < 0.7, nc + rng.integers(0, 5, (m, d)), -1)
        else:  # a prefill chunk: causal
            prefix, anc = np.arange(nc + 1, nc + m + 1), np.empty((m, 0), dtype=np.int64)
        rows.append(NewRows(rng.integers(0, 1000, m), prefix, anc))
        keys.append(rng.integers(0, 1000, nc + 8))
    return rows, keys


@pytest.mark.parametrize("budget", [None, 3000, 20000])
def test_every_new_row_is_laid_out_with_its_requests_keys_and_mask(budget) -> None:
    rng = np.random.default_rng(budget or 0)
    pool = BlockPool(1, 1, 4, 1 << 20)
    for _ in range(40):
        rows, keys = random_step(rng)
        batch = pack(rows, keys, pool, Costs() if budget else None, budget)
        out = batch.out_rows.numpy()
        assert batch.write_slots.tolist() == np.concatenate([r.slots for r in rows]).tolist()
        step_row, padded = 0, 0
        where = []  # (part, position in it) of every padded query position, in order
        for i, part in enumerate(batch.parts):
            b, q, _ = part.shape
            where += [(i, j) for j in range(b * q)]
            padded += b * q
        assert sorted(set(out.tolist())) == sorted(out.tolist()) and out.max() < padded
        for r, (new, slots) in enumerate(zip(rows, keys, strict=True)):
            for i in range(new.slots.size):
                p, j = where[out[step_row]]
                part = batch.parts[p]
                _, q, length = part.shape
                assert part.query_rows[j] == step_row
                assert part.prefix[j] == new.prefix[i]
                cols = [c for c in part.ancestors[j].tolist() if c != length]
                assert cols == [c for c in new.ancestors[i].tolist() if c >= 0]
                seen = part.key_slots.view(-1, length)[j // q].tolist()
                need = max([int(new.prefix[i]), *[c + 1 for c in cols]])
                assert seen[:need] == slots[:need].tolist(), r
                step_row += 1


@pytest.mark.parametrize("budget", [None, 20000])
def test_the_array_pass_lays_out_a_part_as_the_group_loop_does(budget) -> None:
    """A step of whole requests in one part is built by whole-array operations
    (`_one_part`); the general layout (`_parts`, a query group at a time) gives the
    same arrays for it."""
    rng = np.random.default_rng(7)
    costs = Costs() if budget else None
    built = 0
    for _ in range(60):
        rows, keys = random_step(rng)
        plans = plan(rows, costs, budget)
        counts = [r.slots.size for r in rows]
        if len(plans) != 1 or not _whole_requests(plans[0], counts):
            continue
        depth = max(1, max(r.ancestors.shape[1] for r in rows))
        fast, fast_out = _one_part(rows, keys, plans[0], depth)
        loop, loop_out = _parts(rows, keys, counts, plans, depth)
        assert fast_out.tolist() == loop_out.tolist()
        for a, b in zip(fast, loop, strict=True):
            assert a.dtype == b.dtype and a.tolist() == b.tolist()
        built += 1
    assert built > 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_steps_mask_built_on_the_host_is_the_devices(dtype) -> None:
    """On a CPU a step's one part gets its additive mask from numpy (`host_mask`): the
    same values, shape and dtype as `tree_mask` builds from the part's tensors."""
    rng = np.random.default_rng(11)
    pool = BlockPool(1, 1, 4, 1 << 20, dtype=dtype)
    for _ in range(40):
        rows, keys = random_step(rng)
        batch = pack(rows, keys, pool)
        (part,) = batch.parts
        want = tree_mask(part.prefix, part.ancestors, part.shape, dtype)
        assert part.mask is not None and part.mask.dtype == dtype
        assert part.mask.shape == want.shape and torch.equal(part.mask, want)
