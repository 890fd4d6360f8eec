"""Defaults that never lose on real models (issue 34 point 7, session 45): how `specpipe
up` gives the cores to its model processes (`services/cpu_threads.py`), measured with
the 1.5B target and the 0.5B draft on this host's CPUs.

Deployments (`specpipe up`, one stage), each measured with 64-token greedy chats from
one client:

- `a`: no draft; the stage on every core (what main's launcher gives it without a draft).
- `b`: the 0.5B draft, the cores split between the stage and the draft (main's launcher:
  one thread each on 2 cores), the OpenMP runtime's default waits.
- `c`: the 0.5B draft, every core to every model process with passive OpenMP waits (the
  launcher's default for these models).
- `d`: the 0.5B draft, every core to the stage, the draft its share (one thread on 2
  cores), passive OpenMP waits.
- `e`: the 0.5B draft, `--split-cores-while-drafting` (session 47): the stage on every
  core while the draft holds no request and on the cores the draft leaves while it holds
  some (switched on its compute thread), the draft its share of the split, passive waits.

Request kinds: `pp` (no draft: plain decoding through the pipeline), `default` (the
router tunes width, layers per step and source; no draft is among its candidates) and
`W=2 K=3 draft` (pinned): the default's calibration runs first, then the kinds alternate
prompt by prompt. Per kind:
time between tokens, tokens per step, the settings that ran, CPU seconds per token of the
stage, the draft and the router (from /proc, the deployment's own processes), the load
average, and every output against the served-dtype reference (in-process plain decoding,
`autoregressive`, same dtype; cached in the output file's folder).

    python benchmarks/bench_cores.py --arms a,b,c --out benchmarks/results/cores-session45

`--forward-threads`: instead, CPU and wall time per forward at 1 and 2 torch threads of
models from the test Llama's size to the 0.5B draft's (the rule for small models,
`cpu_threads.small_model`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_defaults import tuning_arms  # noqa: E402
from bench_emulated import stream_all  # noqa: E402
from bench_peer import PROMPTS  # noqa: E402

MODELS = Path.home() / ".cache" / "specpipe" / "models"
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROCESSES = ("stage0", "draft", "router")  # the table's CPU columns
SPLIT = {"OMP_WAIT_POLICY": ""}  # main's launcher: the OpenMP runtime's default waits
# draft, threads of the stage and of the draft (None: the launcher's), environment, and
# the deployment's other settings
ARMS: dict[str, tuple[bool, int | None, int | None, dict, dict]] = {
    "a": (False, 2, None, SPLIT, {}),
    "b": (True, 1, 1, SPLIT, {}),
    "c": (True, 2, 2, {}, {}),
    "d": (True, 2, 1, {}, {}),
    "e": (True, None, None, {}, {"split_cores_while_drafting": True}),
}
KINDS = {
    "default": {},
    "pp": {"mode": "pp"},
    # where the tuner settles with this pair here (session 42 pinned it too)
    "W=2 K=3 draft": {"width": 2, "layers_per_step": 3, "token_source": "draft"},
}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompts_of(n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODELS / TARGET)
    out = []
    for p in PROMPTS[:n]:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        out.append([int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    return out


def reference(prompts, max_new_tokens: int, cache: Path) -> list[list[int]]:
    """Plain decoding in process, bfloat16, S = 1 (cached: it costs minutes here)."""
    key = json.dumps([prompts, max_new_tokens])
    if cache.exists():
        got = json.loads(cache.read_text())
        had, n = json.loads(got["key"]), len(prompts)
        if had[1] >= max_new_tokens and had[0][:n] == prompts:  # the same, or more of them
            return [t[:max_new_tokens] for t in got["tokens"][:n]]  # (EOS ignored: a prefix)
    import torch
    from specpipe.common.runtime.loader import build_local
    from specpipe.common.runtime.lockstep import LockstepGeneration
    from specpipe.common.spec.options import DecodeOptions, Mode

    local = build_local(MODELS / TARGET, 1, None, dtype=torch.bfloat16)
    opts = DecodeOptions(max_new_tokens=max_new_tokens, stop_token_ids=())
    out = []
    for p in prompts:
        out.append(
            list(LockstepGeneration(local.pipeline, None, p, Mode.AUTOREGRESSIVE, opts).run())
        )
        log(f"reference: {len(out)}/{len(prompts)}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "tokens": out}))
    return out


class Cpu:
    """CPU seconds of the deployment's processes (stage, draft, router) between marks."""

    def __init__(self, dep) -> None:
        self.pids = {n: c.proc.pid for n, c in dep.children.items() if c.proc is not None}
        self.last = self.now()

    def now(self) -> dict[str, float]:
        return {n: cpu_seconds(pid) for n, pid in self.pids.items()}

    def lap(self) -> dict[str, float]:
        now = self.now()
        lap = {n: now[n] - self.last[n] for n in now}
        self.last = now
        return lap


def label(stats: dict) -> str:
    if stats["mode"] != "specpipe":
        return str(stats["mode"])
    return f"W={stats['width']} K={stats['layers_per_step']} {stats['token_source']}"


