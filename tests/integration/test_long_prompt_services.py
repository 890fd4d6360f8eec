"""One long prompt through the services (issue 35, F1): with a step memory budget far
below what its padded attention took, its prefill runs in parts, query blocks and key
blocks on every stage, its tokens are exactly the in-process engine's, and every
service stays up; a prompt the stages can never hold is refused up front with
INVALID_ARGUMENT and a message, and the deployment goes on serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from specpipe.services.launcher import ServicesDeployment

from specpipe.client import Client, InvalidArgument

from ..conftest import make_tiny_model
from .conftest import reference_run, start

CONTEXT = 2048


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = make_tiny_model(tmp_path_factory.mktemp("long"), "llama", layers=4, seed=0)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = CONTEXT
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def deployment(long_context_model: Path) -> Iterator[ServicesDeployment]:
    """2 stages, no draft; 1 MiB of working memory per step (a 128-row chunk at 900
    tokens of context would take 17 MiB of scores and mask in one padded call), and KV
    caches of 64 blocks of 16 rows per stage (1,024 tokens)."""
    dep = start(long_context_model, None, 2, "tcp", step_memory_mib=1.0, max_cache_gib=0.0005)
    try:
        yield dep
    finally:
        dep.stop()


def test_a_long_prompt_runs_within_the_step_budget_exactly(deployment) -> None:
    prompt = [(7 * i + 3) % 90 + 1 for i in range(900)]
    with Client(deployment.router_address, timeout=300) as client:
        got = client.generate(prompt_ids=prompt, mode="pp", max_new_tokens=6, ignore_eos=True)
    ref = reference_run(deployment.target, None, 2, prompt, "pp", 6)
    assert got.token_ids == ref.output
    assert got.stats["prefill_steps"] > -(-899 // 128)  # chunks priced by rows x keys
    assert all(c.proc.poll() is None for c in deployment.children.values())


def test_a_prompt_no_stage_can_hold_is_refused_up_front(deployment) -> None:
    with Client(deployment.router_address, timeout=60) as client:
        with pytest.raises(InvalidArgument, match=r"cannot serve a prompt of 1100 tokens"):
            client.generate(prompt_ids=[5] * 1100, mode="pp", max_new_tokens=2)
        ok = client.generate(prompt_ids=[5, 6, 7], mode="pp", max_new_tokens=2)
    assert len(ok.token_ids) == 2
