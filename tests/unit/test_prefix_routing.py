"""Prefix-aware routing (services/router/prefix_affinity.py): with several replicas of a
stage, a request goes to the replica that was sent the longest prefix of its prompt,
unless that replica has `PREFIX_LOAD_SLACK` more requests than the least loaded; what a
replica is remembered to hold is bounded by its cache blocks."""

from __future__ import annotations

from types import SimpleNamespace

from specpipe.services.router.prefix_affinity import (
    PREFIX_LOAD_SLACK,
    PrefixIndex,
    PromptKeys,
    key_limit,
)

from .test_backends import add, backends

SYSTEM = list(range(1, 49))  # three blocks of 16 before the user turn


def take(bs, prompt):
    path = bs.path(need_draft=False, prompt=prompt)
    bs.acquire(path).release()  # served += 1: plain round robin would move on
    return path.stages


def test_requests_follow_their_prefix_load_permitting() -> None:
    bs = backends()
    a0, a1 = add(bs, "stage", "a0", (0, 2)), add(bs, "stage", "a1", (0, 2))
    b0, b1 = add(bs, "stage", "b0", (2, 4)), add(bs, "stage", "b1", (2, 4))
    first = take(bs, [*SYSTEM, 7, 8])
    assert first == [a0, b0]
    a0.active = b0.active = 1  # busier: load alone would pick a1 and b1
    assert bs.path(need_draft=False).stages == [a1, b1]
    assert take(bs, [*SYSTEM, 50, 51, 52]) == first  # the system prompt's replicas
    assert take(bs, [*SYSTEM, 7, 8]) == first
    assert take(bs, [9] * 40) == [a1, b1]  # another prompt: the least loaded
    a0.active = a1.active + PREFIX_LOAD_SLACK  # still within the slack
    assert take(bs, [*SYSTEM, 60])[0] == a0
    a0.active += 1  # too loaded: the least loaded replica takes it (and now holds it too)
    assert take(bs, [*SYSTEM, 61])[0] == a1
    a0.active = a1.active = 0
    assert bs.path(need_draft=False).stages[0] in (a0, a1)  # no prompt: load alone


def test_a_replica_remembers_at_most_its_cache_blocks() -> None:
    desc = SimpleNamespace(cache_block_rows=4, cache_blocks_used=1, cache_blocks_free=2)
    assert key_limit(desc) == 3
    index, keys = PrefixIndex(), PromptKeys(list(range(1, 22)))
    assert not PromptKeys([5]) and len(keys.of(desc)) == 5  # 20 tokens before the root
    index.add(keys.of(desc), key_limit(desc))
    assert len(index) == 3 and index.held(keys.of(desc)) == 0  # the first keys went first
    index.add(keys.of(desc)[:2], key_limit(desc))
    assert index.held(keys.of(desc)) == 2


def test_prompt_keys_are_those_of_the_request_s_cache_scope() -> None:
    """The router remembers the keys the replicas compute: salted per scope (F3), so a
    prompt of another tenant is not routed to where only its twin is cached."""
    from specpipe.common.runtime.prefix_hash import block_keys

    desc = SimpleNamespace(cache_block_rows=4)
    prompt = list(range(1, 22))
    plain, salted = PromptKeys(prompt), PromptKeys(prompt, b"s" * 16)
    assert salted.of(desc) == block_keys(prompt[:-1], 4, b"s" * 16)
    index = PrefixIndex()
    index.add(plain.of(desc), 100)
    assert index.held(plain.of(desc)) == 5 and index.held(salted.of(desc)) == 0
