"""The router refuses a prompt its stages can never hold, up front and with a clear
status, and sizes prefill chunks to its stages' prefill budget (issue 35, F1)."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
from specpipe.services.client import build_request
from specpipe.services.router.requests import InvalidRequest
from specpipe.services.router.step_fit import check_cache_fits, prefill_cells_of

from .test_backends import add
from .test_services_router import _with_router


def desc(layers=(0, 4), used=0, free=64, cells=0):
    return SimpleNamespace(layer_start=layers[0], layer_end=layers[1], cache_blocks_used=used,
                           cache_blocks_free=free, cache_block_rows=16, prefill_cells=cells)  # fmt: skip


def test_a_prompt_that_no_replica_of_a_range_can_hold_is_refused() -> None:
    descs = [desc((0, 2), free=100), desc((0, 2), used=40, free=60), desc((2, 4), free=10)]
    check_cache_fits(16 * 9, descs)  # 9 blocks + 1 for the output: the (2, 4) stage holds 10
    with pytest.raises(
        ValueError, match=r"needs 11 KV cache blocks .* layers 2-4.* \(at most 144\)"
    ):
        check_cache_fits(16 * 9 + 1, descs)
    check_cache_fits(10**6, [SimpleNamespace(layer_start=0, layer_end=4)])  # not said: no check


def test_chunks_take_the_least_prefill_budget_of_the_stages() -> None:
    assert prefill_cells_of([desc(cells=1 << 20), desc(cells=1 << 18), desc(cells=0)]) == 1 << 18
    assert prefill_cells_of([SimpleNamespace()]) is None


def _router_plan(prompt_len: int):
    def plan(router):
        s = add(router.backends, "stage", "s0", (0, 4))
        s.desc.cache_blocks_used, s.desc.cache_blocks_free = 2, 6  # 8 blocks of 16 rows
        s.desc.cache_block_rows, s.desc.prefill_cells, s.desc.max_step_rows = 16, 4096, 0
        try:
            return router.plan(build_request(prompt_ids=[1] * prompt_len, max_new_tokens=4))
        finally:
            router.backends.by_key.clear()  # no channel to close

    return _with_router(plan)


def test_the_router_refuses_it_with_invalid_argument_and_sizes_the_chunks() -> None:
    assert _router_plan(100).opts.prefill_cells == 4096
    with pytest.raises(InvalidRequest) as e:
        _router_plan(113)  # 8 blocks of prompt + 1
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot serve a prompt of 113 tokens (at most 112)" in str(e.value)
