"""A rolling model update through the same router, under load: a second model version
(another tiny model with the same vocabulary) joins discovery beside the first; new
requests move to it as soon as it makes a complete path, the first version's replicas
leave discovery and drain. No request fails, every output equals its own version's
reference, and afterwards only the new version answers."""

from __future__ import annotations

import functools
import threading
import time

import pytest
from specpipe.common.model.loading import weight_fingerprint

from specpipe.client import Client, SpecPipeError

from ..conftest import make_tiny_model
from .conftest import reference, start

PROMPTS = [[3, 14, 15], [9, 2, 6, 5], [27, 18], [31, 41, 59, 26]]
MODES = ["specpipe", "pp", "specinfer"]


@functools.cache
def _expected(target, prompt: tuple[int, ...], mode: str, n: int) -> list[int]:
    return reference(target, "oracle", 2, list(prompt), mode, n)


class Load:
    """Clients sending requests one after another until stopped; every result kept with
    the time it was sent."""

    def __init__(self, address: str, clients: int = 2) -> None:
        self.address = address
        self.results: list[tuple[float, dict, object]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)
        ]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        k = i
        with Client(self.address, timeout=120) as c:
            while not self._stop.is_set():
                kw = dict(prompt_ids=PROMPTS[k % len(PROMPTS)], mode=MODES[k % len(MODES)],
                          max_new_tokens=12 + k % 5)  # fmt: skip
                k += 1
                sent = time.monotonic()
                try:
                    out = c.generate(ignore_eos=True, **kw)
                except SpecPipeError as e:
                    out = e
                with self._lock:
                    self.results.append((sent, kw, out))

    def count(self, version: str | None = None) -> int:
        with self._lock:
            return sum(
                1 for _, _, r in self.results
                if not isinstance(r, SpecPipeError) and version in (None, r.weight_hash)
            )  # fmt: skip

    def wait_for(self, n: int, version: str | None = None, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.count(version) < n:
            assert time.monotonic() < deadline, (n, version, self.results[-3:])
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)


@pytest.mark.slow  # two model versions, seven processes at the peak: about a minute or two
def test_rolling_update_under_load(llama_dir, tmp_path) -> None:
    v2_dir = make_tiny_model(tmp_path / "v2", "llama", layers=4, seed=11)  # vocabulary 97
    v1, v2 = weight_fingerprint(llama_dir), weight_fingerprint(v2_dir)
    assert v1 != v2
    dep = start(llama_dir, "oracle", 2, "tcp", group="v1", replay_seconds=5.0)
    try:
        load = Load(dep.router_address)
        load.wait_for(3, v1)
        # v2 joins: its stages (another layout: 4 layers) and its draft.
        for name, layers in (("v2-stage0", "0:2"), ("v2-stage1", "2:4")):
            dep.add_stage(0, target=v2_dir, layers=layers, group="v2", name=name, wait=False)
        dep.add_draft(v2_dir, group="v2", name="v2-draft")
        dep._wait_ready(["v2-stage0", "v2-stage1"])
        load.wait_for(3, v2)  # new requests moved to v2 once its path was complete
        switched = time.monotonic()
        # v1 leaves discovery and drains: its open requests finish, then it exits.
        for name in ("stage0", "stage1", "draft"):
            dep.unlist(name)
        for name in ("stage0", "stage1", "draft"):
            assert dep.terminate(name) == 0
        retired = time.monotonic()
        load.wait_for(load.count() + 4)
        load.stop()
        with Client(dep.router_address, timeout=10) as c:
            (card,) = c.list_models()
            left = {b.weight_hash for b in c.describe().backends if b.kind == "stage"}
    finally:
        dep.stop()
    errors = [r for _, _, r in load.results if isinstance(r, SpecPipeError)]
    assert not errors, errors[:3]
    by_version = {v1: llama_dir, v2: v2_dir}
    for sent, kw, done in load.results:
        target = by_version[done.weight_hash]
        want = _expected(target, tuple(kw["prompt_ids"]), kw["mode"], kw["max_new_tokens"])
        assert done.token_ids == want, (done.weight_hash, kw)
        if sent > switched:
            assert done.weight_hash == v2, kw  # afterwards only v2 answers
    assert load.count(v1) >= 3 and load.count(v2) >= 7
    assert sum(1 for s, _, _ in load.results if s > retired) >= 4
    assert card.weight_hash == v2 and left == {v2}
