"""Measurements of issue 13 ("Hardening"), not a test: what oversized inputs cost the
services, how long a killed router's requests stay on the stages, and what frame
authentication costs per hop.

1. `oversize`: a local deployment (`specpipe up`'s launcher, 2 stages over TCP, the
   target as its own draft, a tiny random model with a character tokenizer). Against
   the router's public port: a 47 MB text prompt, a 47 MB token-id prompt, and four
   47 MB text prompts at once: the status, the time until the refusal and the router's
   peak memory above its resting memory (RSS sampled every 5 ms). Against the stages
   and the draft directly (the deployment started without --secure, so these measure
   the input bounds, not the refusal of unauthenticated calls): a 57 MB `Feed` on an
   open request, and a draft `Open` with a 6000-token prompt; for each, the time until
   refused and the slowest health check of that service meanwhile (checked every 20 ms).
2. `lease`: a request runs, the router is killed with SIGKILL; the time until every
   stage and the draft hold no request (polling Describe), then the same with a router
   restarted on the same port (it frees its predecessor's requests at once).
3. `frame`: one process, two transports on loopback TCP: frames of 6, 96 and 384 KiB sent
   one after another and waited for at the receiver; the mean time per frame, plaintext
   and with per-frame HMAC (the `--secure` data plane).

4. `edge` (issue 22; benchmarks/bench_edge.py): silent connections to the router's HTTP
   port, 4 MB chat bodies at once, idle connections to its metrics port, malformed
   fields: descriptors, threads and memory of the router, time to refuse, a neighbour's
   latency.
5. `f1` (issue 35, F1: one long prompt within the context): a deployment as in 1 with a
   context of 32,768 tokens; one 2,048-token prompt (the stages learn what prefill costs
   them); a neighbour decoding all along (200-token requests, one after another): its
   time per token alone (quiet), then while one prompt of each length in `--f1-lengths`
   (2 new tokens) is prefilled, one after another: the long request's status and
   seconds; the neighbour's time per token (the window over its tokens in it), longest
   wait for a delta and first-token time of its requests started then; the peak RSS
   above resting of every service (router, stages, draft) and whether each is alive;
   then the prompts of `--f1-alone` with no neighbour (32,000 tokens: the one that took
   a stage down), for memory and liveness.
   The goal: every service alive, the neighbour's time between tokens within 2x quiet.
   `BENCH_REPO=<checkout>` runs it against another checkout's code (the "before").

6. `fairness`, `cache`, `logprobs` (issue 35: F2, F3, F4; benchmarks/bench_fairness.py):
   one API key floods the queues with n=16 requests, probes and flushes another key's
   cached prefix, and asks for 5 MB of echoed prompt logprobs; the neighbour's latency
   and every service's peak memory.

One module: the parts share its deployment, probes (peak RSS, health) and output.
Prints a summary and writes JSON (`--out`). Run from the repository root:

    python benchmarks/bench_hardening.py [--only oversize,lease,frame,edge,f1,fairness,
        cache,logprobs] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

# The checkout whose tests/ make the models (BENCH_REPO: another one, for a "before").
REPO = Path(os.environ.get("BENCH_REPO") or Path(__file__).resolve().parent.parent)
sys.path.insert(0, str(REPO))  # tests/ for the tiny models

MB = 1 << 20


# -- helpers -------------------------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Peak RSS of a process while the block runs, sampled in a thread."""

    def __init__(self, pid: int, every: float = 0.005) -> None:
        self.pid, self.every = pid, every
        self.base = self.peak = rss_bytes(pid)
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(self.every)

    def __enter__(self) -> PeakRss:
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()

    @property
    def increase_mb(self) -> float:
        return (self.peak - self.base) / MB


class HealthProbe:
    """The slowest grpc.health.v1 check of one address while the block runs."""

    def __init__(self, address: str, every: float = 0.02) -> None:
        self.address, self.every = address, every
        self.worst = 0.0
        self.failures = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
                except grpc.RpcError:
                    self.failures += 1
                self.worst = max(self.worst, time.monotonic() - t0)
                time.sleep(self.every)

    def __enter__(self) -> HealthProbe:
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def timed_call(fn) -> tuple[str, float, str]:
    """(status name, seconds, details) of one call that is expected to fail."""
    t0 = time.monotonic()
    try:
        fn()
        code, details = "OK", ""
    except grpc.RpcError as e:
        code, details = e.code().name, (e.details() or "")[:160]
    except Exception as e:  # the SDK's typed errors
        code, details = getattr(e, "code_name", type(e).__name__), str(e)[:160]
    return code, time.monotonic() - t0, details


