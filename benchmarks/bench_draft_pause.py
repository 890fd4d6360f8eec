"""What a pause between steps costs the draft's next batch (issue 34: why a deployed step
costs about twice what it costs in process).

`bench_stage_prep.py`'s draft replay (the draft's recorded calls of `bench_host.py`'s
workload, batched as its service batches them; thread CPU per batch) with `--pause-ms`
of sleep before each batch, as a deployed draft at one client sleeps 10-20 ms between
its batches, against none; this version and, with `--baseline DIR` (a copy of another
version's `common`), that one, all taking turns. The sleep itself costs no thread CPU:
what rises is the batch's own work, run after the pause.

    python benchmarks/bench_draft_pause.py --baseline /tmp/base/common   # ~2 minutes

Writes results/draft-pause/<label>.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_stage_prep as prep  # noqa: E402
from bench_draft_host import record  # noqa: E402
from bench_serve import make_model  # noqa: E402

OUT = HERE / "results" / "draft-pause"


def paused_replay(target: Path, calls, package: str, pause: float) -> dict[str, float]:
    """`prep.replay_draft` with `pause` seconds of sleep before each batch (its first
    call, `prune_many`)."""
    runtime = importlib.import_module(f"{package}.runtime.draft").DraftRuntime
    plain = runtime.prune_many

    def prune_many(self, *args, **kwargs):
        time.sleep(pause)
        return plain(self, *args, **kwargs)

    runtime.prune_many = prune_many
    try:
        return prep.replay_draft(target, calls, package)
    finally:
        runtime.prune_many = plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pause-ms", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", type=Path, help="a copy of another version's common")
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = make_model(Path(tempfile.mkdtemp(prefix="bench-draft-pause-")), 8, 64, 512)
    calls = record(target, 1, 2)
    versions = {"after": "specpipe.common"}
    if args.baseline is not None:
        versions = {"before": prep.baseline_package(args.baseline), **versions}
    runs = []
    for r in range(args.rounds):
        for pause in (0.0, args.pause_ms / 1e3):
            for name, package in versions.items():
                us = paused_replay(target, calls, package, pause)
                runs.append({"round": r, "version": name, "pause_ms": 1e3 * pause, **us})
                parts = " | ".join(f"{k} {v:.0f}" for k, v in us.items())
                print(f"round {r}, {name}, pause {1e3 * pause:.0f} ms: us per batch: {parts}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.label}.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
