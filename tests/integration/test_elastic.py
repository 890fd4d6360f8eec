"""Elastic deployment, local multi-process: replicas found through the router's discovery
file while it serves, faults (SIGKILL of a stage replica or the draft while requests
stream) that no request notices, and metrics scraped from every process.

One deployment for the module: 2 stages, stage 1 with two replicas, the target itself as
draft, metrics on. The tests run in order on it: a stage-1 replica is killed, then the
draft (another one joins), then a new stage-1 replica joins and leaves discovery."""

from __future__ import annotations

import functools
import os
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specpipe.client import Client, SpecPipeError

from .conftest import reference, start

# Requests of every kind that must come out exactly: greedy and seeded sampling,
# specpipe (with the draft; one and two layers per step), pp and specinfer.
REQUESTS = [
    dict(prompt_ids=[3, 14, 15], mode="specpipe", max_new_tokens=60),
    dict(prompt_ids=[9, 2, 6, 5, 3], mode="specpipe", max_new_tokens=50, temperature=0.9, seed=7),
    dict(prompt_ids=[27, 18], mode="pp", max_new_tokens=30),
    dict(prompt_ids=[31, 41, 59], mode="specinfer", max_new_tokens=50, temperature=0.7, seed=3),
    # two layers per step: the last stage walks two levels a step (its replay too)
    dict(prompt_ids=[8, 1, 4], mode="specpipe", max_new_tokens=50, layers_per_step=2),
]


@pytest.fixture(scope="module")
def elastic(llama_dir) -> Iterator:
    dep = start(
        llama_dir, "oracle", 2, "tcp", metrics=True, replay_seconds=20.0, stage_replicas=[1, 2]
    )
    try:
        wait_backends(dep, stages=3)
        yield dep
    finally:
        dep.stop()


def router_view(dep):
    with Client(dep.router_address, timeout=30) as c:
        return c.describe()


def wait_backends(dep, stages: int, drafts: int = 1, timeout: float = 180.0):
    """Until the router serves exactly this many healthy stage and draft replicas (a new
    replica's process loads torch and its model: 20-40 s were seen on a loaded 2-core
    machine)."""
    deadline = time.monotonic() + timeout
    while True:
        view = router_view(dep)
        up = [b for b in view.backends if b.healthy and not b.draining]
        kinds = [b.kind for b in up]
        if kinds.count("stage") == stages and kinds.count("draft") == drafts:
            return view
        assert time.monotonic() < deadline, view
        time.sleep(0.1)


def expected(dep, kw: dict) -> list[int]:
    """The in-process engine's tokens for the request (the target as its own draft)."""
    return _reference(
        dep.target,
        tuple(kw["prompt_ids"]),
        kw["mode"],
        kw["max_new_tokens"],
        kw.get("temperature", 0.0),
        kw.get("seed", 0),
    )


@functools.cache
def _reference(target, prompt, mode, n, temperature, seed) -> list[int]:
    return reference(target, "oracle", 2, list(prompt), mode, n, temperature=temperature, seed=seed)


