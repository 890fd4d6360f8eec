"""Tree-aware KV cache: after any appends, commits and prunes, attention over the cache
equals attention recomputed from scratch on the committed tokens plus the node's path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from specpipe.common.model.loading import load_stage
from specpipe.common.runtime.block_pool import BLOCK_SIZE as BLOCK
from specpipe.common.runtime.block_pool import BlockPool
from specpipe.common.runtime.errors import BadInput, CacheFull
from specpipe.common.runtime.kv_cache import TreeKVCache
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.growth import layer_rows
from specpipe.common.spec.messages import EMPTY_IDS, Activation, Prune
from specpipe.common.spec.tree import TokenTree

from ..conftest import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(
        tmp_path_factory.mktemp("m"), layers=2, hidden=24, heads=3, kv_heads=1, vocab=31
    )
    return load_stage(path, dtype=torch.float64)


def scratch_logits(model, tokens: list[int]) -> torch.Tensor:
    """The last token's logits from a causal forward of the whole sequence, no cache."""
    n = len(tokens)
    out = model(model.embed(torch.tensor(tokens)), torch.arange(n))
    return model.logits(out)[-1]


class Mirror:
    """A router-side tree plus one stage; checks every computed node against scratch."""

    def __init__(self, model, prompt: list[int]) -> None:
        # Blocks of 3 rows: prefixes, trees and commits cross block boundaries.
        self.model, self.stage = model, StageRuntime(model, block_size=3)
        self.stage.open("r", 64)
        self.committed = prompt[:-1]
        for s in range(0, len(self.committed), 2):  # prefill chunks of 2
            chunk = self.committed[s : s + 2]
            self.stage.forward(
                Activation(
                    "r",
                    torch.arange(s, s + len(chunk)),
                    committed=True,
                    tokens=torch.tensor(chunk),
                )
            )
        self.tree = TokenTree(prompt[-1])
        self.run(torch.tensor([0]))

    def run(self, idx) -> None:
        t = self.tree
        out = self.stage.forward(layer_rows("r", t, idx, len(self.committed)).activation())
        for row, node in enumerate(np.asarray(idx).tolist()):
            path = t.tokens[t.path_to(node)].tolist()
            ref = scratch_logits(self.model, self.committed + path)
            logits = self.model.logits(out.hidden[row : row + 1])[0]
            torch.testing.assert_close(logits, ref, atol=1e-9, rtol=1e-9)

    def append(self, k: int, width: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        parents = torch.from_numpy(self.tree.frontier()).repeat_interleave(k)
        if parents.numel() == 0:
            return
        toks = torch.randint(0, 31, (parents.numel(),), generator=g)
        new = self.tree.append_layer(parents, toks, torch.rand(parents.numel(), generator=g), width)
        self.run(new)

    def verify(self, seed: int, hit: bool) -> None:
        t = self.tree
        kids = t.children(0)
        old_root, horizon = torch.tensor(t.ids[:1]), int(t.ids.max())
        self.committed = [*self.committed, t.root_token]
        if hit and kids.size:
            t.prune_to(int(kids[seed % kids.size]))
            self.stage.prune("r", Prune(old_root, torch.tensor(t.ids), horizon))
        else:
            t.reset(seed % 31)
            self.stage.prune("r", Prune(old_root, EMPTY_IDS, horizon))
            self.run(torch.tensor([0]))
        cache = self.stage._cache("r")
        assert cache.n_committed == len(self.committed)
        assert sorted(cache.tree_ids.tolist()) == sorted(t.ids.tolist())


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.integers(1, 30), min_size=1, max_size=6),
    st.lists(
        st.tuples(
            st.sampled_from(["grow", "hit", "miss"]),
            st.integers(1, 3),
            st.integers(1, 5),
            st.integers(0, 999),
        ),
        max_size=12,
    ),
)
def test_pruned_cache_attention_equals_scratch(model, prompt, ops) -> None:
    mirror = Mirror(model, prompt)
    for op, k, width, seed in ops:
        if op == "grow":
            mirror.append(k, width, seed)
        else:
            mirror.verify(seed, hit=op == "hit")
    # After everything, a fresh layer still attends correctly.
    mirror.append(2, 3, 1)


