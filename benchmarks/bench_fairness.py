"""Attacks of issue 35 on who gets the router's slots and the prefix cache (F2, F3, F4),
for `bench_hardening.py --only fairness,cache,logprobs`; only public interfaces (and
options that main has too), so the same code measures the version before the fix and
after.

Each part starts a local deployment (2 stages over TCP, the target as its own draft, a
tiny random model with a character tokenizer, fp32, one thread a service, the HTTP API
on, two API keys: the attacker's `key-a` and the neighbour's `key-b`) and reports the
neighbour's latency during the attack against its quiet value and the peak RSS of every
service (sampled every 5 ms) above its resting RSS:

- `fairness` (F2): key a sends 21 streamed completions with n=16 and max_tokens 2000
  at once; then key b sends an 8-token completion, three times (each given up after
  60 s). With the router's defaults (64 running + 256 waiting) and with 8 + 8; and with
  8 + 8 and n=2 (a flood that fits a key's share there). Reported: the attacker's answers
  by status, what the router runs and queues, the neighbour's statuses and seconds.
- `cache` (F3): key a's request with a 2,000-character prefix, cold and again (first
  token only, max_tokens 1); key b's request with the same prefix (before: a hit,
  anyone can confirm a guessed prompt); then key b sends 20 other 2,000-character
  prefixes (the cache holds about 8) and key a's prefix is asked again (before:
  flushed).
- `logprobs` (F4): `echo` with `logprobs: 20` on an 8,000-character prompt (the
  context is 8,192), alone and three at once; request and response bytes, status,
  seconds; the neighbour meanwhile; and the same on 1,560 characters (2^15 entries, the
  largest a request may ask for since issue 35).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench_hardening import PeakRss, deployment, make_model

KEYS = ("key-a", "key-b")
CONTEXT = 8192 + 64


def post(address: str, body: dict, key: str, timeout: float = 300) -> tuple[object, float, int]:
    """(status, seconds, response bytes) of one completion (an error: status and code)."""
    req = urllib.request.Request(
        f"http://{address}/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            size = len(r.read())
            status: object = r.status
    except urllib.error.HTTPError as e:
        data = e.read()
        size, status = len(data), e.code
        with contextlib.suppress(ValueError, KeyError, TypeError):
            status = f"{e.code} {json.loads(data)['error']['code']}"
    except OSError as e:
        size, status = 0, type(e).__name__
    return status, round(time.monotonic() - t0, 3), size


def neighbour(address: str, timeout: float = 120) -> tuple[object, float, int]:
    body = {"prompt": "hello", "max_tokens": 8, "temperature": 0, "mode": "pp",
            "ignore_eos": True}  # fmt: skip
    return post(address, body, KEYS[1], timeout=timeout)


class ServicePeaks:
    """Peak RSS above resting of every service of a deployment while the block runs."""

    def __init__(self, dep) -> None:
        self.samplers = {n: PeakRss(c.proc.pid) for n, c in dep.children.items()}

    def __enter__(self) -> ServicePeaks:
        for s in self.samplers.values():
            s.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for s in self.samplers.values():
            s.__exit__(*exc)

    def report(self) -> dict[str, float]:
        return {n: round(s.increase_mb, 1) for n, s in self.samplers.items()}


def _start(tmp: Path, name: str, **kw):
    model = make_model(tmp / f"{name}-model", max_positions=CONTEXT)
    dep = deployment(model, tmp / f"logs-{name}", http_port=0, api_keys=KEYS, **kw)
    dep.start()
    return dep


def _describe(dep) -> dict:
    from specpipe.client import Client

    with Client(dep.router_address, timeout=30, api_key=KEYS[0]) as c:
        d = c.describe()
    return {"running": d.active_requests, "waiting": d.waiting_requests}


# -- F2 ------------------------------------------------------------------------------------------
def bench_fairness(tmp: Path) -> dict:
    out = {}
    small = {"max_running": 8, "max_waiting": 8}
    for label, scheduling, n in (
        ("defaults_64_256", None, 16), ("small_8_8", small, 16), ("small_8_8_n2", small, 2),
    ):  # fmt: skip
        kw = {"scheduling": scheduling} if scheduling else {}
        dep = _start(tmp, f"fair-{label}", **kw)
        try:
            out[label] = _flood(dep, n)
        finally:
            dep.stop()
    return out


def _flood(dep, n: int) -> dict:
    address = dep.http_address
    neighbour(address)  # warm
    quiet = [neighbour(address)[1] for _ in range(3)]
    stop = threading.Event()
    statuses: list = []

    def attacker(i: int) -> None:
        body = {"prompt": f"flood {i} " * 4, "n": n, "max_tokens": 2000, "stream": True,
                "ignore_eos": True, "temperature": 0.8, "seed": i, "mode": "pp"}  # fmt: skip
        req = urllib.request.Request(
            f"http://{address}/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[0]}"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                statuses.append(r.status)
                while not stop.is_set() and r.read(4096):
                    pass
        except urllib.error.HTTPError as e:
            statuses.append(e.code)
        except OSError as e:
            statuses.append(type(e).__name__)

    threads = [threading.Thread(target=attacker, args=(i,), daemon=True) for i in range(21)]
    with ServicePeaks(dep) as peaks:
        for t in threads:
            t.start()
        time.sleep(8.0)  # the flood's requests are in (or refused)
        state = _describe(dep)
        during = [neighbour(address, timeout=60) for _ in range(3)]
        stop.set()
    for t in threads:
        t.join(2.0)
    counts: dict[str, int] = {"no answer yet (queued)": len(threads) - len(statuses)}
    for s in list(statuses):
        counts[str(s)] = counts.get(str(s), 0) + 1
    return {
        "quiet_neighbour_s": quiet,
        "attacker_answers": counts,
        "router_during": state,
        "neighbour_during": [(str(s), secs) for s, secs, _ in during],
        "peak_increase_mb": peaks.report(),
    }


# -- F3 ------------------------------------------------------------------------------------------
PREFIX_CHARS = 2000


def _prefix(i: int) -> str:
    """A 2,000-character text of its own for each i (the character model's ids)."""
    import random

    rng = random.Random(i)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(PREFIX_CHARS))


