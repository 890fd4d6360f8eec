"""The paged KV cache's block accounting: whatever a stage is asked (prefill chunks, tree
layers, hits and misses, failed forwards, releases during a forward, replays, leases
that expire, a pool that runs out, prompts sharing prefixes through the prefix cache,
prefills that start below what the cache gave), every block's reference count is the
number of requests holding it, a block nobody holds is free or cached (never both),
only full committed blocks are shared, rows a request writes are in blocks of its own,
and releasing every request gives every block back."""

from __future__ import annotations

import contextlib
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from specpipe.common.model.loading import load_stage
from specpipe.common.runtime.block_pool import BlockPool
from specpipe.common.runtime.errors import CacheFull, RequestError
from specpipe.common.runtime.lease import LeaseTable
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
    bs = pool.block_size
    refs: Counter[int] = Counter()
    private_slots: list[int] = []  # rows in blocks of one request only
    for cache in [*stage._caches.values(), *stage._to_free]:
        mine = cache.blocks + cache.tree_blocks
        assert len(mine) == len(set(mine)), "a request holds a block twice"
        refs.update(mine)
        assert len(cache.blocks) == pool.blocks_for(cache.n_committed)
        tree_blocks = set(cache.tree_blocks)
        used = set((cache.tree_slots // bs).tolist())
        assert used == tree_blocks  # every tree row in a tree block, no empty tree block
        free = set(cache._free_tree_slots)
        assert not free & set(cache.tree_slots.tolist())
        assert {s // bs for s in free} <= tree_blocks
        private_slots += cache.tree_slots.tolist()
        # Where this request writes next (a partly filled last committed block) is its own.
        if cache.n_committed % bs:
            assert not pool.is_cached(cache.blocks[-1]), "a partial block is shared or cached"
    for cache in [*stage._caches.values(), *stage._to_free]:
        for b in cache.tree_blocks:
            assert refs[b] == 1 and b not in pool._key_of, "a tree block is shared or cached"
        for b in cache.blocks:  # only full blocks with a key are shared
            assert refs[b] == 1 or b in pool._key_of
    assert len(private_slots) == len(set(private_slots)), "two live tree rows share a slot"
    for b in range(pool._stored):
        assert pool.refcount(b) == refs[b], (
            f"block {b}: refcount {pool.refcount(b)}, {refs[b]} holders"
        )
    held, free, cached = set(refs), pool._free, set(pool._evictable)
    assert len(free) == len(set(free))
    assert not held & set(free), "a held block is on the free list"
    assert not held & cached, "a held block is in the eviction queue"
    assert not set(free) & cached
    assert len(held) + len(free) + len(cached) == pool._stored
    assert cached <= set(pool._key_of) and not set(free) & set(pool._key_of)
    assert all(pool._block_of[k] == b for b, k in pool._key_of.items())
    assert pool.used_blocks == len(held)
    assert stage.cache_bytes_used == len(held) * pool.block_bytes


def family_tokens(family: int, positions: torch.Tensor) -> torch.Tensor:
    """The token at each position of prompts of `family`: prompts of one family share
    every prefix (the prefix cache's hits), families differ from the second token."""
    return torch.where(positions == 0, 1, (positions * (family + 2)) % 16)


def guard_writes(stage: StageRuntime) -> None:
    """Fail the step that would write rows into a block that is shared or cached (its
    rows are other requests' K/V, or a key's)."""
    pool, inputs, copy = stage.pool, stage._inputs, stage.pool.copy_rows

    def check(slots: np.ndarray) -> None:
        shared = [b for b in set((slots // pool.block_size).tolist()) if pool.is_cached(b)]
        assert not shared, f"rows written into shared or cached blocks {shared}"

    def checked_inputs(batch):  # each run's inputs name the rows its forward writes
        for b in batch:
            check(b.rows.slots)
        return inputs(batch)

    def checked_copy(src: np.ndarray, dst: np.ndarray) -> None:
        check(dst)
        copy(src, dst)

    stage._inputs = checked_inputs  # type: ignore[method-assign]
    pool.copy_rows = checked_copy  # type: ignore[method-assign]


class Client:
    """One request's side: what it sends and what it believes the stage holds."""

    def __init__(self, rid: str) -> None:
        self.rid, self.next_id, self.committed, self.open = rid, 0, 0, False
        self.tree: dict[int, int] = {}  # node id -> parent id (-1: the committed prefix)
        self.family = 0

    def prompt(self, n: int) -> list[int]:
        return family_tokens(self.family, torch.arange(n)).tolist()

    def prefill(self, n: int) -> Activation:
        pos = torch.arange(self.committed, self.committed + n)
        return Activation(self.rid, pos, committed=True, tokens=family_tokens(self.family, pos))

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
        "expire",
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
    guard_writes(stage)
    clients = [Client(f"r{i}") for i in range(3)]
    now = [0.0]
    leases = LeaseTable(10.0, clock=lambda: now[0])  # the services' lease expiry

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
        if c.open:
            leases.renew(c.rid)
        if op in ("open", "replay") or not c.open:
            if c.open:  # a replay: the request starts again (on another path, or here)
                stage.release(c.rid)
                leases.end(c.rid)
            # Two prompt families, so prompts share prefixes; a prompt of up to 24 tokens.
            c.family, length = draw % 2, 1 + (draw * 7) % 24
            try:
                cached = stage.open(c.rid, 40, prefix_tokens=c.prompt(length))
            except CacheFull:
                check_accounting(stage)
                continue
            leases.grant(c.rid)
            assert cached % BLOCK == 0 and cached <= length
            # The path's minimum may be below this stage's: the prefill starts lower (at a
            # block boundary, or anywhere, as a stage with other block sizes would ask).
            start = [cached, max(0, cached - BLOCK), max(0, cached - 1)][draw % 3]
            event(f"prefix hit: {cached > 0}, prefill below it: {start < cached}")
            c.open, c.committed, c.tree = True, start, {}
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
            leases.end(c.rid)
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
            leases.end(c.rid)
            c.open = False
        elif op == "expire":  # time passes; requests not renewed since are freed
            now[0] += 2.0 * n
            for rid in leases.expired():
                stage.release(rid)
                leases.end(rid)
                clients[int(rid[1:])].open = False
        check_accounting(stage)
    for c in clients:
        stage.release(c.rid)
    check_accounting(stage)
    assert stage.pool.used_blocks == 0 and not stage._to_free
    assert stage.pool.free_blocks == stage.pool.max_blocks  # cached blocks count as free


def test_the_pool_holds_its_budget_and_no_more() -> None:
    pool = BlockPool(2, 1, 4, max_bytes=10 * 2 * 2 * BLOCK * 4 * 4, block_size=BLOCK)
    assert pool.max_blocks == 10 and pool.k.shape == (2, 10 * BLOCK, 1, 4)  # at once
    a = pool.allocate(3)
    b = pool.allocate(7)
    assert len(set(a + b)) == 10 and pool.free_blocks == 0
    with pytest.raises(CacheFull, match="exhausted"):
        pool.allocate(1)
    pool.release(a)
    assert sorted(pool.allocate(3)) == sorted(a)
    assert np.array_equal(pool.slots([5, 2], 2, 6), [22, 23, 8, 9])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_copy_rows_on_a_cpu_moves_every_layers_rows_as_an_index_copy_would(dtype) -> None:
    """A CPU storage's row copies go through numpy views of its memory: every layer's K
    and V rows of the sources land in the destinations bit for bit (sources read before
    any write), in the storage the pool holds now, also after it is allocated anew."""
    pool = BlockPool(3, 2, 4, 1 << 16, block_size=4, dtype=dtype)
    for _ in range(2):
        pool.k.copy_(torch.randn(pool.k.shape))
        pool.v.copy_(torch.randn(pool.v.shape))
        k, v = pool.k.clone(), pool.v.clone()
        src, dst = np.array([3, 7, 40, 5]), np.array([100, 5, 41, 6])
        pool.copy_rows(src, dst)
        s, d = torch.from_numpy(src), torch.from_numpy(dst)
        k.index_copy_(1, d, k.index_select(1, s))
        v.index_copy_(1, d, v.index_select(1, s))
        assert torch.equal(pool.k.view(torch.uint8), k.view(torch.uint8))
        assert torch.equal(pool.v.view(torch.uint8), v.view(torch.uint8))
        pool.set_budget(1 << 15)  # nothing held: a new storage


def test_slots_of_a_row_range_read_only_its_blocks_and_match_the_whole_table() -> None:
    """Slots of rows [start, stop) of random block tables: each row's block of the table
    at its offset, as indexing the whole table gives them (empty ranges included)."""
    pool = BlockPool(1, 1, 2, 1 << 20, block_size=4)
    rng = np.random.default_rng(0)
    for _ in range(500):
        blocks = rng.permutation(50)[: int(rng.integers(0, 12))].tolist()
        start = int(rng.integers(0, 4 * len(blocks) + 1))
        stop = int(rng.integers(start, 4 * len(blocks) + 1))
        want = [blocks[r // 4] * 4 + r % 4 for r in range(start, stop)]
        got = pool.slots(blocks, start, stop)
        assert got.dtype == np.int64 and got.tolist() == want
