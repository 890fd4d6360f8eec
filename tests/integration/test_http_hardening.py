"""The router's public edge in a real deployment (issue 22, N2 and N10): a flood of
silent connections to the HTTP port holds a bounded number of the router's file
descriptors, /health and the gRPC API keep answering meanwhile, the silent connections
are closed after the header timeout, and request ids stay out of the log at INFO."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from specpipe.services.router.edge import DEFAULT_PER_CLIENT

from specpipe.client import Client

from .conftest import start

ATTACKER = "127.0.0.2"  # another loopback address: the flood's own client address
FLOOD = 400


@pytest.fixture(scope="module")
def dep(text_model_dir: Path) -> Iterator:
    d = start(text_model_dir, "oracle", 2, "tcp", http_port=0)
    try:
        yield d
    finally:
        d.stop()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def health(dep) -> tuple[int, dict]:
    with urllib.request.urlopen(f"http://{dep.http_address}/health", timeout=30) as r:
        return r.status, json.loads(r.read())


def test_a_flood_of_silent_connections_holds_few_descriptors(dep) -> None:
    router = dep.children["router"].proc.pid
    host, port = dep.http_address.rsplit(":", 1)
    before = open_fds(router)
    flood = []
    try:
        for _ in range(FLOOD):
            s = socket.socket()
            s.bind((ATTACKER, 0))
            s.connect((host, int(port)))
            flood.append(s)
        during = before
        for _ in range(20):  # while the router takes them in
            during = max(during, open_fds(router))
            time.sleep(0.05)
        # Every connection over the per-client cap is answered 503 and closed at once.
        refused = 0
        for s in flood:
            s.settimeout(0.1)
            with contextlib.suppress(TimeoutError):  # held (for now)
                refused += s.recv(64).startswith(b"HTTP/1.1 503")
        assert health(dep) == (200, {"status": "ok", "model": dep.target.name})
        with Client(dep.router_address, timeout=60) as c:
            assert len(c.generate(prompt_ids=[1, 2, 3], max_new_tokens=4, ignore_eos=True,
                                  mode="pp").token_ids) == 4  # fmt: skip
        # The held ones are closed after the header timeout, having said nothing.
        closed = 0
        for s in flood:
            s.settimeout(60)
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
            closed += 1
        after = open_fds(router)
    finally:
        for s in flood:
            s.close()
    assert refused >= FLOOD - DEFAULT_PER_CLIENT
    assert during - before <= DEFAULT_PER_CLIENT + 8  # not one per connection
    assert closed == FLOOD and after - before <= 8


def test_request_ids_are_not_logged_at_info(dep) -> None:
    with Client(dep.router_address, timeout=60) as c:
        done = c.generate(prompt_ids=[5, 6, 7], max_new_tokens=3, ignore_eos=True)
    assert done.request_id
    time.sleep(0.5)  # the router's log lines of the request are written
    assert done.request_id not in dep.children["router"].log_file.read_text(errors="replace")
