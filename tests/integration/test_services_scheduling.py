"""Admission control and priorities through a real deployment (SpecPipe-DB): with one
running slot and two waiting places, a third waiting request is refused at once, the
more important waiting request runs first, and every answer is exact; API keys share the
slots fairly (issue 35, F2)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

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


@pytest.fixture
def two_keys_deployment(llama_dir):
    dep = start(
        llama_dir, "oracle", 2, "tcp", api_keys=("key-a", "key-b"), http_port=0,
        scheduling=dict(max_running=2, max_waiting=4, max_running_per_key=1,
                        max_waiting_per_key=1),
    )  # fmt: skip
    try:
        yield dep
    finally:
        dep.stop()


def _post(address: str, key: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://{address}/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_flooding_key_leaves_room_for_another(two_keys_deployment) -> None:
    """F2: one client's requests with n=16 took 304 of the 320 slots, and a neighbour
    waited 36 s (with 8 + 8 slots it was refused). Now each key has a share: key a runs
    one request and queues one; more of a's are refused (a request's n choices all
    count, up front), and key b's request runs at once, exact."""
    dep = two_keys_deployment
    queued: list[list[int]] = []
    with Client(dep.router_address, timeout=120, api_key="key-a") as a:
        hog = a.stream(prompt_ids=[1, 2, 3], mode="pp", max_new_tokens=240, ignore_eos=True)
        assert next(iter(hog)).token_ids

        def wait_in_queue() -> None:
            with Client(dep.router_address, timeout=120, api_key="key-a") as c:
                queued.append(c.generate(prompt_ids=[5, 6], max_new_tokens=4).token_ids)

        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        _wait_for(a, lambda d: d.waiting_requests == 1)
        d = a.describe()
        assert (d.max_running_per_key, d.max_waiting_per_key) == (1, 1)
        assert (d.caller_running, d.caller_waiting) == (1, 1)
        with pytest.raises(ResourceExhausted, match="this client"):
            a.generate(prompt_ids=[4], max_new_tokens=2)
        status, body = _post(dep.http_address, "key-a",
                             {"prompt": [4], "max_tokens": 2, "n": 3})  # fmt: skip
        assert status == 429 and "3 choices" in body["error"]["message"]
        with Client(dep.router_address, timeout=120, api_key="key-b") as b:
            assert (b.describe().caller_running, b.describe().caller_waiting) == (0, 0)
            out = b.generate(prompt_ids=[8, 9], max_new_tokens=12, ignore_eos=True)
        hog.cancel()
        waiter.join(120)
    assert out.token_ids == reference(dep.target, "oracle", 2, [8, 9], "specpipe", 12)
    assert len(queued) == 1
