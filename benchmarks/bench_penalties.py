"""What the logits rules cost per drawn token at the last stage (common/spec/penalties.py):
the rules applied to one logits row, the draw, and the counts advanced, against the draw
alone, for real vocabularies (SmolLM2's 49,152 and Qwen2.5's 151,936 tokens) and
prompts of 512 and 4,096 distinct tokens; beside it the dense way (every token's count
over the vocabulary rebuilt per draw, as a batch engine's penalty kernel reads them).
Medians over 256 draws along a growing output (the least of 3 runs, after a warm-up),
one torch thread, CPU unless --device.

    python benchmarks/bench_penalties.py [--device cuda] [--out results/penalties.json]

With --hits instead: the hit rate and tokens per step of the target as its own draft
(a random 5-layer model, fp64, greedy and seeded, S = 3, W = 4, K = 1 and 2, 60 tokens)
under the rules, with the growth ranking by them (`GrowthRules`) and without.
"""

from __future__ import annotations

import argparse
import contextlib
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


HIT_CASES = {
    "none": {},
    "repetition 1.3": dict(repetition_penalty=1.3),
    "frequency 1.0": dict(frequency_penalty=1.0),
    "rep 1.2 + freq 0.5 + pres 0.5": dict(repetition_penalty=1.2, frequency_penalty=0.5,
                                          presence_penalty=0.5),
    "T 0.8, the same three": dict(temperature=0.8, seed=3, repetition_penalty=1.2,
                                  frequency_penalty=0.5, presence_penalty=0.5),
}  # fmt: skip


def hits() -> list[dict]:
    """Hit rates with and without the growth ranking by the rules."""
    import tempfile
    from unittest import mock

    from specpipe.common.model.synthetic import save_random_model
    from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
    from specpipe.common.runtime.lockstep import LockstepGeneration
    from specpipe.common.spec.options import DecodeOptions, Mode
    from specpipe.common.spec.penalties import GrowthRules

    target = save_random_model(Path(tempfile.mkdtemp()), "llama", layers=5, seed=0)
    prompt = [5, 17, 33, 2, 8, 90, 41, 12, 60]
    rows = []
    for name, params in HIT_CASES.items():
        for k in (1, 2):
            row: dict[str, object] = {"rules": name, "K": k}
            for ranked in (False, True):
                dep = build_local(target, 3, ORACLE_DRAFT, torch.float64)
                opts = DecodeOptions(max_new_tokens=60, sampling=SamplingParams(**params),
                                     width=4, layers_per_step=k)  # fmt: skip
                off = mock.patch.object(GrowthRules, "of", return_value=None)
                with contextlib.nullcontext() if ranked else off:
                    gen = LockstepGeneration(dep.pipeline, dep.draft, prompt, Mode.SPECPIPE, opts)
                    gen.run()
                tag = "ranked" if ranked else "unranked"
                row[f"{tag} hit rate"] = round(gen.stats.hit_rate, 3)
                row[f"{tag} tokens/step"] = round(gen.stats.tokens_per_step, 3)
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--hits", action="store_true", help="hit rates under the rules instead")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.hits:
        found = hits()
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"hits": found}, indent=1))
        return
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
