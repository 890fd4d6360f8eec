"""Benchmark of the router-death resume (not a test): a local deployment of tiny random
models (the launcher behind `specpipe up`) with several router replicas; each round a
client streams a request through the SDK given every router's address, and the router
serving it is SIGKILLed after `--after` tokens. Reported per round: the stall the caller
sees (the gap between the last token before the kill and the first after, which spans
the SDK's detection, its backoff, the new router's prefill of prompt + tokens received
and the next draw), the resumes, and whether the output equals the in-process engine's
(it must); and the CPU seconds of the client process.

    python benchmarks/bench_resume.py [--rounds 3] [--out benchmarks/results/resume.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--after", type=int, default=24, help="tokens before the kill")
    ap.add_argument("--stage-ms", type=float, default=10.0, help="paced stage forward")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "resume.json")
    args = ap.parse_args()

    from specpipe.common.model.synthetic import save_random_model
    from specpipe.common.runtime.loader import build_local, parse_dtype
    from specpipe.common.runtime.lockstep import LockstepGeneration
    from specpipe.common.spec.options import DecodeOptions
    from specpipe.services.launcher import ServicesDeployment

    from specpipe.client import Client

    work = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    model = save_random_model(work / "llama", "llama", layers=5, seed=0)
    costs = work / "flat.json"
    costs.write_text(json.dumps({"flat": {"stage": args.stage_ms / 1e3}}))
    prompt = [5, 17, 33, 8, 21, 40, 2, 11]
    local = build_local(model, 2, model, parse_dtype("float64"))
    opts = DecodeOptions(max_new_tokens=args.new_tokens, stop_token_ids=())
    want = LockstepGeneration(local.pipeline, local.draft, prompt, "specpipe", opts).run()

    dep = ServicesDeployment(model, "oracle", 2, transport="tcp", threads=1, dtype="float64",
                             secure=False, emulate_costs=costs)  # fmt: skip
    rounds = []
    try:
        dep.start()
        victims = dep.add_routers(args.rounds)
        for victim in victims:
            addresses = [victim.info["grpc"], dep.router_address]
            times: list[float] = []
            tokens: list[int] = []
            killed_at = None
            cpu0 = time.process_time()
            with Client(addresses, timeout=120) as c:
                stream = c.stream(prompt_ids=prompt, max_new_tokens=args.new_tokens,
                                  ignore_eos=True)  # fmt: skip
                for chunk in stream:
                    now = time.monotonic()
                    times += [now] * len(chunk.token_ids)
                    tokens += chunk.token_ids
                    if killed_at is None and len(tokens) >= args.after:
                        dep.kill(victim.name)
                        killed_at = len(tokens)
                done = stream.result()
            chunks = sorted(set(times))  # tokens verified together arrive together
            gaps = [b - a for a, b in itertools.pairwise(chunks)]
            rounds.append({
                "tokens_before_kill": killed_at,
                "stall_ms": round(1e3 * (times[killed_at] - times[killed_at - 1]), 1),
                "median_gap_ms": round(1e3 * statistics.median(gaps), 1),
                "resumes": done.resumes,
                "exact": tokens == want,
                "client_cpu_s": round(time.process_time() - cpu0, 3),
            })  # fmt: skip
            print(rounds[-1], flush=True)
    finally:
        dep.stop()
    result = {
        "machine": platform.processor() or platform.machine(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rounds": rounds,
        "stall_ms_median": statistics.median(r["stall_ms"] for r in rounds) if rounds else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()
