"""What the logits rules cost per drawn token at the last stage (common/spec/penalties.py):
the rules applied to one logits row, the draw, and the counts advanced, against the draw
alone, for real vocabularies (SmolLM2's 49,152 and Qwen2.5's 151,936 tokens) and
prompts of 512 and 4,096 distinct tokens; beside it the dense way (every token's count
over the vocabulary rebuilt per draw, as a batch engine's penalty kernel reads them).
Medians over 256 draws along a growing output (the least of 3 runs, after a warm-up),
one torch thread, CPU unless --device.

    python benchmarks/bench_penalties.py [--device cuda] [--out results/penalties.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from specpipe.common.spec.sampling import SamplingParams, draw_index
from specpipe.common.spec.verify import VerifySpec

CASES = {
    "none": {},
    "repetition": dict(repetition_penalty=1.2),
    "frequency+presence": dict(frequency_penalty=0.5, presence_penalty=0.5),
    "all, 300 biases": dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5,
                            logit_bias={i * 97: 1.0 for i in range(300)}),
}  # fmt: skip
DRAWS = 256
RUNS = 3


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def per_draw(vocab: int, prompt_len: int, params: dict, device: str, min_tokens: int) -> float:
    """Median seconds of one draw with the rules (rules, draw, read back, count)."""
    rng = np.random.default_rng(0)
    prompt = rng.permutation(vocab)[:prompt_len].tolist()
    sampling = SamplingParams(**params)
    spec = VerifySpec(sampling, prompt_len, min_tokens=min_tokens, stop_token_ids=(0, 1))
    rules = spec.rules(prompt)
    rows = torch.randn(DRAWS, vocab, generator=torch.Generator().manual_seed(1)).to(device)
    times = []
    for i in range(DRAWS):
        _sync(device)
        t0 = time.perf_counter()
        x = rules.apply(rows[i], i)
        token = int(draw_index(x, sampling, i))  # the read-back every draw has anyway
        rules.drawn(token)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def dense_per_draw(vocab: int, prompt_len: int, device: str) -> float:
    """Median seconds of the dense way: masks and counts over the vocabulary per draw."""
    rng = np.random.default_rng(0)
    prompt = torch.tensor(rng.permutation(vocab)[:prompt_len], device=device)
    output: list[int] = []
    rows = torch.randn(DRAWS, vocab, generator=torch.Generator().manual_seed(1)).to(device)
    times = []
    for i in range(DRAWS):
        _sync(device)
        t0 = time.perf_counter()
        x = rows[i].clone()
        out = torch.tensor(output, dtype=torch.int64, device=device)
        counts = torch.bincount(out, minlength=vocab)
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[prompt] = True
        seen |= counts > 0
        x = torch.where(seen, torch.where(x > 0, x / 1.2, x * 1.2), x)
        x = x - 0.5 * counts - 0.5 * (counts > 0)
        token = int(torch.argmax(x))
        output.append(token)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    results = []
    dev = args.device
    for vocab in (49152, 151936):
        for prompt_len in (512, 4096):
            per_draw(vocab, prompt_len, {}, dev, 0)  # warm-up
            row: dict[str, object] = {"vocab": vocab, "prompt": prompt_len}
            for name, params in CASES.items():
                row[name] = min(per_draw(vocab, prompt_len, params, dev, 0) for _ in range(RUNS))
            row["min_tokens"] = min(
                per_draw(vocab, prompt_len, {}, dev, DRAWS) for _ in range(RUNS)
            )
            row["dense rep+freq+presence"] = min(
                dense_per_draw(vocab, prompt_len, dev) for _ in range(RUNS)
            )
            results.append(row)
            cells = "  ".join(
                f"{k}: {v * 1e6:.0f} µs" for k, v in row.items() if isinstance(v, float)
            )
            print(f"vocab {vocab}, prompt {prompt_len}: {cells}", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": args.device, "draws": results}, indent=1))


if __name__ == "__main__":
    main()
