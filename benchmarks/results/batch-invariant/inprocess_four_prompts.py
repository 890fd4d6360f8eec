"""The four bench_peer prompts in bf16, in process (lockstep engine, one stage): plain
decoding against SpecPipe with the 0.5B draft (W = 2, K = 3), batch invariance on or off.

    python benchmarks/results/batch-invariant/inprocess_four_prompts.py on 64 OUT.json
"""

import json
import sys
import time
from pathlib import Path

import specpipe.common.model.loading as loading
import torch
from specpipe.common.runtime.loader import build_local
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.spec.options import DecodeOptions, Mode
from transformers import AutoTokenizer

PROMPTS = [
    "Write a Python function that reverses a string.",
    "Explain what a hash map is in two sentences.",
    "Write a SQL query that counts the orders of each customer.",
    "What does the `yield` keyword do in Python?",
]


def main() -> None:
    torch.set_num_threads(2)
    on, tokens, out_path = sys.argv[1] == "on", int(sys.argv[2]), Path(sys.argv[3])
    applies = loading.invariance_applies
    loading.invariance_applies = lambda dt, dev: on and applies(dt, dev)
    root = Path.home() / ".cache/specpipe/models"
    target, draft = root / "qwen2.5-coder-1.5b-instruct", root / "qwen2.5-coder-0.5b-instruct"
    tok = AutoTokenizer.from_pretrained(target)
    dep = build_local(target, 1, draft, torch.bfloat16, max_cache_bytes=256 << 20)
    results = []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        out: dict = {}
        modes = [
            ("plain", Mode.AUTOREGRESSIVE, {}),
            ("draft_w2k3", Mode.SPECPIPE, {"width": 2, "layers_per_step": 3}),
        ]
        for name, mode, kw in modes:
            t0 = time.process_time()
            source = dep.draft if mode != Mode.AUTOREGRESSIVE else None
            opts = DecodeOptions(max_new_tokens=tokens, **kw)
            out[name] = list(LockstepGeneration(dep.pipeline, source, ids, mode, opts).run())
            out[name + "_cpu_s"] = round(time.process_time() - t0, 1)
        out["equal"] = out["plain"] == out["draft_w2k3"]
        out["text"] = tok.decode(out["plain"])
        print(json.dumps({k: v for k, v in out.items() if not isinstance(v, list)}), flush=True)
        results.append(out)
    out_path.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
