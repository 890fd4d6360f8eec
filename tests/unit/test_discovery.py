"""The router's discovery sources without a deployment: the static list, a followed file,
and EndpointSlices listed and watched through the official `kubernetes` client against a
small in-test API server (tests/fake_k8s.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from specpipe.services.router.discovery import (
    DEFAULT_SELECTOR,
    DiscoveryError,
    Endpoint,
    FileDiscovery,
    KubernetesDiscovery,
    StaticDiscovery,
    make_discovery,
    parse_backend_lines,
)

from ..fake_k8s import FakeApiServer, endpoint_slice


def collect(discovery, steps, timeout: float = 20.0) -> list[frozenset[Endpoint]]:
    """Run `discovery`; `steps` is a list of (action, predicate): while the first pending
    predicate holds for the newest published set, its action runs (in a thread) and the
    next one is checked. Returns every published set."""

    async def main():
        seen: list[frozenset[Endpoint]] = []
        changed = asyncio.Event()

        def publish(eps):
            seen.append(eps)
            changed.set()

        task = asyncio.create_task(discovery.run(publish))
        pending = list(steps)
        deadline = time.monotonic() + timeout
        try:
            while pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(pending)} steps left; sets seen: {seen}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), 0.05)
                changed.clear()
                while pending and seen and pending[0][1](seen[-1]):
                    action, _ = pending.pop(0)
                    if action is not None:
                        await asyncio.get_running_loop().run_in_executor(None, action)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return seen

    return asyncio.run(main())


def addresses(eps: frozenset[Endpoint], kind: str = "stage") -> set[str]:
    return {e.address for e in eps if e.kind == kind}


def test_file_lines() -> None:
    text = "# the deployment\nstage 10.0.0.1:50052\n  draft h:1 v2  # comment\n\n"
    assert parse_backend_lines(text) == [("stage", "10.0.0.1:50052", ""), ("draft", "h:1", "v2")]
    for bad in ("stages h:1", "stage h", "stage h:0", "stage h:1 v1 extra", "stage :5"):
        with pytest.raises(DiscoveryError, match="line 1"):
            parse_backend_lines(bad)


def test_static_and_command_line_specs(tmp_path) -> None:
    d = make_discovery(None, ["a:1", "b:2"], ["c:3"])
    assert isinstance(d, StaticDiscovery)
    (eps,) = collect(d, [(None, lambda eps: True)])
    assert addresses(eps) == {"a:1", "b:2"} and addresses(eps, "draft") == {"c:3"}
    assert isinstance(make_discovery(f"file:{tmp_path}/x"), FileDiscovery)
    k = make_discovery("kubernetes", namespace="ns")
    assert isinstance(k, KubernetesDiscovery) and k.selector == DEFAULT_SELECTOR
    for spec, stages in (("nope", []), ("file:", []), ("file:/x", ["a:1"]), (None, [])):
        with pytest.raises(DiscoveryError):
            make_discovery(spec, stages)


def test_file_is_followed_for_changes(tmp_path) -> None:
    path = tmp_path / "backends"

    def write(text: str):
        return lambda: path.write_text(text)

    seen = collect(
        FileDiscovery(path, interval=0.02),
        [
            (write("stage h:1\nstage h:2 v1\n"), lambda eps: not eps),  # missing: empty
            (
                write("stage h:1\nstage h:2 v1\nstage h:3 v2\ndraft h:9\n"),
                lambda eps: len(eps) == 2,
            ),
            (write("stage h:1\nnot a line\n"), lambda eps: len(eps) == 4),  # bad: kept
            (write("stage h:3 v2\n"), lambda eps: len(eps) == 4),
            (None, lambda eps: addresses(eps) == {"h:3"}),
        ],
    )
    assert addresses(seen[1]) == {"h:1", "h:2"}
    full = {e.address: e for e in seen[2]}
    assert full["h:2"].group == "v1" and full["h:9"].kind == "draft"
    assert full["h:1"].order < full["h:2"].order < full["h:3"].order  # later lines are newer
    assert seen[-1] == frozenset([full["h:3"]])  # the same endpoint, first seen then


def test_endpoint_slices_listed_then_watched() -> None:
    with FakeApiServer() as api:
        api.put(endpoint_slice("specpipe-v1-stage-0-abc", "stage", ["10.0.0.1", "10.0.0.2"], 50052))
        api.put(endpoint_slice("specpipe-router-x", "router", ["10.0.0.9"], 50051))
        discovery = KubernetesDiscovery("specpipe", api_client=api.api_client(),
                                        watch_seconds=2, backoff=0.05)  # fmt: skip
        stage0 = "specpipe-v1-stage-0-abc"
        seen = collect(
            discovery,
            [
                (lambda: api.put(endpoint_slice(
                    stage0, "stage", ["10.0.0.1", "10.0.0.2", "10.0.0.3"], 50052,
                    terminating=("10.0.0.2",)))
                 , lambda eps: len(eps) == 2 and api.watchers() == 1),
                (lambda: api.put(endpoint_slice("specpipe-v2-draft-q", "draft", ["10.0.1.5"], 50060,
                                                version="v2", created="2025-02-01T00:00:00Z")),
                 lambda eps: len(eps) == 3),
                (api.expire, lambda eps: len(eps) == 4),
                (lambda: api.delete(stage0), lambda eps: api.watchers() == 1 and len(
                    [r for r in api.requests if r.get("watch") != "true"]) == 2),
                (None, lambda eps: addresses(eps) == set()),
            ],
        )  # fmt: skip
        first = {e.address: e for e in seen[0]}
        assert set(first) == {"10.0.0.1:50052", "10.0.0.2:50052"}  # the router is not listed
        assert all(e.kind == "stage" and e.group == "v1" and not e.draining for e in first.values())
        second = {e.address: e for e in seen[1]}
        assert second["10.0.0.2:50052"].draining and not second["10.0.0.3:50052"].draining
        third = {e.address: e for e in seen[2]}
        assert third["10.0.1.5:50060"].kind == "draft" and third["10.0.1.5:50060"].group == "v2"
        assert third["10.0.1.5:50060"].order > third["10.0.0.1:50052"].order  # newer Service
        lists = [r for r in api.requests if r.get("watch") != "true"]
        assert len(lists) == 2  # listed again after the 410
        assert all(r["labelSelector"] == DEFAULT_SELECTOR for r in api.requests)
        watches = [r for r in api.requests if r.get("watch") == "true"]
        assert watches[0]["resourceVersion"] == "3"  # from the list, not from scratch


def test_a_failing_api_server_keeps_the_last_set() -> None:
    api = FakeApiServer().__enter__()
    api.put(endpoint_slice("s-0", "stage", ["10.0.0.1"], 50052))
    discovery = KubernetesDiscovery("specpipe", api_client=api.api_client(), backoff=0.05)
    until = []
    seen = collect(
        discovery,
        [
            (lambda: (api.__exit__(None, None, None), until.append(time.monotonic() + 1.0)),
             lambda eps: len(eps) == 1 and api.watchers() == 1),
            (None, lambda eps: time.monotonic() > until[0]),  # a second of retries
        ],
    )  # fmt: skip
    assert len(seen) == 1 and addresses(seen[0]) == {"10.0.0.1:50052"}
