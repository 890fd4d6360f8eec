"""What the batch-invariance kernel check adds to a half-precision CPU stage's start, and
what the per-machine record (`common/model/kernel_checks.py`) saves: process CPU seconds
of `load_stage` in fresh processes, one thread, without the record (every start checks),
then with an empty record (the first start checks and records) and again (later starts
read it). The model's files are read once first, so the page cache is warm for all.

    python benchmarks/bench_kernel_check.py --model ~/.cache/specpipe/models/qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ONE_LOAD = """
import json, resource, sys, torch
from specpipe.common.model.loading import load_stage
torch.set_num_threads(1)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
start = cpu()
model = load_stage(sys.argv[1], dtype=getattr(torch, sys.argv[2]))
print(json.dumps({"cpu_s": cpu() - start, "rows_alone": bool(model.rows_alone)}))
"""


def load_once(model: str, dtype: str, record: str) -> dict:
    env = {**os.environ, "SPECPIPE_KERNEL_CHECKS": record}
    out = subprocess.run(
        [sys.executable, "-c", ONE_LOAD, model, dtype],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face safetensors folder")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="save the figures as JSON")
    a = p.parse_args()
    for f in Path(a.model).glob("*.safetensors"):  # warm the page cache
        f.read_bytes()
    rows: list[tuple[str, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        record = str(Path(tmp) / "kernel-checks.json")
        for _ in range(a.repeats):
            rows.append(("no record (checks)", load_once(a.model, a.dtype, "")))
        rows.append(("first start (checks, records)", load_once(a.model, a.dtype, record)))
        for _ in range(a.repeats):
            rows.append(("later start (reads the record)", load_once(a.model, a.dtype, record)))
    print(f"{Path(a.model).name}, {a.dtype}, one thread: CPU seconds of load_stage")
    print("| start | CPU s | rows alone |\n|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['cpu_s']:.2f} | {r['rows_alone']} |")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps([{"start": n, **r} for n, r in rows], indent=1))


if __name__ == "__main__":
    main()
