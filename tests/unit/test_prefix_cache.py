"""Prefix caching (docs/architecture.md, "5. The request controller and its executors",
"The stage engine"): requests whose prompts share
a prefix share its cached blocks on every stage and the draft, skip those prefill chunks,
and emit exactly the tokens of a cold run; unreferenced cached blocks are evicted least
recently used first, only when the pool needs room; `--no-prefix-cache` turns it off.
(Block accounting under sharing: tests/unit/test_block_pool.py.)"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime.block_pool import BlockPool
from specpipe.common.runtime.draft import DraftRuntime
from specpipe.common.runtime.errors import BadInput, CacheFull
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.runtime.pipeline import LocalPipeline
from specpipe.common.runtime.prefix_hash import CacheScope, block_keys
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation
from specpipe.common.spec.options import DecodeOptions
from specpipe.common.spec.sampling import SamplingParams

DTYPE = torch.float64  # hits and cold runs compute rows in other groupings: exact in fp64


def test_block_keys_are_chained_over_full_blocks() -> None:
    a = block_keys(list(range(10)), 4)
    assert len(a) == 2  # the partial block [8, 10) has no key
    assert block_keys([*list(range(8)), 50, 51], 4) == a  # only full blocks count
    b = block_keys([99, *range(1, 10)], 4)
    assert b[0] != a[0] and b[1] != a[1]  # a block's key covers every token before it
    assert block_keys(np.arange(10), 4) == a  # lists and arrays alike
    assert block_keys([1, 2, 3], 4) == []


def _pool(blocks: int) -> BlockPool:
    pool = BlockPool(1, 1, 2, max_bytes=blocks * 2 * 4 * 2 * 8, block_size=4, dtype=DTYPE)
    assert pool.max_blocks == blocks
    return pool


def _cached(pool: BlockPool, tokens: list[int], owner: bytes = b"") -> list[int]:
    """Blocks of a request that computed `tokens`, registered, then released."""
    keys = block_keys(tokens, pool.block_size)
    blocks = pool.allocate(len(keys))
    for b, k in zip(blocks, keys, strict=True):
        pool.register(b, k, owner)
    pool.release(blocks)
    return blocks


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_first() -> None:
    pool = _pool(4)
    x, y = list(range(8)), list(range(100, 108))
    xb = _cached(pool, x)  # released first
    yb = _cached(pool, y)
    assert pool.used_blocks == 0 and pool.cached_blocks == 4 and pool.free_blocks == 4
    # Each sequence's tail goes before its head; x (released first) before y.
    (a,) = pool.allocate(1)
    assert a == xb[1] and pool.evictions == 1
    assert pool.lookup(block_keys(x, 4)) == [xb[0]]  # the head is still there...
    pool.release([xb[0]])  # ...and, just used, now the most recently released
    (b,) = pool.allocate(1)
    assert b == yb[1]
    assert pool.lookup(block_keys(y, 4)) == [yb[0]]
    pool.release([yb[0]])
    (c,) = pool.allocate(1)
    assert c == xb[0]  # x's head was released before y's
    assert pool.lookup(block_keys(x, 4)) == []
    with pytest.raises(CacheFull):
        pool.allocate(2)  # one cached block left: nothing taken
    assert pool.lookup(block_keys(y, 4)) == [yb[0]]


def test_cached_blocks_stay_until_room_is_needed() -> None:
    pool = _pool(8)
    blocks = _cached(pool, list(range(8)))
    plain = pool.allocate(6)  # storage and plain free blocks first
    assert not set(plain) & set(blocks) and pool.evictions == 0
    assert pool.lookup(block_keys(list(range(8)), 4)) == blocks
    assert pool.refcount(blocks[0]) == 1


def test_a_shared_block_stays_held_until_its_last_holder_releases_it() -> None:
    pool = _pool(4)
    (b,) = _cached(pool, [1, 2, 3, 4])
    keys = block_keys([1, 2, 3, 4], 4)
    assert pool.lookup(keys) == [b] and pool.lookup(keys) == [b]
    assert pool.refcount(b) == 2 and pool.used_blocks == 1
    pool.release([b])
    assert pool.refcount(b) == 1 and pool.cached_blocks == 0
    pool.allocate(3)
    with pytest.raises(CacheFull):
        pool.allocate(1)  # the held block is never evicted
    pool.release([b])
    assert pool.cached_blocks == 1 and pool.free_blocks == 1


@pytest.fixture(scope="module")
def target(llama_dir):
    return llama_dir


def _pipeline(target, block_sizes=(4, 6), prefix_caching: bool = True):
    """Two stages of the 5-layer test model with their own block sizes (the path's
    minimum then falls inside a block of one of them), and the oracle draft."""
    cuts = [(0, 2), (2, 5)]
    stages = [
        StageRuntime(
            load_stage(target, LayerRange(a, b, 5), DTYPE),
            block_size=bs,
            prefix_caching=prefix_caching,
        )
        for (a, b), bs in zip(cuts, block_sizes, strict=True)
    ]
    draft = DraftRuntime(load_stage(target, None, DTYPE), prefix_caching=prefix_caching)
    return LocalPipeline(stages), draft


def _run(pipeline, draft, prompt, mode, temperature):
    opts = DecodeOptions(
        max_new_tokens=12,
        sampling=SamplingParams(temperature, 0, 1.0, 5),
        width=3,
        prefill_chunk=8,
    )
    gen = LockstepGeneration(pipeline, draft, prompt, mode, opts)
    gen.run()
    return gen


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("mode", ["specpipe", "pp"])
def test_prefix_hits_emit_the_tokens_of_a_cold_run(target, mode, temperature) -> None:
    g = torch.Generator().manual_seed(3)
    system = torch.randint(1, 95, (45,), generator=g).tolist()
    prompts = [
        [*system, 7, 8, 9],  # cold
        [*system, 7, 8, 9],  # the whole prompt but its last token can hit
        [*system, 60, 61],  # the shared system prompt hits
        system[:13] + [2] * 30,  # a short common prefix
    ]
    warm_pipe, warm_draft = _pipeline(target)
    cold_pipe, cold_draft = _pipeline(target, prefix_caching=False)
    for i, prompt in enumerate(prompts):
        warm = _run(warm_pipe, warm_draft, prompt, mode, temperature)
        cold = _run(cold_pipe, cold_draft, prompt, mode, temperature)
        assert warm.output == cold.output, (i, warm.output, cold.output)
        cached = warm.controller.cached_prefix
        if i == 0:
            assert cached == 0 and warm.stats.prefill_steps == cold.stats.prefill_steps
        else:
            # The least of the stages' cached prefixes (blocks of 4 and 6 rows).
            shared = len(prompt) - 1 if i == 1 else (45 if i == 2 else 13)
            assert cached == min(shared // 4 * 4, shared // 6 * 6) > 0
            assert warm.stats.prefill_steps == -(-(len(prompt) - 1 - cached) // 8)
            assert warm.stats.prefill_steps < cold.stats.prefill_steps
    for s in warm_pipe.stages:
        info = s.info()
        assert info.prefix_cache_hits > 0 and info.prefix_cache_queries > info.prefix_cache_hits
        assert s.pool.used_blocks == 0  # every request released: only cached blocks left
        assert info.cache_blocks_cached > 0
    for s in cold_pipe.stages:
        assert s.info().prefix_cache_queries == 0 and s.pool.cached_blocks == 0
    if mode == "specpipe":
        assert warm_draft.runtime.info().prefix_cache_hits > 0


def test_a_stage_holding_more_than_the_path_rewrites_from_the_path_minimum(target) -> None:
    """One stage lost its cache (evicted, restarted): the path's minimum is 0, the other
    stage drops what it holds beyond it, and the tokens are still the cold run's."""
    prompt = torch.randint(1, 95, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    pipe, draft = _pipeline(target, block_sizes=(4, 4))
    first = _run(pipe, draft, prompt, "specpipe", 0.0)
    pipe.stages[1].pool.clear_prefix_cache()
    again = _run(pipe, draft, prompt, "specpipe", 0.0)
    assert again.controller.cached_prefix == 0 and again.output == first.output
    assert again.stats.prefill_steps == first.stats.prefill_steps
    assert pipe.stages[0].info().prefix_cache_hits == 36  # it had them; the path did not
    third = _run(pipe, draft, prompt, "specpipe", 0.0)
    assert third.controller.cached_prefix == 36 and third.output == first.output


def test_the_first_stage_refuses_prefill_tokens_other_than_announced(target) -> None:
    stage = StageRuntime(load_stage(target, LayerRange(0, 2, 5), DTYPE), block_size=4)
    stage.open("r", 32, prefix_tokens=[1, 2, 3, 4, 5, 6])
    chunk = Activation("r", torch.arange(0, 4), committed=True, tokens=torch.tensor([1, 2, 9, 4]))
    with pytest.raises(BadInput, match="differ from the prefix"):
        stage.forward(chunk)
    ok = Activation("r", torch.arange(0, 4), committed=True, tokens=torch.tensor([1, 2, 3, 4]))
    stage.forward(ok)
    with pytest.raises(BadInput, match="capacity"):
        stage.open("s", 4, prefix_tokens=list(range(5)))
    assert "s" not in stage._caches


def test_pool_pressure_evicts_cached_prefixes_instead_of_refusing(target) -> None:
    stage = StageRuntime(load_stage(target, LayerRange(0, 2, 5), DTYPE), block_size=4)
    stage.max_cache_bytes = 6 * stage.pool.block_bytes

    def prefill(rid: str, tokens: list[int]) -> int:
        cached = stage.open(rid, 64, prefix_tokens=tokens)
        n = len(tokens) - cached
        pos = torch.arange(cached, len(tokens))
        stage.forward(Activation(rid, pos, committed=True, tokens=torch.tensor(tokens[cached:])))
        assert n > 0
        return cached

    a = list(range(1, 21))  # 5 blocks
    assert prefill("a", a) == 0
    stage.release("a")
    assert stage.pool.cached_blocks == 5 and stage.pool.free_blocks == 6
    assert prefill("b", list(range(30, 50))) == 0  # evicts 4 of a's (tail first)
    assert stage.pool.evictions == 4
    stage.release("b")
    assert prefill("c", a) == 4  # a's first block survived


def test_no_prefix_cache_turns_it_off(target, llama_dir) -> None:
    from specpipe.services.launcher import ServicesDeployment
    from specpipe.services.serve import _set_cache_budget

    from specpipe.cli import build_parser

    parse = build_parser().parse_args
    need = {"stage": [], "draft": ["--model", "m"], "up": ["--target", "t"]}
    for command, args in need.items():
        assert not parse([command, *args]).no_prefix_cache
        assert parse([command, *args, "--no-prefix-cache"]).no_prefix_cache
    off = ServicesDeployment(llama_dir, "oracle", 2, prefix_cache=False, max_cache_gib=1.0)
    on = ServicesDeployment(llama_dir, "oracle", 2)
    assert off._cache_budget()["no_prefix_cache"]  # every stage's and the draft's config
    assert "no_prefix_cache" not in on._cache_budget()
    for d in (off, on):
        d.stop()

    stage = StageRuntime(load_stage(target, LayerRange(0, 2, 5), DTYPE), block_size=4)
    tokens = list(range(1, 13))
    stage.open("a", 32, prefix_tokens=tokens)
    stage.forward(Activation("a", torch.arange(12), committed=True, tokens=torch.tensor(tokens)))
    stage.release("a")
    assert stage.pool.cached_blocks == 3
    _set_cache_budget(stage, argparse.Namespace(max_cache_gib=1.0, no_prefix_cache=True))
    assert not stage.prefix_caching and stage.pool.cached_blocks == 0  # forgotten
    assert stage.open("b", 32, prefix_tokens=tokens) == 0
    stage.forward(Activation("b", torch.arange(12), committed=True, tokens=torch.tensor(tokens)))
    stage.release("b")
    assert stage.pool.cached_blocks == 0 and stage.open("c", 32, prefix_tokens=tokens) == 0
    info = stage.info()  # only "a", opened while it was on, was looked up
    assert info.prefix_cache_queries == 12 and info.prefix_cache_hits == 0
    assert not info.prefix_caching


# -- isolation between tenants (issue 35, F3) ------------------------------------------------
def test_a_salt_gives_every_block_another_key() -> None:
    tokens = list(range(12))
    plain = block_keys(tokens, 4)
    assert block_keys(tokens, 4, salt=b"") == plain  # unsalted: the keys of before
    a, b = block_keys(tokens, 4, salt=b"a" * 16), block_keys(tokens, 4, salt=b"b" * 16)
    assert len(a) == 3 and not set(a) & set(plain) and not set(a) & set(b)


def test_a_prefix_another_tenant_cached_is_not_found(target) -> None:
    """F3: a prefix another client sent came back 60-100x faster, so anyone could
    confirm a guessed system prompt. Scoped requests find only their own scope's
    blocks."""
    stage = StageRuntime(load_stage(target, LayerRange(0, 2, 5), DTYPE), block_size=4)
    alice, bob = CacheScope(b"a" * 16, b"A"), CacheScope(b"b" * 16, b"B")
    tokens = list(range(1, 21))
    assert _prefill(stage, "a1", tokens, alice) == 0
    stage.release("a1")
    assert _prefill(stage, "b1", tokens, bob) == 0  # bob cannot see alice's prefix
    stage.release("b1")
    assert _prefill(stage, "a2", tokens, alice) == 20  # alice still finds hers
    assert stage.open("p", 64, prefix_tokens=tokens) == 0  # nor does an unscoped one


def test_one_owner_cannot_flush_another_below_its_share() -> None:
    """F3: 40 distinct prefixes pushed a victim's prefix out of the cache. Eviction
    takes from the owner holding the most cached blocks."""
    pool = _pool(8)
    victim = _cached(pool, list(range(8)), owner=b"victim")  # 2 blocks
    for i in range(40):  # the attacker's prefixes, 2 blocks each
        _cached(pool, list(range(1000 + 8 * i, 1008 + 8 * i)), owner=b"attacker")
    assert pool.lookup(block_keys(list(range(8)), 4)) == victim
    pool.release(victim)
    assert pool.cached_blocks == 8


def test_eviction_takes_from_the_largest_owner_least_recent_first() -> None:
    pool = _pool(6)
    a1 = _cached(pool, list(range(8)), owner=b"a")
    b1 = _cached(pool, list(range(100, 108)), owner=b"b")
    a2 = _cached(pool, list(range(200, 208)), owner=b"a")
    (x,) = pool.allocate(1)  # a holds 4 cached blocks, b 2: a's oldest tail goes
    assert x == a1[1]
    y, z = pool.allocate(2)  # a 3, b 2, then a 2, b 2: a's, then (tie) the older
    assert {y, z} == {a1[0], b1[1]} and a2[0] not in (x, y, z)


def _prefill(stage, rid: str, tokens: list[int], scope) -> int:
    cached = stage.open(rid, 64, prefix_tokens=tokens, cache_scope=scope)
    pos = torch.arange(cached, len(tokens))
    if pos.numel():
        stage.forward(Activation(rid, pos, committed=True, tokens=torch.tensor(tokens[cached:])))
    return cached