def test_cache_full_is_an_error_and_state_survives(model) -> None:
    stage = StageRuntime(model)
    stage.open("r", 4)
    stage.forward(Activation("r", torch.arange(3), committed=True, tokens=torch.tensor([1, 2, 3])))
    layer = Activation(
        "r",
        torch.tensor([3, 3]),
        node_ids=torch.tensor([0, 1]),
        parent_ids=torch.tensor([-1, -1]),
        tokens=torch.tensor([4, 5]),
    )
    with pytest.raises(CacheFull, match="full"):
        stage.forward(layer)
    cache = stage._cache("r")
    assert cache.length == 3
    out = stage.forward(layer.select(torch.tensor([0])))
    assert out.hidden.shape[0] == 1


def test_unknown_parent_is_rejected(model) -> None:
    stage = StageRuntime(model)
    stage.open("r", 8)
    bad = Activation(
        "r",
        torch.tensor([0]),
        node_ids=torch.tensor([5]),
        parent_ids=torch.tensor([4]),
        tokens=torch.tensor([1]),
    )
    with pytest.raises(BadInput, match="neither cached nor committed"):
        stage.forward(bad)
    assert stage._cache("r").length == 0


def test_late_prune_keeps_newer_nodes(model) -> None:
    """The router decided prune v (root 0 verified, child 1 kept, 2 dropped; ids <= 2 existed)
    and then created node 3 under 1. Node 3 reaches this stage before prune v does; the
    prune must keep it. A late activation for dropped node 2 is filtered, not an error."""
    stage = StageRuntime(model)
    stage.open("r", 16)
    ids = torch.tensor([0, 1, 2])
    stage.forward(
        Activation(
            "r",
            torch.tensor([0, 1, 1]),
            node_ids=ids,
            parent_ids=torch.tensor([-1, 0, 0]),
            tokens=torch.tensor([1, 2, 3]),
        )
    )
    stage.forward(
        Activation(
            "r",
            torch.tensor([2]),
            node_ids=torch.tensor([3]),
            parent_ids=torch.tensor([1]),
            tokens=torch.tensor([4]),
        )
    )
    stage.prune("r", Prune(torch.tensor([0]), torch.tensor([1]), horizon=2))
    cache = stage._cache("r")
    assert cache.tree_ids.tolist() == [1, 3]
    assert cache.n_committed == 1
    late = Activation(
        "r",
        torch.tensor([1]),
        node_ids=torch.tensor([2]),
        parent_ids=torch.tensor([0]),
        tokens=torch.tensor([3]),
    )
    assert stage.forward(late) is None


def test_prune_drops_descendants_of_dropped_nodes() -> None:
    cache = TreeKVCache(BlockPool(1, 1, 2, 1 << 20), 16)
    cache.append_nodes(np.array([0, 1, 2]), np.array([-1, 0, 0]))
    cache.append_nodes(np.array([3, 4]), np.array([1, 2]))
    # Node 4 is newer than the horizon but hangs under dropped node 2.
    cache.prune(np.array([0]), np.array([1]), horizon=2)
    assert cache.tree_ids.tolist() == [1, 3]
    assert cache.tree_mask.tolist() == [[True, False], [True, True]]


def prefill(rid: str, n: int, start: int = 0) -> Activation:
    return Activation(
        rid, torch.arange(start, start + n), committed=True, tokens=torch.arange(n) % 31
    )


