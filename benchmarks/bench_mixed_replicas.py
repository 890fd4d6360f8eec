"""A mixed replica set on this machine: two replicas of the same layers, one emulating a
device 2.5x as fast as the other (`--emulate-costs`, flat accelerator-like costs), behind
one router. With `--measure-costs` each publishes its (emulated) cost curve in Describe
and the router prefers the faster replica where that is quicker (services/router/
backends.py, `pick`); without, load alone decides. Per variant and client count: tokens
per second, the time between tokens, and the share of in-flight requests each replica
held (the router's Describe, sampled every 20 ms).

    .venv/bin/python benchmarks/bench_mixed_replicas.py [--clients 1,8] [--json OUT]

Measured on the 2-core development machine while other jobs ran (defaults: fast 10 ms,
slow 25 ms a forward, 48 tokens, 6 requests a client; two runs): with cost curves the
fast replica held 100% of the in-flight requests at 1 and 8 clients, against 37-45%
by load alone; tokens/s at 8 clients 201 and 112 against 139 and 40 by load alone in
the same runs (at 1 client 27.6 and 26.3 against 30.0 and 22.7: there the real work of
a token on this loaded machine, about 30 ms, exceeds both emulated forwards, so the
emulated speeds do not show). The contention makes single figures vary by 2x between
runs: compare variants within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_emulated import stream_all  # noqa: E402
from bench_serve import make_model  # noqa: E402

LAYERS = 4


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def spawn(argv: list[str], ready: Path, log_file: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specpipe.cli", *argv, "--insecure", "--ready-file", str(ready)]
    return subprocess.Popen(cmd, stdout=log_file.open("wb"), stderr=subprocess.STDOUT)


def wait_ready(procs: list[tuple[subprocess.Popen, Path]], timeout: float = 300) -> list[dict]:
    deadline = time.monotonic() + timeout
    out = []
    for proc, ready in procs:
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{ready.name}: the process did not get ready")
            time.sleep(0.1)
        out.append(json.loads(ready.read_text()))
    return out


def run_variant(target: Path, work: Path, speeds: dict[str, float], curves: bool, args):
    """Two stage replicas (0:LAYERS) paced at `speeds` seconds a forward and a router;
    every client count's results."""
    work.mkdir(parents=True)
    procs = []
    for name, seconds in speeds.items():
        cost = work / f"{name}.costs.json"
        cost.write_text(json.dumps({"flat": {"stage": seconds}}))
        argv = ["stage", "--model", str(target), "--layers", f"0:{LAYERS}", "--port", "0"]
        argv += ["--data-port", "0", "--threads", "1", "--emulate-costs", str(cost)]
        argv += ["--measure-costs"] if curves else []
        ready = work / f"{name}.ready"
        procs.append((spawn(argv, ready, work / f"{name}.log"), ready))
    try:
        stages = wait_ready(procs)
        addresses = {s["grpc"]: name for s, name in zip(stages, speeds, strict=True)}
        discovery = work / "backends"
        discovery.write_text("".join(f"stage {a}\n" for a in addresses))
        ready = work / "router.ready"
        argv = ["router", "--discovery", f"file:{discovery}", "--target", str(target)]
        argv += ["--port", "0", "--data-port", "0"]
        router = spawn(argv, ready, work / "router.log")
        procs.append((router, ready))
        (info,) = wait_ready([(router, ready)])
        return [measure(info["grpc"], addresses, c, args) for c in args.clients]
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def measure(router: str, addresses: dict[str, str], clients: int, args) -> dict:
    """Closed loop of `clients`, pp requests; in-flight requests per replica sampled."""
    from specpipe.client import Client

    held = {name: 0 for name in addresses.values()}
    stop = threading.Event()

    def sample() -> None:
        with Client(router, timeout=30) as c:
            while not stop.is_set():
                for b in c.describe().backends:
                    if b.address in addresses:
                        held[addresses[b.address]] += b.active_requests
                time.sleep(0.02)

    prompts = [[5 + i % 50, 7, 11] for i in range(args.requests_per_client * clients)]
    kwargs = dict(mode="pp", max_new_tokens=args.tokens, ignore_eos=True)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    results, _, wall = asyncio.run(stream_all(router, prompts, clients, kwargs))
    stop.set()
    sampler.join()
    tokens = sum(r.output_tokens for r in results)
    tbt = [
        (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
        for r in results
        if len(r.token_times) > 1
    ]
    total = sum(held.values()) or 1
    return {
        "clients": clients,
        "tokens_per_s": round(tokens / wall, 1),
        "tbt_ms": round(1e3 * statistics.mean(tbt), 2),
        "in_flight_share": {k: round(v / total, 3) for k, v in held.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,8", help="client counts (closed loop)")
    ap.add_argument("--fast-ms", type=float, default=10.0, help="the fast replica's forward")
    ap.add_argument("--slowdown", type=float, default=2.5, help="the slow one's, x fast")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per request")
    ap.add_argument("--requests-per-client", type=int, default=6)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-mixed-"))
    target = make_model(work, LAYERS, 64, 256)
    speeds = {"fast": args.fast_ms / 1e3, "slow": args.slowdown * args.fast_ms / 1e3}
    out = {"speeds_s": speeds, "tokens": args.tokens, "variants": {}}
    for name, curves in (("load only", False), ("cost curves", True)):
        log(f"{name} ...")
        out["variants"][name] = run_variant(target, work / name.replace(" ", "-"), speeds,
                                            curves, args)  # fmt: skip
        log(json.dumps(out["variants"][name]))
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
