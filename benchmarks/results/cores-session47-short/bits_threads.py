import sys, torch, time
from pathlib import Path
from specpipe.common.model.loading import load_stage
M = Path.home()/".cache/specpipe/models"
for name, dt, inv in [("qwen2.5-coder-1.5b-instruct", torch.bfloat16, None), ("qwen2.5-coder-0.5b-instruct", torch.bfloat16, False)]:
    m = load_stage(M/name, None, dt, "cpu", batch_invariant=inv)
    g = torch.Generator().manual_seed(0)
    ok = True
    for n in (1, 2, 3, 8, 17, 40):
        ids = torch.randint(0, 1000, (n,), generator=g)
        pos = torch.arange(n)
        outs = []
        for th in (1, 2, 1, 2):
            torch.set_num_threads(th)
            with torch.inference_mode():
                h = m.forward(m.embed(ids), pos)
                outs.append(m.logits(h))
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        print(name, n, "same bits at 1 and 2 threads:", same, flush=True)
        ok &= same
    print(name, "ALL", ok, flush=True)
