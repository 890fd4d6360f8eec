"""Benchmark of the elastic deployment (not a test): local multi-process deployments of
tiny random models (the launcher behind `specpipe up`), under a steady load of clients.

1. Join: time from a stage replica's process start to its first request, split into
   start -> serving (process start, model load), serving -> described by the router
   (discovery file poll + Describe), described -> first request.
2. Kill: a replica of a two-replica stage SIGKILLed while requests stream: the stall the
   affected clients see (largest gap between two tokens of a request on the killed
   replica, and the median gap of all requests beside it), requests lost (must be 0),
   outputs checked against the in-process engine.
3. Draft kill: the draft SIGKILLed while specpipe requests stream: requests lost, stall.
4. Router overhead: the path choice per request (the router's own histogram, and
   `Backends.path` in process over 4 stages x 8 replicas and 4 drafts), and the CPU the
   router spends following discovery and health with no request open.

    python benchmarks/bench_elastic.py [--kills 3] [--out benchmarks/results/elastic.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def scrape(address: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels}  # fmt: skip


class Load:
    """`clients` threads streaming requests one after another; per request its tokens,
    arrival times, the weight hash, the router's request id, or the error."""

    def __init__(self, address: str, clients: int, requests: list[dict]) -> None:
        self.address, self.requests = address, requests
        self.results: list[dict] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(clients)]  # fmt: skip
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        from specpipe.client import Client, SpecPipeError

        k = i
        with Client(self.address, timeout=300) as c:
            while not self._stop.is_set():
                kw = self.requests[k % len(self.requests)]
                k += 1
                rec = {"kw": kw, "times": [], "tokens": [], "sent": time.monotonic()}
                try:
                    stream = c.stream(ignore_eos=True, **kw)
                    for chunk in stream:
                        rec["tokens"] += chunk.token_ids
                        rec["times"].append(time.monotonic())
                    done = stream.result()
                    rec["stats"] = done.stats
                except SpecPipeError as e:
                    rec["error"] = f"{e.code_name}: {e.message}"
                with self._lock:
                    self.results.append(rec)

    def done(self) -> int:
        with self._lock:
            return len(self.results)

    def stop(self) -> list[dict]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)
        return self.results


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def router_view(address: str):
    from specpipe.client import Client

    with Client(address, timeout=10) as c:
        return c.describe()


def check(results: list[dict], target: Path, cache: dict) -> int:
    """Requests whose tokens differ from the in-process engine's (must be 0)."""
    from tests.integration.conftest import reference

    wrong = 0
    for r in results:
        if "error" in r:
            continue
        kw = r["kw"]
        key = (tuple(kw["prompt_ids"]), kw["mode"], kw["max_new_tokens"], kw.get("temperature", 0))
        if key not in cache:
            cache[key] = reference(target, "oracle", 2, kw["prompt_ids"], kw["mode"],
                                   kw["max_new_tokens"], temperature=kw.get("temperature", 0.0),
                                   seed=kw.get("seed", 0))  # fmt: skip
        wrong += r["tokens"] != cache[key]
    return wrong


REQUESTS = [
    dict(prompt_ids=[3, 14, 15], mode="specpipe", max_new_tokens=48),
    dict(prompt_ids=[9, 2, 6, 5], mode="specpipe", max_new_tokens=48, temperature=0.9, seed=7),
    dict(prompt_ids=[27, 18], mode="pp", max_new_tokens=24),
    dict(prompt_ids=[31, 41, 59], mode="specinfer", max_new_tokens=48),
]


def measure_join(dep, load: Load) -> dict:
    child = dep.add_stage(1, name=f"stage1.join{len(dep.children)}", wait=False)
    t0 = child.started_at
    address = child.info["address"]
    t_ready = t_described = t_first = None
    deadline = time.monotonic() + 180
    while t_first is None and time.monotonic() < deadline:
        now = time.monotonic()
        if t_ready is None and child.ready_file.is_file():
            t_ready = now
            child.info.update(json.loads(child.ready_file.read_text()))
        if t_ready is not None:
            view = router_view(dep.router_address)
            (b,) = [b for b in view.backends if b.address == address] or [None]
            if t_described is None and b is not None and b.healthy:
                t_described = now
            if b is not None and b.active_requests > 0:
                t_first = now
        time.sleep(0.02)
    return {
        "start_to_serving_s": round(t_ready - t0, 3),
        "serving_to_described_s": round(t_described - t_ready, 3),
        "described_to_first_request_s": round(t_first - t_described, 3),
        "start_to_first_request_s": round(t_first - t0, 3),
    }


