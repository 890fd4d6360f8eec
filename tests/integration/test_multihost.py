"""Several hosts, really (issue 35, point 7): router, draft and stages each in a network
namespace of its own with its own address on one private LAN (tests/integration/
netns_lab.py), under the secure default: mutual TLS with certificates naming the hosts'
addresses, `--peers` the LAN's range for the stages' next hops, the router finding the
replicas through its discovery file. Stage 1 has two replicas on two hosts.

Faults: a host's link taken down mid-request and brought back; a stage host partitioned
from the router but not from its neighbours; a router's host going silent mid-stream
(the SDK resumes on the router of another host). Every request completes exactly as the
in-process reference or fails with a clear error, within its deadline (none hangs).
Skipped, with the reason, where network namespaces cannot be made."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from specpipe.common.model.config import ModelConfig
from specpipe.services.security import Security, make_pki
from specpipe.v1 import dataplane_pb2

from specpipe.client import Client, ResumePolicy, SpecPipeError

from . import netns_lab
from .conftest import DTYPE, reference, service_stub

PROMPT = [7, 3, 19, 44, 2, 61, 5]
NEW = 48
STAGE_SECONDS = 0.02  # every stage forward (paced: the faults land mid-request)
DEADLINE = 45.0  # the client's: a request that would hang fails at it instead
HOSTS = ["router", "router2", "draft", "s0", "s1a", "s1b"]


@pytest.fixture(scope="module")
def lab(llama_dir: Path, tmp_path_factory) -> Iterator[netns_lab.Lab]:
    reason = netns_lab.skip_reason()
    if reason:
        pytest.skip(f"cannot make network namespaces here: {reason}")
    work = tmp_path_factory.mktemp("netns")
    lab = netns_lab.Lab(HOSTS, work)
    try:
        addresses = [h.address for h in lab.hosts.values()]
        tls = make_pki(work / "pki", hosts=addresses)
        costs = work / "flat.json"
        costs.write_text(json.dumps({"flat": {"stage": STAGE_SECONDS}}))
        common = dict(secure=True, tls_dir=str(tls), drain_seconds=2.0)
        model = dict(common, dtype=DTYPE, threads=1, max_cache_gib=0.25)
        layers = ModelConfig.from_dir(llama_dir).num_layers
        first = f"0:{layers // 2}"
        last = f"{layers // 2}:{layers}"
        for host, span in (("s0", first), ("s1a", last), ("s1b", last)):
            lab.start(host, "stage", netns_lab.stage_config(
                lab, host, llama_dir, span, emulate_costs=str(costs), **model))  # fmt: skip
        lab.start("draft", "draft", netns_lab.draft_config(lab, "draft", llama_dir, **model))
        found = work / "backends"
        found.write_text("".join(f"{s.kind} {s.address}\n" for s in lab.services))
        for host in ("router", "router2"):
            lab.start(host, "router", netns_lab.router_config(
                lab, host, found, target=str(llama_dir), replay_seconds=20.0,
                startup_timeout=120.0, **common))  # fmt: skip
        lab.wait_ready()
        lab.security = Security.load(tls)
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope="module")
def want(llama_dir: Path) -> list[int]:
    return reference(llama_dir, "oracle", 2, PROMPT, "specpipe", NEW)


def _router(lab, host: str = "router") -> str:
    return next(s.address for s in lab.services if s.host.name == host)


def _active(lab, hosts) -> dict[str, int]:
    """Requests each of `hosts` (stages) holds now (asked over mutual TLS)."""
    out = {}
    for svc in lab.services:
        if svc.host.name in hosts:
            ch, stub = service_stub(svc.address, "stage", lab.security)
            with ch:
                desc = stub.Describe(dataplane_pb2.DescribeRequest(), timeout=5)
            out[svc.host.name] = desc.active_requests
    return out


def _generate(lab, when_started=None, routers=("router",), resume=0, **kw):
    """Stream one request; `when_started()` is called once 5 tokens came. The client
    resumes on another router at most `resume` times (0: the router's own fault
    handling is under test)."""
    addresses = [_router(lab, r) for r in routers]
    policy = ResumePolicy(attempts=resume)
    with Client(addresses, timeout=DEADLINE, resume=policy, keepalive=1.0) as c:
        stream = c.stream(prompt_ids=PROMPT, max_new_tokens=NEW, ignore_eos=False, **kw)
        called = False
        for chunk in stream:
            if not called and chunk.index + len(chunk.token_ids) >= 5 and when_started:
                called = True
                when_started()
        return stream.result()


def test_requests_across_hosts_are_exact_under_mutual_tls(lab, want) -> None:
    for mode in ("specpipe", "pp"):
        done = _generate(lab, mode=mode)
        assert done.token_ids == want, mode
    # The stages answer only callers with the deployment's certificate.
    s0 = next(s for s in lab.services if s.host.name == "s0")
    with grpc.insecure_channel(s0.address) as ch:
        from specpipe.v1 import stage_pb2_grpc

        with pytest.raises(grpc.RpcError):
            stage_pb2_grpc.StageStub(ch).Describe(dataplane_pb2.DescribeRequest(), timeout=5)


def test_a_link_down_mid_request_and_back(lab, want) -> None:
    """Stage 0's host loses its link for 3 s mid-request: the router finds it stalled
    and, with no other replica of stage 0, waits for a path; the link comes back, the
    replica answers again and takes the request back (a fresh open), which completes
    exactly."""
    restore = threading.Timer(3.0, lab.link, ("s0", True))

    def cut() -> None:
        lab.link("s0", False)
        restore.start()

    t0 = time.monotonic()
    try:
        done = _outcome(lambda: _generate(lab, when_started=cut))
    finally:
        restore.join(10)
        lab.link("s0", True)
    assert time.monotonic() - t0 < DEADLINE + 5  # no hang
    assert done.token_ids == want
    assert done.stats["replays"] >= 1


def test_a_stage_host_partitioned_from_the_router_only(lab, want) -> None:
    """The last stage's host on the request's path can reach stage 0 (its neighbour)
    but not the router: the router replays the request on the other replica's host, and
    it completes exactly."""
    cut: list[str] = []
    last = ("s1a", "s1b")
    before = _active(lab, last)  # an earlier test's request may linger until its lease

    def partition() -> None:
        now = _active(lab, last)
        (host,) = [h for h in last if now[h] > before[h]]  # the one this request is on
        lab.partition(host, "router")
        cut.append(host)

    try:
        done = _outcome(lambda: _generate(lab, when_started=partition))
    finally:
        for host in cut:
            lab.partition(host, "router", on=False)
    assert done.token_ids == want
    assert done.stats["replays"] >= 1


def test_a_router_host_lost_mid_stream_resumes_on_another_host(lab, want) -> None:
    """The router's host goes silent mid-stream (its link down: no reset reaches the
    client): the SDK's keepalive notices within seconds and resumes the request on the
    router of another host from the tokens it has; the stream is one exact output."""
    try:
        done = _outcome(lambda: _generate(lab, lambda: lab.link("router", False),
                                          routers=("router", "router2"), resume=2))  # fmt: skip
    finally:
        lab.link("router", True)
    assert done.token_ids == want and done.resumes == 1


def _outcome(run):
    """The completion; a failure must be a clear error (a status and a message), which
    the test then reports as such."""
    try:
        return run()
    except SpecPipeError as e:
        assert e.message and e.code in (grpc.StatusCode.UNAVAILABLE,
                                        grpc.StatusCode.DEADLINE_EXCEEDED)  # fmt: skip
        pytest.fail(f"the request failed with a clear error, but did not complete: {e}")