def make_model(root: Path, max_positions: int = 512) -> Path:
    from tests.conftest import make_tiny_model
    from tests.integration.conftest import add_char_tokenizer

    d = make_tiny_model(root / "target", "llama", layers=4, seed=0)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = max_positions
    (d / "config.json").write_text(json.dumps(cfg))
    return add_char_tokenizer(d)


def deployment(model: Path, log_dir: Path, **extra):
    from specpipe.services.launcher import ServicesDeployment

    # Plaintext: these attacks call stages and the draft without credentials.
    kw = dict(transport="tcp", threads=1, log_dir=log_dir, dtype="float32", drain_seconds=2,
              secure=False)  # fmt: skip
    for k, v in extra.items():
        kw[k] = v
    try:
        return ServicesDeployment(model, "oracle", 2, **kw)
    except TypeError as e:  # an option this version does not have
        raise SystemExit(f"this version has no {e}") from None


# -- 5. one long prompt (issue 35, F1) ---------------------------------------------------------
def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else 0.0


def _long_prompt(n: int) -> list[int]:
    """n token ids; prompts of other lengths share no prefix (no prefix cache hit)."""
    return [(7 * i + n) % 90 + 1 for i in range(n)]


class _Neighbour(threading.Thread):
    """A client decoding all along: 200-token requests one after another, each delta's
    arrival time and token count recorded (by request)."""

    def __init__(self, client, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.client, self.prompt = client, prompt
        self.stop = threading.Event()
        self.requests: list[tuple[float, list[tuple[float, int]]]] = []  # (start, deltas)
        self.failed = 0

    def run(self) -> None:
        while not self.stop.is_set():
            deltas: list[tuple[float, int]] = []
            self.requests.append((time.monotonic(), deltas))
            try:
                for chunk in self.client.stream(prompt_ids=self.prompt, max_new_tokens=200):
                    deltas.append((time.monotonic(), len(chunk.token_ids)))
            except Exception:  # its status: counted as failed
                self.failed += 1
                time.sleep(0.5)

    def window(self, a: float, b: float) -> dict:
        """Its decoding between a and b: mean seconds per token (the window over the
        tokens that came in it), the longest wait for a delta within a request, the
        first-token times of the requests it started in the window."""
        tokens, gaps, firsts = 0, [0.0], []
        for start, deltas in list(self.requests):
            if a <= start <= b and deltas:
                firsts.append(deltas[0][0] - start)
            prev = max(start, a)
            for t, n in list(deltas):
                if a <= t <= b:
                    tokens += n
                    gaps.append(t - prev)
                prev = t
        return {
            "between_tokens_s": round((b - a) / max(tokens, 1), 4),
            "tokens": tokens,
            "longest_wait_s": round(max(gaps), 3),
            "first_token_s_median": round(_median(firsts), 3) if firsts else None,
        }


def _long_request(client, procs: dict, n: int) -> dict:
    """One prompt of n tokens (2 new): status, seconds, every service's peak RSS above
    resting and whether it is alive after."""
    mems = {k: PeakRss(p.pid, every=0.02) for k, p in procs.items() if p.poll() is None}
    for m in mems.values():
        m.__enter__()
    code, secs, why = timed_call(
        lambda: client.generate(prompt_ids=_long_prompt(n), max_new_tokens=2)
    )
    for m in mems.values():
        m.__exit__()
    return {
        "status": code, "seconds": round(secs, 2), "details": why[:120],
        "peak_rss_increase_mb": {k: round(m.increase_mb, 1) for k, m in mems.items()},
        "alive": {k: p.poll() is None for k, p in procs.items()},
        "load_average": round(os.getloadavg()[0], 1),
    }  # fmt: skip


def bench_f1(tmp: Path, lengths: list[int], alone: list[int], quiet_seconds: float = 4.0) -> dict:
    from specpipe.client import Client

    model = make_model(tmp, max_positions=32768)
    dep = deployment(model, tmp / "logs-f1")
    dep.start()
    out: dict = {"lengths": {}}
    try:
        procs = {name: child.proc for name, child in dep.children.items()}
        with Client(dep.router_address, timeout=900) as c:
            c.generate(prompt_ids=[1, 2, 3], max_new_tokens=2)  # warm
            # one prompt of 2,048 tokens first: the stages learn what prefill costs them
            c.generate(prompt_ids=_long_prompt(2048), max_new_tokens=2)
            neighbour = _Neighbour(c, [(11 * i + 5) % 90 + 1 for i in range(8)])
            neighbour.start()
            time.sleep(1.0)
            t0 = time.monotonic()
            time.sleep(quiet_seconds)
            out["quiet"] = quiet = neighbour.window(t0, time.monotonic())
            for n in lengths:
                a = time.monotonic()
                r = out["lengths"][n] = _long_request(c, procs, n)
                r["neighbour"] = seen = neighbour.window(a, time.monotonic())
                r["between_tokens_vs_quiet"] = round(
                    seen["between_tokens_s"] / max(quiet["between_tokens_s"], 1e-9), 2
                )
                print(f"f1 {n}: {json.dumps(r)}", flush=True)
                if not all(p.poll() is None for p in procs.values()):
                    break
            neighbour.stop.set()
            neighbour.join(timeout=120)
            out["neighbour_failed"] = neighbour.failed
            out["alone"] = {}
            for n in alone:  # memory and liveness, no neighbour
                r = out["alone"][n] = _long_request(c, procs, n)
                print(f"f1 alone {n}: {json.dumps(r)}", flush=True)
    finally:
        dep.stop()
    return out


# -- 1. oversized inputs ---------------------------------------------------------------------
def bench_oversize(tmp: Path) -> dict:
    from specpipe.v1 import draft_pb2, draft_pb2_grpc, stage_pb2, stage_pb2_grpc

    from specpipe.client import Client

    model = make_model(tmp)
    dep = deployment(model, tmp / "logs-oversize")
    dep.start()
    out: dict = {}
    try:
        router_pid = dep.children["router"].proc.pid
        text = "a" * (47 * MB)
        ids = [5] * (47 * MB)  # one byte per id on the wire
        with Client(dep.router_address, timeout=120) as c:
            c.generate(prompt_ids=[1, 2, 3], max_new_tokens=2)  # warm
            time.sleep(0.5)
            for name, kwargs in (
                ("text_47MB", {"prompt": text}),
                ("token_ids_47MB", {"prompt_ids": ids}),
            ):
                with PeakRss(router_pid) as mem:
                    code, secs, why = timed_call(
                        lambda kw=kwargs: c.generate(max_new_tokens=2, **kw)
                    )
                out[name] = {"status": code, "seconds": round(secs, 3),
                             "router_peak_increase_mb": round(mem.increase_mb, 1), "details": why}  # fmt: skip
                time.sleep(1.0)
            results: list = [None] * 4
            with PeakRss(router_pid) as mem:
                t0 = time.monotonic()

                def one(i: int) -> None:
                    results[i] = timed_call(lambda: c.generate(prompt=text, max_new_tokens=2))

                threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                secs = time.monotonic() - t0
            out["text_47MB_x4"] = {"status": sorted({r[0] for r in results}),
                                   "seconds": round(secs, 3),
                                   "router_peak_increase_mb": round(mem.increase_mb, 1)}  # fmt: skip
            code, _, why = timed_call(
                lambda: c.generate(prompt_ids=[1, 2, 3], max_new_tokens=4, ignore_eos=True)
            )
            out["small_request_afterwards"] = {"status": code, "details": why}
            out["router_alive"] = dep.children["router"].proc.poll() is None

        # A 57 MB Feed on an open request of stage 0.
        stage0 = dep.children["stage0"].info["grpc"]
        opts = grpc_options()
        with grpc.insecure_channel(stage0, options=opts) as ch:
            stub = stage_pb2_grpc.StageStub(ch)
            rid = "bench-feed"
            open_req = stage_pb2.OpenStageRequest(request_id=rid, capacity=64,
                                                  next_hop="tcp://127.0.0.1:9")  # fmt: skip
            code, _, why = timed_call(lambda: stub.Open(open_req, timeout=10))
            n = 57 * MB // 2  # positions and token ids, one byte each
            feed = stage_pb2.FeedRequest(request_id=rid, seq=0)
            feed.rows.positions.extend([1] * n)
            feed.rows.committed = True
            feed.token_ids.extend([1] * n)
            with HealthProbe(stage0) as probe:
                code, secs, why = timed_call(lambda: stub.Feed(feed, timeout=60))
                time.sleep(0.3)
            out["stage_feed_57MB"] = {"status": code, "seconds": round(secs, 3),
                                      "worst_health_check_s": round(probe.worst, 3),
                                      "health_failures": probe.failures, "details": why}  # fmt: skip
            with contextlib.suppress(grpc.RpcError):
                from specpipe.v1 import dataplane_pb2

                stub.Release(dataplane_pb2.RequestRef(request_id=rid), timeout=5)
        draft = dep.children["draft"].info["grpc"]
        with grpc.insecure_channel(draft, options=opts) as ch:
            stub = draft_pb2_grpc.DraftStub(ch)
            req = draft_pb2.OpenDraftRequest(request_id="bench-draft", capacity=8000,
                                             prompt_ids=[5] * 6000, prefill_chunk=128)  # fmt: skip
            with HealthProbe(draft) as probe:
                code, secs, why = timed_call(lambda: stub.Open(req, timeout=60))
                time.sleep(0.3)
            out["draft_open_6000_tokens_context_512"] = {
                "status": code, "seconds": round(secs, 3),
                "worst_health_check_s": round(probe.worst, 3), "details": why}  # fmt: skip
            with contextlib.suppress(grpc.RpcError):
                from specpipe.v1 import dataplane_pb2

                stub.Release(dataplane_pb2.RequestRef(request_id="bench-draft"), timeout=5)
    finally:
        dep.stop()
    return out


def grpc_options():
    big = 1 << 30
    return [("grpc.max_send_message_length", big), ("grpc.max_receive_message_length", big)]


# -- 2. leases after a router is killed ------------------------------------------------------
def _held(dep) -> dict[str, int]:
    from specpipe.v1 import dataplane_pb2, draft_pb2_grpc, stage_pb2_grpc

    counts = {}
    for name, child in dep.children.items():
        if name == "router":
            continue
        with grpc.insecure_channel(child.info["grpc"]) as ch:
            cls = draft_pb2_grpc.DraftStub if name == "draft" else stage_pb2_grpc.StageStub
            try:
                d = cls(ch).Describe(dataplane_pb2.DescribeRequest(), timeout=5)
                counts[name] = d.active_requests
            except grpc.RpcError:
                counts[name] = -1
    return counts


def _freed_after(dep, t0: float, limit: float) -> float | None:
    while time.monotonic() - t0 < limit:
        if not any(_held(dep).values()):
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def _start_requests(address: str, n: int) -> list:
    from specpipe.client import Client

    client = Client(address, timeout=300)
    modes = ["pp", "specpipe"] * n
    streams = [
        client.stream(prompt_ids=[3, 4, 5], mode=m, max_new_tokens=400, ignore_eos=True)
        for m in modes[:n]
    ]
    for s in streams:
        next(iter(s))
    return [client, streams]


def bench_lease(tmp: Path, lease_seconds: float, limit: float) -> dict:
    model = make_model(tmp)
    extra = {"lease_seconds": lease_seconds} if lease_seconds else {}
    out: dict = {"lease_seconds": lease_seconds or None, "limit_s": limit}
    dep = deployment(model, tmp / "logs-lease", **extra)
    dep.start()
    try:
        router = dep.children["router"]
        for case in ("killed", "restarted"):
            client, _ = _start_requests(dep.router_address, 3)
            held = _held(dep)
            t0 = time.monotonic()
            router.proc.send_signal(signal.SIGKILL)
            router.proc.wait()
            client.close()
            router.ready_file.unlink(missing_ok=True)
            if case == "restarted":
                dep._spawn(router)  # same argv: same ports, a new process
            freed = _freed_after(dep, t0, limit)
            out[case] = {"held_before": held, "freed_after_s": None if freed is None else round(freed, 2),
                         "held_at_end": _held(dep)}  # fmt: skip
            if case == "killed":  # back for the next case
                dep._spawn(router)
            _wait_file(router.ready_file, 60)
            time.sleep(1.0)
    finally:
        dep.stop()
    return out


def _wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear")
        time.sleep(0.05)


# -- 3. frame authentication per hop ----------------------------------------------------------
def bench_frame(frames: int) -> dict:
    import torch
    from specpipe.common.spec.messages import Activation
    from specpipe.services.transport import Inbox, make_transport

    secure_kw = _secure_transport_kwargs()
    out: dict = {}

    async def run(kib: int, kw: dict) -> float:
        inbox = Inbox()
        q = inbox.open("r")
        rx = make_transport("tcp", inbox, **kw.get("rx", {}))
        tx = make_transport("tcp", lambda f: None, **kw.get("tx", {}))
        addr = await rx.start()
        rows = kib * 1024 // (4 * 1024)  # float32 rows of 1024
        act = Activation("r", torch.arange(rows), node_ids=torch.arange(rows),
                         parent_ids=torch.full((rows,), -1), hidden=torch.randn(rows, 1024))  # fmt: skip
        if "open" in kw:
            kw["open"](rx, tx)
        try:
            for _ in range(20):  # warm
                await tx.send(addr, act, 0)
                await q.get()
            t0 = time.perf_counter()
            for i in range(frames):
                await tx.send(addr, act, i)
                await q.get()
            return (time.perf_counter() - t0) / frames * 1e6
        finally:
            await tx.close()
            await rx.close()

    for kib in (6, 96, 384):
        plain = min(asyncio.run(run(kib, {})) for _ in range(3))
        row = {"plaintext_us": round(plain, 1)}
        if secure_kw is not None:
            sec = min(asyncio.run(run(kib, secure_kw)) for _ in range(3))
            row["hmac_us"] = round(sec, 1)
            row["overhead_us"] = round(sec - plain, 1)
        out[f"{kib}KiB"] = row
    if secure_kw is None:
        out["note"] = "this version has no authenticated data plane"
    return out


def _secure_transport_kwargs() -> dict | None:
    try:
        from specpipe.services.transport.auth import FrameAuth
    except ImportError:
        return None
    key = os.urandom(32)
    return {"rx": {"auth": FrameAuth(key)}, "tx": {"auth": FrameAuth(key)}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="oversize,lease,frame")
    p.add_argument("--lease-seconds", type=float, default=10.0,
                   help="--lease-seconds of the services (0: do not pass it)")  # fmt: skip
    p.add_argument("--lease-limit", type=float, default=30.0, help="stop waiting after this")
    p.add_argument("--frames", type=int, default=400)
    p.add_argument(
        "--f1-lengths",
        default="4096,8192",
        help="f1: the long prompts' lengths in tokens, beside a neighbour",
    )
    p.add_argument("--f1-alone", default="32000",
                   help="f1: then these, with no neighbour (memory and liveness)")  # fmt: skip
    p.add_argument("--out", default=str(REPO / "benchmarks/results/hardening.json"))
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                         text=True).stdout.strip()  # fmt: skip
    result: dict = {"commit": rev, "machine": platform.machine(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench-harden-") as d:
        tmp = Path(d)
        for part in args.only.split(","):
            t0 = time.monotonic()
            if part == "oversize":
                result["oversize"] = bench_oversize(tmp)
            elif part == "lease":
                result["lease"] = bench_lease(tmp, args.lease_seconds, args.lease_limit)
            elif part == "frame":
                result["frame"] = bench_frame(args.frames)
            elif part == "f1":
                lengths = [int(x) for x in args.f1_lengths.split(",") if x]
                alone = [int(x) for x in args.f1_alone.split(",") if x]
                result["f1"] = bench_f1(tmp, lengths, alone)
            elif part == "edge":
                from bench_edge import bench_edge

                result["edge"] = bench_edge(tmp)
            elif part in ("fairness", "cache", "logprobs"):
                import bench_fairness

                result[part] = getattr(bench_fairness, f"bench_{part}")(tmp)
            print(f"{part}: {json.dumps(result.get(part), indent=1)} ({time.monotonic() - t0:.0f} s)",
                  flush=True)  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
