"""Ad-hoc probe: SpecPipe in-process plain decoding (bf16) on 1 against 2 torch threads.
Run: .venv/bin/python benchmarks/results/peer/probes/probe_threads.py"""

import time
from pathlib import Path

import torch
from specpipe.common.runtime.loader import build_local
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.spec.options import DecodeOptions, Mode
from transformers import AutoTokenizer

d = Path.home() / ".cache/specpipe/models/qwen2.5-coder-1.5b-instruct"
tok = AutoTokenizer.from_pretrained(d)
ids = tok.apply_chat_template(
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    add_generation_prompt=True,
)
ids = ids if isinstance(ids, list) else ids["input_ids"]
dep = build_local(d, 1, None, torch.bfloat16)


def ours(n):
    g = LockstepGeneration(
        dep.pipeline, dep.draft, list(ids), Mode.AUTOREGRESSIVE, DecodeOptions(max_new_tokens=n)
    )
    t = time.perf_counter()
    out = g.run()
    return time.perf_counter() - t, out


outs = {}
for r in range(2):
    for th in (1, 2):
        torch.set_num_threads(th)
        ta, _ = ours(2)
        tb, outs[th] = ours(14)
        print(
            r,
            "threads",
            th,
            "ms/token",
            round(1e3 * (tb - ta) / 12, 1),
            Path("/proc/loadavg").read_text().split()[:2],
            flush=True,
        )
print("same ids 1 vs 2 threads:", outs[1] == outs[2])