def _first_token(address: str, key: str, prefix: str, tail: str) -> float:
    body = {"prompt": prefix + tail, "max_tokens": 1, "temperature": 0, "mode": "pp"}
    status, secs, _ = post(address, body, key)
    assert status == 200, status
    return secs


def bench_cache(tmp: Path) -> dict:
    # A cache of ~0.004 GiB a stage: about 8 such prefixes (256 bytes a token a stage).
    dep = _start(tmp, "cache", max_cache_gib=0.004)
    address = dep.http_address
    victim = _prefix(0)
    try:
        with ServicePeaks(dep) as peaks:
            out = {
                "victim_cold_s": _first_token(address, KEYS[0], victim, " one"),
                "victim_again_s": _first_token(address, KEYS[0], victim, " two"),
                "other_key_same_prefix_s": _first_token(address, KEYS[1], victim, " three"),
                "other_key_new_prefix_s": _first_token(address, KEYS[1], _prefix(999), " x"),
            }
            t0 = time.monotonic()
            for i in range(1, 21):
                _first_token(address, KEYS[1], _prefix(i), " x")
            out["flush_20_prefixes_s"] = round(time.monotonic() - t0, 2)
            out["victim_after_flush_s"] = _first_token(address, KEYS[0], victim, " four")
        out["peak_increase_mb"] = peaks.report()
    finally:
        dep.stop()
    return out


# -- F4 ------------------------------------------------------------------------------------------
def bench_logprobs(tmp: Path) -> dict:
    dep = _start(tmp, "logprobs")
    address = dep.http_address
    body = {"prompt": _prefix(7) * 4, "max_tokens": 1, "echo": True, "logprobs": 20,
            "temperature": 0, "mode": "pp"}  # fmt: skip
    request_bytes = len(json.dumps(body))
    out: dict = {"prompt_chars": len(body["prompt"]), "request_bytes": request_bytes}
    try:
        neighbour(address)
        out["quiet_neighbour_s"] = neighbour(address)[1]
        with ServicePeaks(dep) as peaks:
            status, secs, size = post(address, body, KEYS[0])
        out["alone"] = {"status": str(status), "seconds": secs, "response_bytes": size,
                        "peak_increase_mb": peaks.report()}  # fmt: skip
        results: list = [None] * 3

        def one(i: int) -> None:
            results[i] = post(address, body, KEYS[0])

        with ServicePeaks(dep) as peaks:
            attackers = [threading.Thread(target=one, args=(i,)) for i in range(3)]
            for t in attackers:
                t.start()
            time.sleep(0.3)
            during = neighbour(address)
            for t in attackers:
                t.join()
        at_cap = {**body, "prompt": body["prompt"][:1560]}  # 1,560 x 21 entries: the cap
        status, secs, size = post(address, at_cap, KEYS[0])
        out["at_cap_1560_chars"] = {"status": str(status), "seconds": secs,
                                    "request_bytes": len(json.dumps(at_cap)),
                                    "response_bytes": size}  # fmt: skip
        out["three_at_once"] = {
            "statuses": sorted(str(r[0]) for r in results),
            "response_bytes": [r[2] for r in results],
            "neighbour_s": during[1],
            "peak_increase_mb": peaks.report(),
        }
    finally:
        dep.stop()
    return out
