"""The KV pool is allocated once, for its whole budget, and never grows or moves inside
a step (common/runtime/block_pool.py); on the CPU a budget the stage never touches costs
address space, not memory."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from specpipe.common.model.loading import load_stage
from specpipe.common.runtime.block_pool import BlockPool
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation

from ..conftest import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(
        tmp_path_factory.mktemp("m"), layers=2, hidden=16, heads=4, kv_heads=2, vocab=32
    )
    return load_stage(path, dtype=torch.float32)


def storage(stage: StageRuntime) -> tuple[int, int, tuple[int, ...]]:
    return stage.pool.k.data_ptr(), stage.pool.v.data_ptr(), tuple(stage.pool.k.shape)


def test_the_storage_never_moves_while_requests_come_and_go(model) -> None:
    """Prefills, tree steps, commits and releases of more requests than a doubling pool
    would have started with: the storage is the one allocated at start throughout."""
    stage = StageRuntime(model, max_cache_bytes=0, block_size=4)
    stage.max_cache_bytes = 64 * stage.pool.block_bytes  # a service sizing it at start
    start = storage(stage)
    assert start[2][1] == 64 * 4 and stage.pool.used_blocks == 0
    for i in range(6):
        rid = f"r{i}"
        stage.open(rid, 64)
        n = 5 + 7 * i
        stage.forward(Activation(rid, torch.arange(n), committed=True, tokens=torch.arange(n) % 32))
        ids = torch.arange(100, 104)
        stage.forward(
            Activation(
                rid,
                torch.full((4,), n),
                node_ids=ids,
                parent_ids=torch.full((4,), -1),
                tokens=ids % 32,
            )
        )
        assert storage(stage) == start, f"the storage moved at request {i}"
    assert stage.pool.used_blocks > 16  # beyond a first doubling's 16 blocks
    for i in range(6):
        stage.release(f"r{i}")
    assert storage(stage) == start and stage.pool.used_blocks == 0


def test_the_default_budget_is_allocated_at_first_use_and_a_set_budget_at_once(model) -> None:
    stage = StageRuntime(model)  # in-process, the default budget: nothing yet
    assert stage.pool.k.shape[1] == 0
    stage.open("r", 8)
    stage.forward(Activation("r", torch.arange(3), committed=True, tokens=torch.arange(3)))
    assert stage.pool.k.shape[1] == stage.pool.max_blocks * stage.pool.block_size
    busy = storage(stage)
    stage.max_cache_bytes = 4 * stage.pool.block_bytes  # while held: capped, not moved
    assert storage(stage) == busy and stage.pool.max_blocks == 4
    stage.max_cache_bytes = 1 << 40  # more than the storage while held: still capped
    assert storage(stage) == busy and stage.pool.max_blocks == busy[2][1] // 16
    stage.release("r")
    stage.max_cache_bytes = 8 * stage.pool.block_bytes  # idle: allocated anew, once
    assert stage.pool.k.shape[1] == 8 * 16 and stage.pool.used_blocks == 0


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's VmRSS")
def test_a_cpu_budget_costs_memory_only_where_written() -> None:
    """A 2 GiB pool (bf16, as a real stage's) is zeros at once, yet commits only the
    pages written: a CPU stage's or a test's budget is not taken from the machine."""
    gc.collect()
    before = _rss_bytes()
    pool = BlockPool(28, 2, 128, max_bytes=2 << 30, dtype=torch.bfloat16)
    assert pool.k.nbytes + pool.v.nbytes > (2 << 30) - pool.block_bytes
    assert _rss_bytes() - before < 64 << 20
    (block,) = pool.allocate(1)
    slots = torch.from_numpy(pool.slots([block], 0, 16))
    pool.k[:, slots] = 1.0
    assert pool.k[:, slots].float().sum().item() == 28 * 16 * 2 * 128
    assert pool.v[0, :64].abs().sum().item() == 0.0  # zeros where never written
    assert _rss_bytes() - before < 64 << 20
