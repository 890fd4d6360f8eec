"""Attacks on the router's public edge (issue 22: N2, N6, N11, N12, N13), for
`bench_hardening.py --only edge`; only public interfaces, so the same code measures the
version before the fix and after.

One local deployment (2 stages over TCP, the target as its own draft, a tiny random
model with a character tokenizer and a 32768-token context, the HTTP API and metrics
ports on). Each attack reports what the router's process spent (open file descriptors,
threads, peak RSS above resting), the time until the attack's connections or requests
were refused or closed, and a neighbour's latency (a 2-token HTTP chat, or an 8-token
gRPC request) during the attack against its quiet value:

- `silent_flood`: FLOOD connections to the HTTP port that send nothing, from 40
  loopback addresses; /health's and the neighbour's latency meanwhile; how many are
  still open 15 s later; how much the router's log grew.
- `tokenize`: 8 chat bodies of 4 MB at once (a million 4-byte characters each: just
  under the context's character bound, so each is tokenized); their statuses and the
  time until the last was answered.
- `metrics_idle`: 300 idle connections to the router's metrics port, from 40 addresses;
  a scrape meanwhile, and how long until one is answered.
- `statuses`: out-of-range integers and a lone surrogate (want 400), priority 2^31-1
  without a key (want 403).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench_hardening import PeakRss, deployment, make_model

FLOOD = 4000
SOURCES = [f"127.0.0.{i}" for i in range(2, 42)]
CONTEXT = 32768


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln for ln in f if ln.startswith("Threads:")).split()[1])


def http(address: str, path: str, body: bytes | dict | None = None, timeout: float = 120):
    """(status, seconds) of one request (an error's status with its code)."""
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{address}{path}", data=data,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
        with contextlib.suppress(ValueError, OSError, KeyError, TypeError):
            status = f"{e.code} {json.loads(e.read())['error']['code']}"
    except OSError as e:
        status = type(e).__name__
    return status, round(time.monotonic() - t0, 3)


def neighbour(address: str) -> tuple[object, float]:
    return http(address, "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                 "temperature": 0, "mode": "pp"})  # fmt: skip


def grpc_neighbour(router: str) -> float:
    from specpipe.client import Client

    t0 = time.monotonic()
    with Client(router, timeout=120) as c:
        c.generate(prompt_ids=[1, 2, 3], max_new_tokens=8, ignore_eos=True, mode="pp")
    return round(time.monotonic() - t0, 3)


def bench_edge(tmp: Path) -> dict:
    model = make_model(tmp / "edge-model", max_positions=CONTEXT)
    dep = deployment(model, tmp / "logs-edge", http_port=0, metrics=True)
    dep.start()
    out: dict = {}
    try:
        router = dep.children["router"]
        pid = router.proc.pid
        neighbour(dep.http_address)  # warm
        out["quiet"] = {"neighbour_http_s": neighbour(dep.http_address)[1],
                        "neighbour_grpc_s": grpc_neighbour(dep.router_address)}  # fmt: skip
        out["silent_flood"] = silent_flood(dep, pid, router.log_file)
        out["tokenize"] = tokenize(dep, pid)
        out["metrics_idle"] = metrics_idle(dep, pid)
        out["statuses"] = statuses(dep)
        out["router_alive"] = router.proc.poll() is None
    finally:
        dep.stop()
    return out


def silent_flood(dep, pid: int, log_file: Path) -> dict:
    host, port = dep.http_address.rsplit(":", 1)
    fds0, log0 = open_fds(pid), log_file.stat().st_size
    conns: list[socket.socket] = []
    peak = [fds0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                peak[0] = max(peak[0], open_fds(pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    failed = 0
    for i in range(FLOOD):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.bind((SOURCES[i % len(SOURCES)], 0))
            with contextlib.suppress(BlockingIOError):
                s.connect((host, int(port)))
            conns.append(s)
        except OSError:
            failed += 1
            s.close()
    opened_s = time.monotonic() - t0
    time.sleep(1.0)
    health = http(dep.http_address, "/health", timeout=60)
    during = neighbour(dep.http_address)
    during_grpc = grpc_neighbour(dep.router_address)
    time.sleep(15.0)
    still_open = 0  # nothing to read and not closed (a 503 or the end: answered)
    for s in conns:
        try:
            s.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            still_open += 1
        except OSError:
            pass
    stop.set()
    sampler.join()
    for s in conns:
        s.close()
    return {
        "connections": FLOOD - failed,
        "open_seconds": round(opened_s, 2),
        "router_fds_rest": fds0,
        "router_fds_peak": peak[0],
        "health_status_s": health,
        "neighbour_http_s": during,
        "neighbour_grpc_s": during_grpc,
        "still_open_after_15s": still_open,
        "router_log_growth_kb": round((log_file.stat().st_size - log0) / 1024, 1),
    }


def tokenize(dep, pid: int) -> dict:
    content = "\U0001f600" * (CONTEXT * 32 - 1000)  # 4 bytes each in UTF-8
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2},
                      ensure_ascii=False).encode()  # fmt: skip
    results: list = [None] * 8
    t0 = time.monotonic()

    def one(i: int) -> None:
        results[i] = http(dep.http_address, "/v1/chat/completions", body, timeout=300)

    with PeakRss(pid) as mem:
        attackers = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in attackers:
            t.start()
        time.sleep(0.5)
        during = neighbour(dep.http_address)
        for t in attackers:
            t.join()
        total = time.monotonic() - t0
    return {
        "body_mb": round(len(body) / (1 << 20), 2),
        "statuses": sorted(str(r[0]) for r in results),
        "first_answer_s": min(r[1] for r in results),
        "last_answer_s": round(total, 3),
        "router_peak_increase_mb": round(mem.increase_mb, 1),
        "neighbour_http_s": during,
    }


def metrics_idle(dep, pid: int) -> dict:
    host, port = dep.children["router"].info["metrics"].rsplit(":", 1)
    before = threads(pid)
    conns = []
    for i in range(300):
        s = socket.socket()
        s.bind((SOURCES[i % len(SOURCES)], 0))
        s.connect((host, int(port)))
        conns.append(s)
    time.sleep(1.0)
    held = threads(pid) - before
    scrape = http(f"{host}:{port}", "/metrics", timeout=60)
    t0, answered = time.monotonic(), scrape
    while answered[0] != 200 and time.monotonic() - t0 < 60:  # once the idle ones time out
        time.sleep(0.2)
        answered = http(f"{host}:{port}", "/metrics", timeout=60)
    for s in conns:
        s.close()
    return {"router_threads_rest": before, "extra_threads": held, "scrape_status_s": scrape,
            "scraped_again_after_s": round(time.monotonic() - t0, 3)}  # fmt: skip


def statuses(dep) -> dict:
    base = {"prompt": [1, 2, 3], "mode": "pp", "max_tokens": 2}
    cases = {
        "max_tokens_2^63": {**base, "max_tokens": 2**63},
        "seed_2^64": {**base, "seed": 2**64},
        "stop_token_ids_2^63": {**base, "stop_token_ids": [2**63]},
        "priority_2^31": {**base, "priority": 2**31},
        "priority_2^31-1": {**base, "priority": 2**31 - 1},
    }
    out = {name: http(dep.http_address, "/v1/completions", body)[0]
           for name, body in cases.items()}  # fmt: skip
    surrogate = b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'
    out["lone_surrogate"] = http(dep.http_address, "/v1/chat/completions", surrogate)[0]
    return out