async def calibrate(address: str, prompts, kwargs: dict, most: int) -> tuple[int, str]:
    """Default requests until the router's tuning has not said "measuring" after 2 in a
    row (or `most` requests); how many ran and its last reason."""
    from specpipe.services.client.aio import AsyncClient

    served, settled, reason = 0, 0, ""
    async with AsyncClient(address, timeout=1200) as client:
        while served < most and settled < 2:
            await client.generate(prompt_ids=prompts[served % len(prompts)], **kwargs)
            served += 1
            tuning = (await client.describe()).tuning
            reason = tuning[0].reason if tuning else ""
            settled = settled + 1 if tuning and "measuring" not in reason else 0
            log(f"  calibration {served}: {reason[:150]}")
    return served, reason


def run_arm(name: str, args, prompts, ref) -> dict:
    from specpipe.services.client.sync import Client
    from specpipe.services.launcher import ServicesDeployment

    has_draft, threads, d_threads, env, extra = ARMS[name]
    work = Path(tempfile.mkdtemp(prefix=f"bench-cores-{name}-"))
    dep = ServicesDeployment(
        MODELS / TARGET, MODELS / DRAFT if has_draft else "none", 1, dtype="bfloat16",
        threads=threads, draft_threads=d_threads, env=env, log_dir=work / "logs",
        startup_timeout=900,
        scheduling={"tune_calibration_tokens": args.calibration_tokens}, **extra,
    )  # fmt: skip
    out: dict = {"arm": name, "draft": has_draft, "threads": dep.threads,
                 "draft_threads": dep.draft_threads if has_draft else None,
                 "threads_with_draft": dep.threads_with_draft or None,
                 "omp_wait_policy": dep.env.get("OMP_WAIT_POLICY", "(runtime default)")}  # fmt: skip
    base = dict(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    kinds = {k: KINDS[k] for k in args.kinds.split(",") if has_draft or k == "pp"}
    dep.start()
    try:
        cpu = Cpu(dep)
        if "default" in kinds:
            t0, l0 = time.perf_counter(), load()
            n, reason = asyncio.run(calibrate(dep.router_address, prompts, base, args.most))
            out["calibration"] = {
                "requests": n, "wall_s": round(time.perf_counter() - t0, 1),
                "cpu_s": {k: round(v, 1) for k, v in cpu.lap().items()},
                "load": [l0, load()], "reason": reason,
            }  # fmt: skip
        cells: dict[str, dict] = {k: {"results": [], "cpu": {}, "load": []} for k in kinds}
        for _ in range(args.rounds):
            for i, p in enumerate(prompts):
                for k, kw in kinds.items():
                    cell = cells[k]
                    cell["load"].append(load())
                    cpu.lap()
                    results, tokens, _ = asyncio.run(
                        stream_all(dep.router_address, [p], 1, {**base, **kw})
                    )
                    for n, v in cpu.lap().items():
                        cell["cpu"][n] = cell["cpu"].get(n, 0.0) + v
                    cell["results"].append((results[0], tokens[0] == ref[i]))
                    r = results[0]
                    log(f"  {name} {k} prompt {i}: {1e3 * r.tbt:.0f} ms/token, "
                        f"{label(r.stats)}, exact {tokens[0] == ref[i]}, load {load():.1f}")  # fmt: skip
        for k, cell in cells.items():
            rs = [r for r, _ in cell["results"]]
            tokens = sum(r.output_tokens for r in rs)
            out[k] = {
                "requests": len(rs),
                "tbt_ms": round(1e3 * statistics.mean(r.tbt for r in rs), 1),
                "tbt_ms_each": [round(1e3 * r.tbt, 1) for r in rs],
                "tokens_per_step": round(
                    statistics.mean(float(r.stats["tokens_per_step"]) for r in rs), 3
                ),
                "settings": sorted({label(r.stats) for r in rs}),
                "cpu_ms_per_token": {
                    n: round(1e3 * v / tokens, 1) for n, v in sorted(cell["cpu"].items())
                },
                "cpu_ms_per_token_total": round(1e3 * sum(cell["cpu"].values()) / tokens, 1),
                "load": [min(cell["load"]), max(cell["load"])],
                "exact": f"{sum(ok for _, ok in cell['results'])}/{len(rs)}",
            }
            log(f"{name} {k}: {out[k]}")
        # the stage's switches of its torch threads (ThreadShare's lines, at most one a
        # minute per direction: the last count logged)
        logged = re.findall(r"(\d+) switches so far", (work / "logs" / "stage0.log").read_text())
        out["stage_switches_logged"] = max(map(int, logged), default=0)
        with Client(dep.router_address, timeout=30) as client:
            tuning = client.describe().tuning
            if tuning:
                out["chosen"] = tuning[0].reason
                out["arms"] = tuning_arms(tuning[0])
    finally:
        dep.stop()
    return out


# (hidden size, layers, vocabulary) of Llama-shaped random models, the test Llama first
FORWARD_SHAPES = [(64, 8, 512), (128, 8, 512), (256, 8, 512), (512, 12, 512)]


def forward_threads(rows_list=(1, 4), rounds: int = 2) -> list[dict]:
    """CPU and wall ms per forward (no cache: rows at positions 100+) at 1 and 2 torch
    threads, the counts taking turns `rounds` times: random fp32 Llamas of growing width
    and the 0.5B draft itself (bf16)."""
    import torch
    from specpipe.common.model.config import ModelConfig
    from specpipe.common.model.loading import load_stage
    from specpipe.common.model.partition import LayerRange
    from specpipe.common.model.synthetic import random_stage
    from specpipe.services.cpu_threads import small_model, weights_per_row

    models = []
    for h, layers, vocab in FORWARD_SHAPES:
        raw = dict(
            model_type="llama", hidden_size=h, intermediate_size=h * 8 // 3 // 8 * 8,
            num_hidden_layers=layers, num_attention_heads=max(2, h // 32),
            num_key_value_heads=max(1, h // 128), vocab_size=vocab, max_position_embeddings=4096,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        )  # fmt: skip
        cfg = ModelConfig.from_dict(raw)
        models.append((f"llama h={h}", cfg, random_stage(raw, LayerRange(0, layers, layers))))
    cfg = ModelConfig.from_dir(MODELS / DRAFT)
    models.append(
        (DRAFT, cfg, load_stage(MODELS / DRAFT, None, torch.bfloat16, batch_invariant=False))
    )
    out = []
    for label_, cfg, model in models:
        dtype = next(model.parameters()).dtype
        for rows in rows_list:
            x = torch.randn(rows, cfg.hidden_size).to(dtype)
            pos = torch.arange(100, 100 + rows)
            n = max(3, int(2e8 / (weights_per_row(cfg) * rows + 1e6)))  # ~0.1-1 s a turn
            got: dict[int, list] = {1: [], 2: []}
            for _ in range(rounds):
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    with torch.inference_mode():
                        model.logits(model.forward(x, pos))
                        c0, w0 = time.process_time(), time.perf_counter()
                        for _ in range(n):
                            model.logits(model.forward(x, pos))
                    got[threads].append(
                        (1e3 * (time.process_time() - c0) / n, 1e3 * (time.perf_counter() - w0) / n)
                    )
            row = {"model": label_, "weights_per_row": weights_per_row(cfg),
                   "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(runtime default)"),
                   "small": small_model(cfg), "rows": rows, "load": load(),
                   **{f"{t} threads (cpu ms, wall ms)": [[round(c, 3), round(w, 3)] for c, w in v]
                      for t, v in got.items()}}  # fmt: skip
            log(row)
            out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="a,b,c", help="deployments in order, e.g. a,b,c,c,b,a")
    ap.add_argument("--prompts", type=int, default=4, help="chat prompts (of bench_peer's 4)")
    ap.add_argument("--rounds", type=int, default=1, help="measured passes over the prompts")
    ap.add_argument("--kinds", default="default,pp", help=f"of {', '.join(KINDS)}")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--calibration-tokens", type=int, default=64)
    ap.add_argument("--most", type=int, default=40, help="calibration requests at most")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "cores-session45")
    ap.add_argument("--forward-threads", action="store_true", help="the forward probe instead")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.forward_threads:
        from specpipe.services.cpu_threads import model_env

        env = model_env(os.environ)  # OpenMP's waits as in a model process of `specpipe up`
        if env.get("OMP_WAIT_POLICY") != os.environ.get("OMP_WAIT_POLICY"):
            os.execve(sys.executable, [sys.executable, *sys.argv], env)  # read at its start
        rows = forward_threads()
        (args.out / "forward-threads.json").write_text(json.dumps(rows, indent=1))
        return 0
    prompts = prompts_of(args.prompts)
    ref = reference(prompts, args.max_new_tokens, args.out / "reference.json")
    rows = []
    for name in args.arms.split(","):
        rows.append(run_arm(name, args, prompts, ref))
        (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print("| arm | kind | ms/token | tokens/step | settings | CPU ms/token (stage, draft, "
          "router) | load | exact |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for k in KINDS:
            if k in r:
                m = r[k]
                per = m["cpu_ms_per_token"]  # in the header's order (the keys sort otherwise)
                cpu = ", ".join(f"{per[n]:g}" if n in per else "-" for n in PROCESSES)
                switch = f", {r['threads_with_draft']} while drafting" if r.get(
                    "threads_with_draft") else ""  # fmt: skip
                print(f"| {r['arm']} (threads {r['threads']}/{r.get('draft_threads')}{switch}, "
                      f"{r['omp_wait_policy']}) | {k} | "
                      f"{m['tbt_ms']} | {m['tokens_per_step']} | {', '.join(m['settings'])} | "
                      f"{m['cpu_ms_per_token_total']} ({cpu}) | {m['load'][0]}-{m['load'][1]} | "
                      f"{m['exact']} |")  # fmt: skip
        if "calibration" in r:
            print(f"| {r['arm']} | calibration: {r['calibration']['requests']} requests, "
                  f"{r['calibration']['wall_s']} s; chosen: {r.get('chosen', '')} | | | | | | |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