def test_budget_and_release(model) -> None:
    """A request holds the blocks of the rows it has, not of its capacity; the budget
    refuses a request only when no block is free, and a release gives every block back."""
    stage = StageRuntime(model, max_cache_bytes=block_bytes(model, 2))
    stage.open("a", 1000)  # a capacity far beyond the budget reserves nothing
    stage.forward(prefill("a", BLOCK + 1))  # two blocks: the whole budget
    assert stage.info().cache_blocks_used == 2 and stage.info().cache_blocks_free == 0
    with pytest.raises(CacheFull, match="budget"):
        stage.open("b", 1)
    with pytest.raises(RuntimeError, match="already open"):
        stage.open("a", 1)
    assert stage.release("a") and not stage.release("a")
    assert stage.cache_bytes_used == 0
    stage.open("b", 10)
    assert stage.info().cache_bytes_used == 0
    stage.forward(prefill("b", 3))
    assert stage.info().cache_bytes_used == block_bytes(model, 1)


def block_bytes(model, blocks: int) -> int:
    cfg = model.cfg
    return 2 * len(model.layers) * cfg.num_kv_heads * cfg.head_dim * BLOCK * blocks * 8


def test_a_pool_that_runs_out_mid_request_fails_that_request_only(model) -> None:
    """Documented behaviour: no preemption; the request whose rows need a block when none
    is free gets CacheFull (RESOURCE_EXHAUSTED), its cache unchanged, the others go on."""
    stage = StageRuntime(model, max_cache_bytes=block_bytes(model, 3))
    for rid in "ab":
        stage.open(rid, 1000)
        stage.forward(prefill(rid, BLOCK))  # one full block each
    root = Activation("a", t(BLOCK), node_ids=t(0), parent_ids=t(-1), tokens=t(1))
    stage.forward(root)  # a's tree block: the last free one
    late = Activation("b", t(BLOCK), node_ids=t(0), parent_ids=t(-1), tokens=t(1))
    out = stage.forward_many(
        [late, Activation("a", t(BLOCK + 1), node_ids=t(1), parent_ids=t(0), tokens=t(2))]
    )
    assert isinstance(out[0], CacheFull) and "pool exhausted" in str(out[0])
    assert out[1].hidden.shape[0] == 1  # a's slot was in its own tree block
    assert stage._cache("b").length == BLOCK
    # Committing a's root needs a new committed block: none is free, the prune fails.
    with pytest.raises(CacheFull, match="pool exhausted"):
        stage.prune("a", Prune(t(0), t(1), horizon=1))
    stage.release("b")
    stage.forward(Activation("a", t(BLOCK + 2), node_ids=t(2), parent_ids=t(1), tokens=t(3)))
    assert stage.info().cache_blocks_used == 2


t = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731


def test_a_nodes_ancestors_are_its_parents_plus_itself_across_appends() -> None:
    """Random trees fed in BFS batches (parents cached, earlier in the batch, or the
    committed prefix): every new row's ancestor columns and the cached mask are the
    node's chain of tree parents, walked one by one; a batch that breaks BFS order,
    repeats an id or names an unknown parent is refused and leaves the cache as it was."""
    rng = np.random.default_rng(3)
    for _ in range(30):
        cache = TreeKVCache(BlockPool(1, 1, 2, 1 << 20), 512)
        cache.append_committed(int(rng.integers(0, 9)))
        parent_of: dict[int, int] = {}
        for _ in range(int(rng.integers(1, 5))):
            first, n = len(parent_of), int(rng.integers(0, 7))
            ids = np.arange(first, first + n)
            parents = np.array([int(rng.integers(-1, i)) for i in ids], dtype=np.int64)
            new = cache.append_nodes(ids, parents)
            parent_of.update(zip(ids.tolist(), parents.tolist(), strict=True))
            rows = {node: row for row, node in enumerate(cache.tree_ids.tolist())}
            for i, node in enumerate(ids.tolist()):
                chain, at = [], node
                while at != -1:
                    chain.append(rows[at])
                    at = parent_of[at]
                want = sorted(cache.n_committed + r for r in chain)
                assert [c for c in new.ancestors[i].tolist() if c >= 0] == want
                assert np.flatnonzero(cache.tree_mask[rows[node]]).tolist() == sorted(chain)
            assert (new.prefix == cache.n_committed).all() and new.slots.size == n
            if n:  # the keys its rows see, as the planner would read them from the arrays
                assert new.keys == max(int(new.prefix.max()), int(new.ancestors.max()) + 1)
        mask, tree = cache.tree_mask.copy(), cache.tree_ids.copy()
        k = len(parent_of)
        for ids, parents, why in [
            ([k, k + 1], [k + 1, -1], "BFS order"),
            ([k, k], [-1, -1], "duplicate"),
            ([0] if k else [k, k], [-1, -1], "duplicate"),
            ([k], [k + 50], "neither cached nor committed"),
        ]:
            with pytest.raises(BadInput, match=why):
                cache.append_nodes(np.array(ids), np.array(parents))
            assert cache.tree_mask.tolist() == mask.tolist()
            assert cache.tree_ids.tolist() == tree.tolist()


