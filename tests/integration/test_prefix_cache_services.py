"""Prefix caching through the services: a request whose prompt shares a prefix with an
earlier one skips those prefill chunks on the whole pipeline (the router starts the
prefill at the least of what its path's stages hold), emits exactly the in-process
engine's (cold) tokens, and every stage's and the draft's metrics and Describe count the
hits; with `--no-prefix-cache` nothing is shared."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from specpipe.services.launcher import ServicesDeployment
from specpipe.v1 import dataplane_pb2

from specpipe.client import Client

from .conftest import reference_run, service_stub, start

CHUNK = 8
SYSTEM = torch.randint(1, 95, (50,), generator=torch.Generator().manual_seed(9)).tolist()


@pytest.fixture(scope="module")
def deployment(llama_dir) -> Iterator[ServicesDeployment]:
    """2 stages over TCP, the target as draft, metrics on; its own (the counters start
    at 0 and its caches hold only this module's prompts)."""
    dep = start(llama_dir, "oracle", 2, "tcp", metrics=True)
    try:
        yield dep
    finally:
        dep.stop()


def counters(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("specpipe:prefix_cache")
    }


def describe(dep: ServicesDeployment, name: str):
    child = dep.children[name]
    ch, stub = service_stub(child.info["grpc"], child.kind, dep.security)
    with ch:
        return stub.Describe(dataplane_pb2.DescribeRequest(), timeout=10)


def generate(dep: ServicesDeployment, prompt: list[int], mode: str, temperature: float):
    with Client(dep.router_address, timeout=120) as client:
        return client.generate(
            prompt_ids=prompt,
            mode=mode,
            max_new_tokens=12,
            temperature=temperature,
            seed=4,
            ignore_eos=True,
            prefill_chunk=CHUNK,
        )


@pytest.mark.parametrize(("mode", "temperature"), [("specpipe", 0.0), ("pp", 0.8)])
def test_shared_prefixes_skip_prefill_and_emit_cold_tokens(deployment, mode, temperature) -> None:
    dep = deployment
    stages = len(dep.ranges)
    tail = 3 if mode == "specpipe" else 40  # each test's prompts are its own
    prompts = [
        [*SYSTEM, tail, 11, 12],  # cold unless an earlier test cached SYSTEM
        [*SYSTEM, tail, 11, 12],
        [*SYSTEM, tail, 70, 71, 72, 73],
    ]
    before = {n: counters(c.info["metrics"]) for n, c in dep.children.items() if n != "router"}
    for i, prompt in enumerate(prompts):
        got = generate(dep, prompt, mode, temperature)
        ref = reference_run(
            dep.target, dep.draft, stages, prompt, mode, 12, temperature, 4, prefill_chunk=CHUNK
        )  # a fresh in-process engine: a cold run
        assert got.token_ids == ref.output, (mode, i)
        cold_steps = ref.stats.prefill_steps
        if i == 0 and mode == "specpipe":  # the module's first prompt: nothing cached
            assert got.stats["prefill_steps"] == cold_steps
        if i > 0:  # 48 tokens (3 blocks of 16) of the 52 or more before the root are cached
            assert got.stats["prefill_steps"] == -(-(len(prompt) - 1 - 48) // CHUNK)
            assert got.stats["prefill_steps"] < cold_steps
    for name, c in dep.children.items():
        if name == "router" or (c.kind == "draft" and mode == "pp"):
            continue
        after = counters(c.info["metrics"])
        hits = after["specpipe:prefix_cache_hits_total"] - before[name].get(
            "specpipe:prefix_cache_hits_total", 0.0
        )
        queries = after["specpipe:prefix_cache_queries_total"] - before[name].get(
            "specpipe:prefix_cache_queries_total", 0.0
        )
        assert hits >= 2 * 48 and queries == sum(len(p) - 1 for p in prompts), name
        desc = describe(dep, name)
        assert desc.prefix_caching and desc.prefix_cache_hits >= hits
        assert desc.prefix_cache_queries >= queries and desc.cache_blocks_cached >= 3


def test_no_prefix_cache_shares_nothing(llama_dir) -> None:
    dep = start(llama_dir, None, 1, "tcp", prefix_cache=False)
    try:
        prompt = [*SYSTEM, 5, 6]
        for _ in range(2):
            got = generate(dep, prompt, "pp", 0.0)
            assert got.stats["prefill_steps"] == -(-(len(prompt) - 1) // CHUNK)
        desc = describe(dep, next(n for n in dep.children if n != "router"))
        assert not desc.prefix_caching
        assert desc.prefix_cache_hits == 0 and desc.cache_blocks_cached == 0
    finally:
        dep.stop()


def _hits(dep: ServicesDeployment) -> dict[str, int]:
    """prefix_cache_hits of every stage and the draft."""
    return {name: describe(dep, name).prefix_cache_hits for name in dep.children
            if name != "router"}  # fmt: skip


def test_cached_prefixes_are_per_key_and_cache_salt(llama_dir) -> None:
    """F3: a prefix another client had sent came back 60-100x faster (anyone could
    confirm a guessed system prompt). Every stage and the draft key their blocks by a
    salt the router derives from the API key and the request's cache_salt: key a finds
    its own prompt again, key b (or a with another cache_salt) finds nothing, and the
    tokens are the same either way."""
    dep = start(llama_dir, "oracle", 2, "tcp", api_keys=("key-a", "key-b"))
    prompt = [*SYSTEM, 7, 8]

    def run(key: str, salt: str = "") -> tuple[list[int], dict[str, int]]:
        before = _hits(dep)
        with Client(dep.router_address, timeout=120, api_key=key) as client:
            out = client.generate(prompt_ids=prompt, max_new_tokens=6, ignore_eos=True,
                                  prefill_chunk=CHUNK, cache_salt=salt)  # fmt: skip
        after = _hits(dep)
        return out.token_ids, {n: after[n] - before[n] for n in after}

    try:
        cold, first = run("key-a")
        again, hit = run("key-a")
        other, miss = run("key-b")
        salted, salted_miss = run("key-a", "team-7")
    finally:
        dep.stop()
    assert not any(first.values())
    kinds = {name: dep.children[name].kind for name in hit}
    # Every stage prefilled the whole prompt before the first token: its 3 blocks of 16
    # were cached. The draft may lag under load and be released before its prefill
    # reached the last block (a late draft is skipped, not waited for): at least one.
    assert all(h >= 48 for n, h in hit.items() if kinds[n] != "draft"), hit
    assert all(h >= 16 for n, h in hit.items() if kinds[n] == "draft"), hit
    assert not any(miss.values()) and not any(salted_miss.values()), (miss, salted_miss)
    assert cold == again == other == salted
