"""Tree policies with the real draft and a scripted target (greedy): tokens per step, hit
rate and misses for widths, layers per step and rankings, in minutes instead of hours.

The target's greedy continuation of each prompt is computed once with the real target
(autoregressive, cached in --out/continuations.json); then every configuration runs the
lockstep engine with the real draft model and `ScriptedPipeline` in the target's place
(exact for greedy decoding: see common/runtime/scripted.py) and must emit that continuation.
Tokens per step and hit rates are therefore the real system's; no time is projected.

    python benchmarks/bench_tree_policy.py --stages 8 --layers 2 --widths 8,16,32
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_layers import greedy_continuations, qwen_setup, run_one  # noqa: E402
from specpipe.common.model.config import ModelConfig  # noqa: E402
from specpipe.common.model.loading import load_stage  # noqa: E402
from specpipe.common.runtime.draft import DraftRuntime  # noqa: E402
from specpipe.common.runtime.scripted import ScriptedPipeline  # noqa: E402
from specpipe.common.spec.options import DecodeOptions, Mode  # noqa: E402


def continuations(setup, max_new: int, path: Path, log) -> dict[str, list[int]]:
    """prompt name -> prompt + the target's greedy continuation (cached in `path`)."""
    cached = json.loads(path.read_text()) if path.is_file() else {}
    missing = [p for p in setup.prompts if len(cached.get(p.name, [])) < len(p.ids) + max_new]
    if missing:
        cached.update(greedy_continuations(replace(setup, prompts=missing), max_new, log))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached))
    return cached


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--stages", default="8")
    ap.add_argument("--layers", default="1,2")
    ap.add_argument("--widths", default="8,16")
    ap.add_argument("--rankings", default="target")
    ap.add_argument("--code", type=int, default=1)
    ap.add_argument("--chat", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "tree-policy")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    setup = qwen_setup(args.code, args.chat)
    if setup is None:
        sys.exit("bench_tree_policy: pull the Qwen pair first (specpipe models pull ...)")
    seqs = continuations(setup, args.max_new_tokens, args.out / "continuations.json", log)
    vocab = ModelConfig.from_dir(setup.target).vocab_size
    draft = DraftRuntime(load_stage(setup.draft))
    results = []
    for S in [int(s) for s in args.stages.split(",")]:
        for k in [int(x) for x in args.layers.split(",")]:
            for w in [int(x) for x in args.widths.split(",")]:
                for ranking in args.rankings.split(","):
                    runs = []
                    for p in setup.prompts:
                        full = seqs[p.name][: len(p.ids) + args.max_new_tokens]
                        opts = DecodeOptions(max_new_tokens=args.max_new_tokens, width=w,
                                             layers_per_step=k, ranking=ranking,
                                             stop_token_ids=setup.stop)  # fmt: skip
                        pipe = ScriptedPipeline(full, S, vocab)
                        run = run_one(pipe, p, Mode.SPECPIPE, opts, draft)
                        if run["tokens"] != full[len(p.ids) :]:
                            raise SystemExit(f"{p.name}: not the target's continuation")
                        runs.append({**run, "misses": run["new_tokens"] - run["hits"]})
                    tokens = sum(r["new_tokens"] for r in runs)
                    steps = sum(r["decode_steps"] for r in runs)
                    row = {"stages": S, "layers_per_step": k, "width": w, "ranking": ranking,
                           "tokens_per_step": tokens / steps,
                           "hit_rate": sum(r["hits"] for r in runs) / tokens,
                           "regrowths": sum(r["regrowths"] for r in runs),
                           "per_prompt": {r["prompt"]: round(r["tokens_per_step"], 3) for r in runs},
                           "runs": runs}  # fmt: skip
                    results.append(row)
                    log(f"S={S} K={k} W={w} {ranking}: tok/step {row['tokens_per_step']:.3f} "
                        f"hit {row['hit_rate']:.3f} misses {sum(r['misses'] for r in runs)} "
                        f"regrowths {row['regrowths']} "
                        f"{row['per_prompt']} ({sum(r['wall_seconds_in_process'] for r in runs):.0f} s)")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"s{args.stages}-k{args.layers}-w{args.widths}-{args.rankings}".replace(",", "_")
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
