"""The paged KV cache's block accounting: whatever a stage is asked (prefill chunks, tree
layers, hits and misses, failed forwards, releases during a forward, replays, a pool that
runs out), every block is held by exactly one request or free, live rows never share a
slot, and releasing every request gives every block back."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from specpipe.common.model.loading import load_stage
from specpipe.common.runtime.block_pool import BlockPool
from specpipe.common.runtime.errors import CacheFull, RequestError
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import EMPTY_IDS, Activation, Prune

from ..conftest import make_tiny_model

BLOCK = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(
        tmp_path_factory.mktemp("m"), layers=1, hidden=8, heads=2, kv_heads=1, vocab=16
    )
    return load_stage(path, dtype=torch.float64)


def check_accounting(stage: StageRuntime) -> None:
    pool = stage.pool
    held: list[int] = []
    slots: list[int] = []
    for cache in [*stage._caches.values(), *stage._to_free]:
        held += cache.blocks + cache.tree_blocks
        assert len(cache.blocks) == pool.blocks_for(cache.n_committed)
        slots += cache.key_slots().tolist()
        tree_blocks = set(cache.tree_blocks)
        used = set((cache.tree_slots // pool.block_size).tolist())
        assert used == tree_blocks  # every tree row in a tree block, no empty tree block
        free = set(cache._free_tree_slots)
        assert not free & set(cache.tree_slots.tolist())
        assert {s // pool.block_size for s in free} <= tree_blocks
    assert len(held) == len(set(held)), "a block held twice"
    assert len(slots) == len(set(slots)), "two live rows share a slot"
    assert not set(held) & set(pool._free), "a held block is on the free list"
    assert len(pool._free) == len(set(pool._free))
    assert pool.used_blocks == len(held)
    assert stage.cache_bytes_used == len(held) * pool.block_bytes


class Client:
    """One request's side: what it sends and what it believes the stage holds."""

    def __init__(self, rid: str) -> None:
        self.rid, self.next_id, self.committed, self.open = rid, 0, 0, False
        self.tree: dict[int, int] = {}  # node id -> parent id (-1: the committed prefix)

    def prefill(self, n: int) -> Activation:
        pos = torch.arange(self.committed, self.committed + n)
        return Activation(self.rid, pos, committed=True, tokens=pos % 16)

    def layer(self, n: int, draw: int) -> Activation:
        nodes = list(self.tree)  # odd rows hang under a cached node, even ones under the prefix
        parents = [nodes[draw % len(nodes)] if nodes and k % 2 else -1 for k in range(n)]
        ids = list(range(self.next_id, self.next_id + n))
        pos = [self.committed + 1] * n
        return Activation(
            self.rid,
            torch.tensor(pos),
            node_ids=torch.tensor(ids),
            parent_ids=torch.tensor(parents),
            tokens=torch.tensor(ids) % 16,
        )


OPS = st.sampled_from(
    [
        "open",
        "prefill",
        "grow",
        "grow_all",
        "hit",
        "miss",
        "fail",
        "release",
        "release_midway",
        "replay",
    ]
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.integers(3, 12),
    st.lists(st.tuples(OPS, st.integers(0, 2), st.integers(1, 6), st.integers(0, 99)), max_size=30),
)
def test_blocks_never_leak(model, budget_blocks, ops) -> None:
    stage = StageRuntime(model, block_size=BLOCK)
    stage.max_cache_bytes = budget_blocks * stage.pool.block_bytes
    clients = [Client(f"r{i}") for i in range(3)]

    def sent(c: Client, act: Activation) -> None:
        try:
            stage.forward(act)
        except CacheFull:
            return
        if act.committed:
            c.committed += len(act)
        else:
            c.tree.update(zip(act.node_ids.tolist(), act.parent_ids.tolist(), strict=True))
            c.next_id += len(act)

    for op, who, n, draw in ops:
        c = clients[who]
        if op in ("open", "replay") or not c.open:
            if c.open:  # a replay: the request starts again (on another path, or here)
                stage.release(c.rid)
            try:
                stage.open(c.rid, 40)
            except CacheFull:
                check_accounting(stage)
                continue
            c.open, c.committed, c.tree = True, 0, {}
            sent(c, c.prefill(n))
        elif op == "prefill" and not c.tree:
            sent(c, c.prefill(n))
        elif op in ("grow", "prefill"):
            sent(c, c.layer(n, draw))
        elif op == "grow_all":
            live = [x for x in clients if x.open]
            acts = [x.layer(n, draw) for x in live]
            for x, act, out in zip(live, acts, stage.forward_many(acts), strict=True):
                if not isinstance(out, RequestError):
                    x.tree.update(zip(act.node_ids.tolist(), act.parent_ids.tolist(), strict=True))
                    x.next_id += len(act)
        elif op in ("hit", "miss"):
            roots = [i for i, p in c.tree.items() if p == -1]
            commit = torch.tensor(roots[:1]) if roots else EMPTY_IDS
            keep = [i for i in c.tree if i not in roots[:1] and (op == "hit" or i % 3 == draw % 3)]
            with contextlib.suppress(CacheFull):  # the pool ran out for the committed row
                stage.prune(
                    c.rid, Prune(commit, torch.tensor(keep, dtype=torch.int64), c.next_id - 1)
                )
            cache = stage._cache(c.rid)
            c.committed = cache.n_committed
            survivors = set(cache.tree_ids.tolist())
            c.tree = {
                i: (-1 if p not in survivors else p) for i, p in c.tree.items() if i in survivors
            }
        elif op == "fail":
            real = stage.model.forward_batch

            def broken(*args, **kwargs):
                raise RuntimeError("device error")

            stage.model.forward_batch = broken
            with pytest.raises(RuntimeError, match="device error"):
                try:
                    stage.forward(c.layer(n, draw) if c.tree or draw % 2 else c.prefill(n))
                except CacheFull:
                    raise RuntimeError("device error") from None
            stage.model.forward_batch = real
        elif op == "release":
            stage.release(c.rid)
            c.open = False
        elif op == "release_midway":  # cancelled while its rows are computed
            real = stage.model.forward_batch

            def release_midway(*args, _real=real, _rid=c.rid):
                out = _real(*args)
                stage.release(_rid)
                check_accounting(stage)
                return out

            stage.model.forward_batch = release_midway
            with contextlib.suppress(RequestError):
                stage.forward(c.layer(n, draw))
            stage.model.forward_batch = real
            stage.release(c.rid)  # had the rows not reached the forward
            c.open = False
        check_accounting(stage)
    for c in clients:
        stage.release(c.rid)
    check_accounting(stage)
    assert stage.pool.used_blocks == 0 and not stage._to_free


def test_the_pool_grows_to_its_budget_and_no_further() -> None:
    pool = BlockPool(2, 1, 4, max_bytes=10 * 2 * 2 * BLOCK * 4 * 4, block_size=BLOCK)
    assert pool.max_blocks == 10 and pool.k.shape[1] == 0  # nothing stored before use
    a = pool.allocate(3)
    assert pool.k.shape == (2, 10 * BLOCK, 1, 4)  # grown once, capped at the budget
    b = pool.allocate(7)
    assert len(set(a + b)) == 10 and pool.free_blocks == 0
    with pytest.raises(CacheFull, match="exhausted"):
        pool.allocate(1)
    pool.release(a)
    assert sorted(pool.allocate(3)) == sorted(a)
    assert np.array_equal(pool.slots([5, 2], 2, 6), [22, 23, 8, 9])