class Streams:
    """The requests streamed at once from threads: every chunk's tokens and arrival
    time, the final completion or the error."""

    def __init__(self, address: str, requests: list[dict]) -> None:
        self.requests = requests
        self.tokens: list[list[int]] = [[] for _ in requests]
        self.times: list[list[float]] = [[] for _ in requests]
        self.done: list = [None] * len(requests)
        self.errors: list[SpecPipeError | None] = [None] * len(requests)
        self._threads = [
            threading.Thread(target=self._run, args=(address, i), daemon=True)
            for i in range(len(requests))
        ]
        for t in self._threads:
            t.start()

    def _run(self, address: str, i: int) -> None:
        try:
            with Client(address, timeout=180) as c:
                stream = c.stream(ignore_eos=True, **self.requests[i])
                for chunk in stream:
                    self.tokens[i].extend(chunk.token_ids)
                    self.times[i].append(time.monotonic())
                self.done[i] = stream.result()
        except SpecPipeError as e:
            self.errors[i] = e

    def wait_tokens(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while any(len(t) < n and self.done[i] is None for i, t in enumerate(self.tokens)):
            assert time.monotonic() < deadline, [len(t) for t in self.tokens]
            assert not any(self.errors), self.errors
            time.sleep(0.01)

    def join(self) -> None:
        for t in self._threads:
            t.join(timeout=240)

    def check_exact(self, dep) -> None:
        assert self.errors == [None] * len(self.requests)
        for kw, toks, done in zip(self.requests, self.tokens, self.done, strict=True):
            assert toks == done.token_ids  # the stream neither lost nor repeated a token
            assert toks == expected(dep, kw), kw
            assert done.finish_reason == "length"


def scrape(address: str) -> dict[str, float]:
    """`name{labels}` -> value of every sample a /metrics page serves."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def on_path(dep, kind_prefix: str) -> str:
    """A child named `kind_prefix`* that the router has requests on."""
    view = router_view(dep)
    busy = {b.address for b in view.backends if b.active_requests > 0}
    for name, child in dep.children.items():
        if name.startswith(kind_prefix) and child.info["address"] in busy:
            return name
    raise AssertionError(f"no {kind_prefix} with requests: {view}")


# -- tests ---------------------------------------------------------------------------------


def test_stage_replica_killed_while_requests_stream(elastic) -> None:
    """SIGKILL of one of the two replicas of stage 1 while four requests stream: every
    request completes with exactly its reference tokens (replayed on the other one)."""
    dep = elastic
    streams = Streams(dep.router_address, REQUESTS)
    streams.wait_tokens(3)
    victim = on_path(dep, "stage1")
    dep.kill(victim)
    streams.join()
    streams.check_exact(dep)
    replays = sum(d.stats["replays"] for d in streams.done)
    assert replays >= 1  # at least the requests on the killed replica were replayed
    dep.unlist(victim)
    wait_backends(dep, stages=2)


def test_draft_killed_mid_stream_specpipe_goes_on_exactly(elastic) -> None:
    dep = elastic
    specpipe = [r for r in REQUESTS if r["mode"] == "specpipe"]
    streams = Streams(dep.router_address, specpipe)
    streams.wait_tokens(3)
    dep.kill("draft")
    streams.join()
    streams.check_exact(dep)
    assert all(d.stats["draft_drops"] == 1 for d in streams.done)
    # pp needs no draft; specpipe without one runs as pp (it is still exact).
    with Client(dep.router_address, timeout=60) as c:
        kw = dict(prompt_ids=[5, 6, 7], max_new_tokens=12, ignore_eos=True)
        assert c.generate(mode="pp", **kw).token_ids == expected(dep, {**kw, "mode": "pp"})
        spec = c.generate(mode="specpipe", **kw)
        assert spec.token_ids == expected(dep, {**kw, "mode": "specpipe"})
    dep.unlist("draft")
    new = dep.add_draft(dep.draft, name="draft.1")  # another draft replica joins
    wait_backends(dep, stages=2, drafts=1)
    with Client(dep.router_address, timeout=60) as c:
        spec = c.generate(mode="specpipe", **kw)
    assert spec.token_ids == expected(dep, {**kw, "mode": "specpipe"})
    assert spec.stats["draft_drops"] == 0
    assert scrape(new.info["metrics"])["specpipe:draft_requests_total"] == 1


def test_replica_started_while_serving_is_found_and_takes_requests(elastic) -> None:
    """Another replica of stage 1, listed in the discovery file while the router serves:
    described, then taking new requests (least loaded first), outputs exact."""
    dep = elastic
    child = dep.add_stage(1, name="stage1.new")
    view = wait_backends(dep, stages=3)
    (new,) = [b for b in view.backends if b.address == child.info["address"]]
    assert new.layers == "2:5" and new.weight_hash  # described before it took traffic
    streams = Streams(dep.router_address, REQUESTS)
    streams.join()
    streams.check_exact(dep)
    served = scrape(child.info["metrics"])["specpipe:stage_requests_total"]
    assert served >= 1
    # Drained out of discovery: no new requests; it keeps (and finishes) what it has.
    dep.unlist("stage1.new")
    wait_backends(dep, stages=2)
    before = scrape(child.info["metrics"])["specpipe:stage_requests_total"]
    Streams(dep.router_address, REQUESTS[:2]).join()
    assert scrape(child.info["metrics"])["specpipe:stage_requests_total"] == before


def test_metrics_move_with_traffic(elastic) -> None:
    dep = elastic
    addrs = dep.metrics_addresses()
    stages = sorted(n for n in addrs if n.startswith("stage"))
    assert set(addrs) >= {"router", "stage0", "draft.1"} and len(stages) == 3  # one unlisted
    before = {name: scrape(a) for name, a in addrs.items()}
    router = before["router"]
    for name in (
        "specpipe:num_requests_running",
        "specpipe:num_requests_waiting",
        "specpipe:time_to_first_token_seconds_count",
        "specpipe:inter_token_latency_seconds_count",
        "specpipe:e2e_request_latency_seconds_count",
        "specpipe:generation_tokens_total",
        "specpipe:prompt_tokens_total",
        "specpipe:spec_verifications_total",
        "specpipe:spec_hits_total",
        "specpipe:spec_tokens_per_step_count",
        "specpipe:path_choice_seconds_count",
    ):
        assert name in router, name
    assert router["specpipe:router_backends{kind=stage,state=serving}"] == 2
    for stage in stages:
        for name in (
            "specpipe:stage_forward_seconds_count",
            "specpipe:stage_busy_ratio",
            "specpipe:stage_queued_rows",
            "specpipe:kv_cache_usage_perc",
            "specpipe:stage_requests_total",
        ):
            assert name in before[stage], (stage, name)
    assert "specpipe:draft_forward_seconds_count" in before["draft.1"]

    streams = Streams(dep.router_address, REQUESTS[:2])
    streams.join()
    streams.check_exact(dep)
    after = {name: scrape(a) for name, a in addrs.items()}
    r0, r1 = before["router"], after["router"]
    tokens = sum(len(t) for t in streams.tokens)
    assert r1["specpipe:generation_tokens_total"] - r0["specpipe:generation_tokens_total"] == tokens
    assert r1["specpipe:prompt_tokens_total"] - r0["specpipe:prompt_tokens_total"] == 8
    assert (
        r1["specpipe:time_to_first_token_seconds_count"]
        - r0["specpipe:time_to_first_token_seconds_count"]
        == 2
    )
    # Every specpipe step verifies; how many hit depends on the draft answering in time
    # (the target as its own draft is slow on a loaded machine, and late answers miss).
    verified = r1["specpipe:spec_verifications_total"] - r0["specpipe:spec_verifications_total"]
    hits = r1["specpipe:spec_hits_total"] - r0["specpipe:spec_hits_total"]
    assert verified > 0 and 0 <= hits <= verified
    depth1 = "specpipe:spec_hits_by_depth_total{depth=1}"
    assert 0 <= r1.get(depth1, 0) - r0.get(depth1, 0) <= hits
    assert r1["specpipe:request_success_total{finished_reason=length}"] >= 2
    s0, s1 = before["stage0"], after["stage0"]
    assert s1["specpipe:stage_forward_seconds_count"] > s0["specpipe:stage_forward_seconds_count"]
    assert s1["specpipe:stage_busy_ratio"] > 0
    d0, d1 = before["draft.1"], after["draft.1"]
    assert d1["specpipe:draft_forward_seconds_count"] > d0["specpipe:draft_forward_seconds_count"]
    # The control loop: the step's service overhead (stage 1, from the last stage's
    # verification to the next feed), the router's CPU per step, data-plane bytes.
    overhead = "specpipe:step_overhead_seconds_count"
    assert s1[overhead] > s0[overhead]
    assert s1["specpipe:step_overhead_seconds_sum"] >= s0["specpipe:step_overhead_seconds_sum"]
    cpu = "specpipe:router_step_cpu_seconds_count"
    assert 0 < r1[cpu] - r0[cpu] <= verified
    assert r1["specpipe:router_cpu_seconds_total"] > r0["specpipe:router_cpu_seconds_total"]
    got = "specpipe:dataplane_received_bytes_total"
    sent = "specpipe:dataplane_sent_bytes_total"
    for name in addrs:
        assert got in after[name] and sent in after[name], name
    assert after["draft.1"][got] > before["draft.1"][got]  # its calls as control frames
    assert s1[sent] > s0[sent]
    # The last stage sends the router verifications, not logits: a float64 logits row of
    # this model's 97-token vocabulary alone is 776 bytes, more than a verification and
    # the draft's answers of its step (control frames too, since the draft has a data
    # plane) come to.
    received = r1[got] - r0[got]
    assert 0 < received < 776 * verified


def test_prometheus_scrapes_every_service(elastic, tmp_path) -> None:
    """Debian's Prometheus server scraping the deployment on loopback (skipped where the
    binary is missing; the parser checks above always run)."""
    import json
    import shutil
    import subprocess

    from specpipe.services.launcher import free_port

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary (Debian: apt-get install prometheus)")
    addrs = elastic.metrics_addresses()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": name, "static_configs": [{"targets": [a]}]}
            for name, a in addrs.items()
        ],
    }))  # fmt: skip
    port = free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("wb"),
    )  # fmt: skip

    def api(path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/{path}", timeout=5) as r:
            return json.loads(r.read())["data"]

    try:
        Streams(elastic.router_address, REQUESTS[2:3]).join()
        deadline = time.monotonic() + 60
        while True:
            try:
                targets = api("targets")["activeTargets"]
                if len(targets) == len(addrs) and all(t["health"] == "up" for t in targets):
                    break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "Prometheus did not scrape every service"
            time.sleep(0.5)
        query = "specpipe:generation_tokens_total"
        deadline = time.monotonic() + 30
        while not (result := api(f"query?query={query}")["result"]):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert float(result[0]["value"][1]) > 0
        up = api("query?query=sum(specpipe:stage_requests_total)")["result"]
        assert float(up[0]["value"][1]) > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_sigstopped_stage_replica_is_dead_for_its_requests(elastic) -> None:
    """SIGSTOP of a stage replica a request runs on (issue 22, N14: the stream stalled
    7.5 s, until three health checks had timed out): the requests on it treat it as dead
    once it has answered nothing for the stall limit (2 s) and replay on the other
    replica, exactly; the router says it stalled. It takes requests again once it
    answers (SIGCONT)."""
    import signal

    dep = elastic
    up = [b for b in router_view(dep).backends if b.healthy and not b.draining]
    stages = sum(b.kind == "stage" for b in up)
    third = dep.add_stage(1, name="stage1.stopped")
    wait_backends(dep, stages=stages + 1)
    streams = Streams(dep.router_address, REQUESTS)
    streams.wait_tokens(3)
    victim = dep.children[on_path(dep, "stage1")]
    router_log = dep.children["router"].log_file
    os.kill(victim.proc.pid, signal.SIGSTOP)
    try:
        streams.join()
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    streams.check_exact(dep)
    assert sum(d.stats["replays"] for d in streams.done) >= 1
    assert f"{victim.info['address']} is stalled" in router_log.read_text()
    wait_backends(dep, stages=stages + 1)  # it answers again
    dep.unlist(third.name)
    wait_backends(dep, stages=stages)


def test_router_follows_kubernetes_endpoint_slices(tcp_deployment, tmp_path) -> None:
    """A router process with `--discovery kubernetes` (the official client, configured by
    a kubeconfig) against the in-test API server: it starts once the slices list a
    complete path, serves exactly, and follows a slice that goes away."""
    import json
    import subprocess
    import sys

    from ..fake_k8s import FakeApiServer, endpoint_slice
    from .test_services_failures import ENTRY

    dep = tcp_deployment

    def slice_of(name: str, component: str) -> dict:
        host, port = dep.children[name].info["grpc"].rsplit(":", 1)
        return endpoint_slice(f"specpipe-v1-{name}-x", component, [host], int(port))

    with FakeApiServer() as api:
        api.put(slice_of("stage0", "stage"))
        kubeconfig = tmp_path / "kubeconfig"
        api.kubeconfig(kubeconfig)
        ready = tmp_path / "router.ready"
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        with (tmp_path / "router.log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-c", ENTRY, "router", "--discovery", "kubernetes",
                 "--discovery-namespace", "specpipe", "--target", str(dep.target),
                 "--transport", "tcp", "--port", "0", "--data-port", "0",
                 "--ready-file", str(ready), "--insecure"],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        try:
            time.sleep(1.0)
            assert not ready.exists()  # stage 1 is not listed: no complete path yet
            api.put(slice_of("stage1", "stage"))
            api.put(slice_of("draft", "draft"))
            deadline = time.monotonic() + 60
            while not ready.is_file():
                assert proc.poll() is None, (tmp_path / "router.log").read_text()
                assert time.monotonic() < deadline
                time.sleep(0.05)
            address = json.loads(ready.read_text())["grpc"]
            kw = dict(prompt_ids=[3, 14, 15], mode="specpipe", max_new_tokens=16)
            with Client(address, timeout=60) as c:
                done = c.generate(ignore_eos=True, **kw)
                assert done.token_ids == expected(dep, kw)
                assert {b.kind for b in c.describe().backends} == {"stage", "draft"}
                api.delete("specpipe-v1-draft-x")  # the draft's Service lost its endpoint
                deadline = time.monotonic() + 20
                while any(b.kind == "draft" for b in c.describe().backends):
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                pp = c.generate(ignore_eos=True, **{**kw, "mode": "pp"})
                assert pp.token_ids == done.token_ids
            watches = [r for r in api.requests if r.get("watch") == "true"]
            assert watches and all(r["labelSelector"] for r in watches)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
