"""Ad-hoc probe (issue 23 point 3 of peer27): SpecPipe in-process plain decoding against
transformers generate, bf16, interleaved, then torch.profiler tables. Run:
.venv/bin/python benchmarks/results/peer/probes/probe_forward.py"""

import time
from pathlib import Path

import torch
from specpipe.common.runtime.loader import build_local
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.spec.options import DecodeOptions, Mode
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, AutoTokenizer

d = Path.home() / ".cache/specpipe/models/qwen2.5-coder-1.5b-instruct"
tok = AutoTokenizer.from_pretrained(d)
ids = tok.apply_chat_template(
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    add_generation_prompt=True,
)
ids = ids if isinstance(ids, list) else ids["input_ids"]
dep = build_local(d, 1, None, torch.bfloat16)
hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
x = torch.tensor([ids])


def ours(n):
    g = LockstepGeneration(
        dep.pipeline, dep.draft, list(ids), Mode.AUTOREGRESSIVE, DecodeOptions(max_new_tokens=n)
    )
    t = time.perf_counter()
    out = g.run()
    return time.perf_counter() - t, out


def theirs(n):
    with torch.inference_mode():
        t = time.perf_counter()
        out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t, out[0, x.shape[1] :].tolist()


A, B = 4, 20
for r in range(2):
    for name, f in (("ours", ours), ("hf", theirs)):
        ta, _ = f(A)
        tb, out = f(B)
        print(
            r,
            name,
            "ms/token",
            round(1e3 * (tb - ta) / (B - A), 1),
            Path("/proc/loadavg").read_text().split()[:2],
            flush=True,
        )
print("same 20 ids:", ours(B)[1] == theirs(B)[1])

for name, f in (("ours", ours), ("hf", theirs)):
    f(2)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        f(12)
    print("=====", name)
    print(
        p.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50
        )
    )
