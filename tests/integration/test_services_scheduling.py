"""Admission control and priorities through a real deployment (SpecPipe-DB): with one
running slot and two waiting places, a third waiting request is refused at once, the
more important waiting request runs first, and every answer is exact."""

from __future__ import annotations

import threading
import time

import pytest

from specpipe.client import Client, ResourceExhausted

from .conftest import reference, start


def _wait_for(client: Client, predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate(client.describe()):
        assert time.monotonic() < deadline, "the router never got there"
        time.sleep(0.02)


@pytest.fixture
def one_slot_deployment(llama_dir):
    dep = start(llama_dir, "oracle", 2, "tcp", scheduling=dict(max_running=1, max_waiting=2))
    try:
        yield dep
    finally:
        dep.stop()


def test_queue_priority_and_refusal(one_slot_deployment) -> None:
    dep = one_slot_deployment
    done: list[str] = []
    results: dict[str, list[int]] = {}

    def generate(name: str, prompt: list[int], priority: int) -> None:
        with Client(dep.router_address, timeout=120) as c:
            out = c.generate(
                prompt_ids=prompt, max_new_tokens=12, ignore_eos=True, priority=priority
            )
        results[name] = out.token_ids
        done.append(name)

    with Client(dep.router_address, timeout=120) as client:
        desc = client.describe()
        assert (desc.max_running, desc.max_waiting, desc.row_budget) == (1, 2, 0)
        # A long request holds the only slot until we cancel it.
        hog = client.stream(prompt_ids=[1, 2, 3], mode="pp", max_new_tokens=240, ignore_eos=True)
        first = next(iter(hog))
        assert first.token_ids
        low = threading.Thread(target=generate, args=("low", [5, 6, 7], 0))
        low.start()
        _wait_for(client, lambda d: d.waiting_requests == 1)
        high = threading.Thread(target=generate, args=("high", [8, 9], 5))
        high.start()
        _wait_for(client, lambda d: d.waiting_requests == 2)
        with pytest.raises(ResourceExhausted, match="retry later"):
            client.generate(prompt_ids=[4], max_new_tokens=2)
        hog.cancel()
        low.join(120)
        high.join(120)
    assert done == ["high", "low"]  # the important one was admitted first
    assert results["high"] == reference(dep.target, "oracle", 2, [8, 9], "specpipe", 12)
    assert results["low"] == reference(dep.target, "oracle", 2, [5, 6, 7], "specpipe", 12)