def measure_kill(dep, load: Load, prefix: str) -> dict:
    """SIGKILL a `prefix`* child that has requests now; the stall of its requests."""
    view = router_view(dep.router_address)
    busy = {b.address for b in view.backends if b.active_requests > 0}
    victims = [n for n, c in dep.children.items() if n.startswith(prefix)
               and c.info.get("address") in busy and c.proc.poll() is None]  # fmt: skip
    if not victims:
        return {}
    name = victims[0]
    before = load.done()
    t_kill = time.monotonic()
    dep.kill(name)
    dep.unlist(name)
    time.sleep(4.0)
    while load.done() < before + 8:
        time.sleep(0.05)
    affected = [r for r in load.results[before:] if r["times"] and r["sent"] < t_kill
                and r["times"][-1] > t_kill]  # fmt: skip
    stalls = []
    for r in affected:
        ts = r["times"]
        around = [b - a for a, b in itertools.pairwise(ts) if a <= t_kill + 5 and b >= t_kill]
        stalls.append(max(around, default=0.0))
    normal = [g for r in load.results[before:] for g in gaps(r["times"]) if g < 1.0]
    return {
        "killed": name,
        "requests_in_flight": len(affected),
        "replayed": sum(1 for r in affected if r.get("stats", {}).get("replays", 0)),
        "draft_drops": sum(1 for r in affected if r.get("stats", {}).get("draft_drops", 0)),
        "stall_max_s": round(max(stalls, default=0.0), 3),
        "stall_median_s": round(statistics.median(stalls), 3) if stalls else 0.0,
        "median_token_gap_s": round(statistics.median(normal), 4) if normal else 0.0,
    }


def path_choice_in_process(stages: int = 4, replicas: int = 8, drafts: int = 4) -> dict:
    import asyncio
    from types import SimpleNamespace

    from specpipe.services.router.backends import Backend, Backends
    from specpipe.services.router.discovery import Endpoint, StaticDiscovery

    async def main() -> dict:
        bs = Backends(StaticDiscovery([]), lambda b, e: None, lambda r: None)
        layers = 32
        for k in range(stages):
            for r in range(replicas):
                desc = SimpleNamespace(
                    model_id="m", weight_hash="v1", layer_start=k * layers // stages,
                    layer_end=(k + 1) * layers // stages, num_layers=layers, vocab_size=97,
                    max_position_embeddings=4096, eos_token_ids=[1], data_address="tcp://h:1",
                    cache_bytes_used=r, cache_bytes_limit=1 << 30, active_requests=r,
                )  # fmt: skip
                ep = Endpoint("stage", f"s{k}-{r}:1")
                bs.by_key[ep.key] = Backend(
                    "stage", ep.address, None, None, None, ep, desc, True, ""
                )
        for d in range(drafts):
            desc = SimpleNamespace(model_id="d", weight_hash="dv", vocab_size=97, active_requests=d,
                                   cache_bytes_used=0, cache_bytes_limit=0)  # fmt: skip
            ep = Endpoint("draft", f"d{d}:1")
            bs.by_key[ep.key] = Backend("draft", ep.address, None, None, None, ep, desc, True, "")
        bs._recompute()
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            path = bs.path()
            bs.acquire(path)
            bs.release(path.backends)
        per = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for _ in range(200):
            bs._recompute()
        return {"backends": stages * replicas + drafts, "path_choice_us": round(per * 1e6, 1),
                "recompute_us": round((time.perf_counter() - t0) / 200 * 1e6, 1)}  # fmt: skip

    return asyncio.run(main())


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=3, help="replica kills (each replaced)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--out", default=str(HERE / "results" / "elastic.json"))
    args = ap.parse_args()

    import torch
    from specpipe.services.launcher import ServicesDeployment

    from tests.conftest import make_tiny_model

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    target = make_tiny_model(root / "target", "llama", layers=5, seed=0)
    out: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                             "load_avg_start": os.getloadavg()}}  # fmt: skip
    cache: dict = {}
    dep = ServicesDeployment(target, "oracle", 2, threads=1, dtype="float64", metrics=True,
                             stage_replicas=[1, 2], replay_seconds=10.0)  # fmt: skip
    dep.start()
    try:
        router = dep.children["router"]
        # Idle: what following discovery and health costs the router.
        c0, t0 = cpu_seconds(router.proc.pid), time.monotonic()
        time.sleep(10.0)
        idle = (cpu_seconds(router.proc.pid) - c0) / (time.monotonic() - t0)
        out["router_idle_cpu_share"] = round(idle, 4)
        out["router_idle_backends"] = len(router_view(dep.router_address).backends)

        load = Load(dep.router_address, args.clients, REQUESTS)
        while load.done() < 8:
            time.sleep(0.1)
        out["join"] = [measure_join(dep, load)]
        kills = []
        for _ in range(args.kills):
            time.sleep(1.0)
            k = measure_kill(dep, load, "stage1")
            if k:
                kills.append(k)
            out["join"].append(measure_join(dep, load))  # back to two replicas
        out["stage_kills"] = kills
        time.sleep(1.0)
        out["draft_kill"] = measure_kill(dep, load, "draft")
        results = load.stop()
        metrics = scrape(dep.metrics_addresses()["router"])
        n = metrics.get("specpipe:path_choice_seconds_count", 0)
        out["router_path_choice_us"] = round(
            metrics.get("specpipe:path_choice_seconds_sum", 0) / n * 1e6, 1) if n else None  # fmt: skip
        out["requests"] = len(results)
        out["requests_lost"] = sum(1 for r in results if "error" in r)
        out["errors"] = [r["error"] for r in results if "error" in r][:5]
        out["requests_wrong"] = check(results, target, cache)
    finally:
        dep.stop()
    out["path_choice_in_process"] = path_choice_in_process()
    out["machine"]["load_avg_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if out["requests_lost"] == 0 and out["requests_wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