def test_a_prune_without_commits_keeps_exactly_the_surviving_subtrees() -> None:
    """Random trees pruned with no commit (the whole tree dropped, all of it kept by the
    horizon, or a part kept): the rows left are the nodes kept or past the horizon whose
    every tree ancestor is left too, their slots and mask rows as before, and the tree
    blocks no row uses are back in the pool (none at all once every row is gone)."""
    rng = np.random.default_rng(5)
    for trial in range(60):
        pool = BlockPool(1, 1, 2, 1 << 20, block_size=4)
        cache = TreeKVCache(pool, 512)
        chunk = cache.append_committed(3)
        assert chunk.keys == int(chunk.prefix.max()) == 3
        parent_of: dict[int, int] = {}
        for _ in range(int(rng.integers(1, 4))):
            first, n = len(parent_of), int(rng.integers(1, 7))
            ids = np.arange(first, first + n)
            parents = np.array([int(rng.integers(-1, i)) for i in ids], dtype=np.int64)
            cache.append_nodes(ids, parents)
            parent_of.update(zip(ids.tolist(), parents.tolist(), strict=True))
        total = len(parent_of)
        kind = trial % 3
        if kind == 0:  # everything goes
            keep, horizon = np.empty(0, dtype=np.int64), total
        elif kind == 1:  # the horizon keeps everything
            keep, horizon = np.empty(0, dtype=np.int64), -1
        else:
            keep = np.flatnonzero(rng.random(total) < 0.6)
            horizon = int(rng.integers(0, total))
        alive = {i for i in range(total) if i in set(keep.tolist()) or i > horizon}
        want = []
        for node in range(total):
            at, ok = node, True
            while at != -1:
                ok &= at in alive
                at = parent_of[at]
            if ok:
                want.append(node)
        row_of = {node: row for row, node in enumerate(cache.tree_ids.tolist())}
        slots = {node: int(cache.tree_slots[row_of[node]]) for node in want}
        mask = cache.tree_mask[np.ix_([row_of[x] for x in want], [row_of[x] for x in want])]
        src, dst = cache.prune_rows(np.empty(0, dtype=np.int64), keep, horizon)
        assert src.size == dst.size == 0
        assert cache.tree_ids.tolist() == want
        assert {n: int(s) for n, s in zip(want, cache.tree_slots.tolist(), strict=True)} == slots
        assert cache.tree_mask.tolist() == mask.tolist()
        used = {int(s) // 4 for s in cache.tree_slots.tolist()}
        assert set(cache.tree_blocks) == used
        assert pool.used_blocks == len(cache.blocks) + len(used)
        if not want:
            assert cache.tree_blocks == [] and cache._free_tree_slots == []
        # the cache takes new nodes after it (a parent left, or the committed prefix)
        parent = want[-1] if want else -1
        new = cache.append_nodes(np.array([total]), np.array([parent]))
        assert new.slots.size == 1 and cache.tree_ids.tolist() == [*want, total]
