"""Session 47: whether a whole model's logits keep their bits when torch's thread count
changes (1 and 2 threads taking turns), for rows of 1 to 40 without a cache: what the
stage's run-time switch relies on (`services/cpu_threads.py`, `same_bits_at` checks the
linear shapes at start). Output: bits_threads.txt beside it."""

from pathlib import Path

import torch
from specpipe.common.model.loading import load_stage

MODELS = Path.home() / ".cache/specpipe/models"
for name, batch_invariant in [
    ("qwen2.5-coder-1.5b-instruct", None),  # as a stage loads it
    ("qwen2.5-coder-0.5b-instruct", False),  # as the draft loads it
]:
    model = load_stage(MODELS / name, None, torch.bfloat16, "cpu", batch_invariant=batch_invariant)
    gen = torch.Generator().manual_seed(0)
    ok = True
    for n in (1, 2, 3, 8, 17, 40):
        ids = torch.randint(0, 1000, (n,), generator=gen)
        outs = []
        for threads in (1, 2, 1, 2):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                outs.append(model.logits(model.forward(model.embed(ids), torch.arange(n))))
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        print(name, n, "same bits at 1 and 2 threads:", same, flush=True)
        ok &= same
    print(name, "ALL", ok, flush=True)
