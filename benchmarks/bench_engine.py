"""The stage engine (issue 23): forward time of one stage, operations per stage step, and
how many chats without `max_tokens` fit one KV budget. One module: the three
measurements share the stage they build and the A/B driver that runs them on two
checkouts.

One stage of Qwen2.5-Coder-1.5B's shape split in two (S = 2: layers [0, 14) of 28, hidden
1536, 12 query / 2 K/V heads of 128, the embedding) with random weights, in fp32 and bf16,
on this CPU:

- **forward**: one `StageRuntime.forward_many` of requests x rows (1x1, 1x64, 8x8, 32x2,
  64x1), every request holding 1,000 cached tokens; the tree rows are children of the
  committed prefix and dropped by a prune after each step, so every step sees the same
  context. Best of `--repeats` after one warm-up (the machine is shared: the minimum is
  the figure least disturbed by other processes).
- **ops**: aten operations one stage step dispatches (counted with a TorchDispatchMode),
  for 1 to 64 requests of one row, on a model of the same depth but tiny width (the count
  does not depend on sizes), and which of them read device values back to the host.
- **chats**: requests without `max_tokens` opened on one stage until the budget refuses
  one; a chat holds a 40-token prompt and a 60-token answer (its capacity, what the
  router asks for, is the whole context).

The script uses only `StageRuntime`'s public calls plus `_cache(rid).append_committed(n)`
(cached rows without computing them), which the code before and after the paged cache
both have, so the same file measures either checkout:

    /work/main/.venv/bin/python benchmarks/bench_engine.py --label before
    .venv/bin/python benchmarks/bench_engine.py --label after

Results go to benchmarks/results/engine/<label>.json; `--table` prints the comparison of
every label there as markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from specpipe.common.model.config import ModelConfig
from specpipe.common.model.layers import StageModel
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime.errors import CacheFull
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation, Prune
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "engine"
SHAPES = [(1, 1), (1, 64), (8, 8), (32, 2), (64, 1)]
CONTEXT = 1000
SYNCING = {"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero"}
# Operations that run no kernel: views of a tensor's memory, and `to`/`contiguous` that
# change nothing (a real copy dispatches `_to_copy` or `clone` as well); the host's
# `.numpy()` and `torch.from_numpy` of message tensors are `detach`, `resolve_*` and
# `lift_fresh`.
ALIASES = {
    f"aten::{op}"
    for op in [
        "view",
        "_unsafe_view",
        "reshape",
        "transpose",
        "t",
        "permute",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "unsqueeze",
        "squeeze",
        "expand",
        "alias",
        "as_strided",
        "detach",
        "lift_fresh",
        "narrow",
        "unbind",
        "to",
        "resolve_conj",
        "resolve_neg",
        "contiguous",
    ]
}


def qwen_coder_1_5b(**over) -> ModelConfig:
    base = dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        qkv_bias=True,
        o_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    )
    return ModelConfig(**{**base, **over})


def random_stage(
    cfg: ModelConfig, dtype: torch.dtype, device: str = "cpu", weights: Path | None = None
) -> StageModel:
    """Layers [0, L/2) with random weights, made without the slow default init; or with
    the weights saved in `weights`, memory-mapped (two processes share their pages)."""
    with torch.device("meta"):
        model = StageModel(cfg, LayerRange(0, cfg.num_layers // 2, cfg.num_layers))
    if weights is not None:
        model.load_state_dict(torch.load(weights, mmap=True), assign=True)
        return model.eval()
    if device == "meta":
        return model.to(dtype)
    model = model.to_empty(device=device)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.to(dtype).eval()


def fill(stage: StageRuntime, rid: str, n: int) -> None:
    """`n` committed rows in the request's cache without computing them."""
    stage._cache(rid).append_committed(n)


def tree_rows(rid: str, rows: int, first_id: int) -> Activation:
    ids = torch.arange(first_id, first_id + rows)
    return Activation(
        rid,
        torch.full((rows,), CONTEXT),
        node_ids=ids,
        parent_ids=torch.full((rows,), -1),
        tokens=torch.randint(0, 500, (rows,)),
    )


class Requests:
    """`n` requests on a stage, each with CONTEXT cached tokens; `step` runs `rows` tree
    rows of each, then drops them."""

    def __init__(self, stage: StageRuntime, n: int, rows: int) -> None:
        self.stage, self.rows, self.next_id = stage, rows, 0
        self.rids = [f"r{i}" for i in range(n)]
        for rid in self.rids:
            stage.open(rid, CONTEXT + rows + 16)
            fill(stage, rid, CONTEXT)

    def step(self) -> float:
        acts = [tree_rows(rid, self.rows, self.next_id) for rid in self.rids]
        t0 = time.perf_counter()
        outs = self.stage.forward_many(acts)
        dt = time.perf_counter() - t0
        assert all(o is not None and not isinstance(o, Exception) for o in outs), outs[:1]
        self.next_id += self.rows
        drop = Prune(
            torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), self.next_id - 1
        )
        for rid in self.rids:
            self.stage.prune(rid, drop)
        return dt

    def close(self) -> None:
        for rid in self.rids:
            self.stage.release(rid)


def bench_forward(dtype: torch.dtype, repeats: int) -> list[dict]:
    cfg = qwen_coder_1_5b()
    model = random_stage(cfg, dtype)
    stage = StageRuntime(model, max_cache_bytes=16 << 30)
    out = []
    for n, rows in SHAPES:
        reqs = Requests(stage, n, rows)
        reqs.step()  # warm-up
        times = [reqs.step() for _ in range(repeats)]
        reqs.close()
        rec = {"requests": n, "rows": rows, "best_s": min(times), "times_s": times}
        print(f"  {dtype!s:15s} {n:3d} x {rows:2d}: best {min(times) * 1e3:8.1f} ms", flush=True)
        out.append(rec)
    del stage, model
    return out


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[f"aten::{func.__name__.split('.')[0]}"] += 1
        return func(*args, **(kwargs or {}))


def bench_ops() -> list[dict]:
    cfg = qwen_coder_1_5b(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4, head_dim=16
    )
    stage = StageRuntime(random_stage(cfg, torch.float32), max_cache_bytes=1 << 30)
    out = []
    for n in (1, 2, 8, 32, 64):
        reqs = Requests(stage, n, 1)
        reqs.step()
        acts = [tree_rows(rid, 1, reqs.next_id) for rid in reqs.rids]
        with OpCounter() as counter:
            outs = stage.forward_many(acts)
        assert all(o is not None and not isinstance(o, Exception) for o in outs), outs[:1]
        reqs.next_id += 1
        reqs.close()
        total = sum(counter.ops.values())
        kernels = sum(v for k, v in counter.ops.items() if k not in ALIASES)
        syncs = {k: v for k, v in counter.ops.items() if k in SYNCING}
        print(
            f"  ops, {n:2d} requests: {total:6d} ({total / (cfg.num_layers // 2):.1f} per layer), "
            f"{kernels} not views, syncing {syncs}"
        )
        out.append(
            {
                "requests": n,
                "ops": total,
                "kernels": kernels,
                "syncing": syncs,
                "by_op": dict(counter.ops.most_common()),
            }
        )
    return out


def bench_chats(budget: int, prompt: int = 40, answer: int = 60) -> dict:
    """Chats without max_tokens opened (capacity = the whole context) and filled with what
    they hold, until the stage refuses one. The model lives on the meta device: only the
    accounting runs."""
    cfg = qwen_coder_1_5b()
    stage = StageRuntime(random_stage(cfg, torch.bfloat16, "meta"), max_cache_bytes=budget)
    capacity = cfg.max_position_embeddings
    n = 0
    try:
        while n < 100_000:
            stage.open(f"c{n}", capacity)
            fill(stage, f"c{n}", prompt + answer)
            n += 1
    except CacheFull as e:
        reason = str(e)
    print(
        f"  chats of {prompt}+{answer} tokens in {budget / (1 << 30):.2f} GiB (bf16): {n} ({reason})"
    )
    return {
        "budget_bytes": budget,
        "held_tokens": prompt + answer,
        "capacity": capacity,
        "chats": n,
        "refusal": reason,
    }


def _best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_attention(dtype: torch.dtype, repeats: int, flex: bool) -> list[dict]:
    """One layer's attention alone (Qwen2.5-1.5B: 12 query heads, 2 K/V heads of 128),
    requests x rows at 1,000 cached tokens each, K/V gathered from a paged pool: one
    SDPA per request (per-request masks), one padded SDPA for the batch (a boolean
    [B, 1, Q, L] mask, grouped heads by `enable_gqa` or by expanding K/V), the engine's
    choice (an additive mask, gathers into reused buffers), and, with `flex`,
    FlexAttention compiled by inductor over the same padded batch."""
    out = [_attention_case(dtype, n, rows, repeats, flex) for n, rows in SHAPES]
    return out


def _attention_case(dtype: torch.dtype, n: int, rows: int, repeats: int, flex: bool) -> dict:
    import torch.nn.functional as F

    heads, kv_heads, d = 12, 2, 128
    length = CONTEXT + rows
    g = torch.Generator().manual_seed(0)
    k_pool = torch.randn(n * length, kv_heads, d, generator=g).to(dtype)
    v_pool = torch.randn(n * length, kv_heads, d, generator=g).to(dtype)
    q = torch.randn(n * rows, heads, d, generator=g).to(dtype)
    slots = torch.randperm(n * length, generator=g).view(n, length)
    # tree rows: each sees the prefix and itself
    mask = torch.zeros(n, rows, length, dtype=torch.bool)
    mask[:, :, :CONTEXT] = True
    mask[:, torch.arange(rows), CONTEXT + torch.arange(rows)] = True

    def per_request():
        outs = []
        for b in range(n):
            keys = k_pool.index_select(0, slots[b]).transpose(0, 1)
            vals = v_pool.index_select(0, slots[b]).transpose(0, 1)
            qb = q[b * rows : (b + 1) * rows].transpose(0, 1)
            outs.append(
                F.scaled_dot_product_attention(
                    qb[None], keys[None], vals[None], attn_mask=mask[b], enable_gqa=True
                )[0]
            )
        return torch.cat(outs, dim=1)

    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))[:, None]
    key_buf = torch.empty(n * length, kv_heads, d, dtype=dtype)
    value_buf = torch.empty(n * length, kv_heads, d, dtype=dtype)

    def engine():  # what common/model/layers.py runs
        flat = slots.view(-1)
        keys = torch.index_select(k_pool, 0, flat, out=key_buf).view(n, length, kv_heads, d)
        vals = torch.index_select(v_pool, 0, flat, out=value_buf).view(n, length, kv_heads, d)
        qb = q.view(n, rows, heads, d).transpose(1, 2)
        return F.scaled_dot_product_attention(
            qb, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=additive, enable_gqa=True
        )

    def batched(expand: bool):
        def run():
            flat = slots.view(-1)
            keys = k_pool.index_select(0, flat).view(n, length, kv_heads, d).transpose(1, 2)
            vals = v_pool.index_select(0, flat).view(n, length, kv_heads, d).transpose(1, 2)
            qb = q.view(n, rows, heads, d).transpose(1, 2)
            if expand:
                rep = heads // kv_heads
                keys = keys.repeat_interleave(rep, dim=1)
                vals = vals.repeat_interleave(rep, dim=1)
            return F.scaled_dot_product_attention(
                qb, keys, vals, attn_mask=mask[:, None], enable_gqa=not expand
            )

        return run

    variants = {
        "per_request_s": per_request,
        "batched_gqa_s": batched(False),
        "batched_expand_s": batched(True),
        "engine_s": engine,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up
    for _ in range(repeats):  # round robin: a change of load hits every variant alike
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    rec: dict = {"requests": n, "rows": rows, **{k: min(v) for k, v in times.items()}}
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def mask_mod(b, h, qi, ki):
            return mask[b, qi, ki]

        block = create_block_mask(mask_mod, n, None, rows, length, device="cpu")
        compiled = torch.compile(flex_attention, dynamic=False)

        def run_flex():
            flat = slots.view(-1)
            keys = k_pool.index_select(0, flat).view(n, length, kv_heads, d).transpose(1, 2)
            vals = v_pool.index_select(0, flat).view(n, length, kv_heads, d).transpose(1, 2)
            qb = q.view(n, rows, heads, d).transpose(1, 2)
            return compiled(qb, keys, vals, block_mask=block, enable_gqa=True)

        t0 = time.perf_counter()
        try:
            run_flex()
            rec["flex_compile_s"] = time.perf_counter() - t0
            rec["flex_s"] = _best(run_flex, repeats)
        except Exception as e:  # inductor's CPU flex kernel does not take every shape
            rec["flex_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    print(
        f"  attention {dtype!s:15s} {n:3d} x {rows:2d}: "
        + ", ".join(
            f"{k} {v * 1e3:.2f} ms" if isinstance(v, float) else f"{k} {v}"
            for k, v in rec.items()
            if k.endswith("_s") or k.endswith("error")
        ),
        flush=True,
    )
    return rec


def worker() -> None:
    """Serve the A/B driver: one JSON command a line on stdin, one JSON answer on stdout."""
    import sys

    stage: StageRuntime | None = None
    reqs: Requests | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        answer: object = "ok"
        if cmd["cmd"] == "load":
            if reqs is not None:
                reqs.close()
            reqs, stage = None, None
            model = random_stage(
                qwen_coder_1_5b(), getattr(torch, cmd["dtype"]), weights=Path(cmd["path"])
            )
            stage = StageRuntime(model, max_cache_bytes=16 << 30)
        elif cmd["cmd"] == "shape":
            assert stage is not None
            if reqs is not None:
                reqs.close()
            reqs = Requests(stage, cmd["n"], cmd["rows"])
            reqs.step()  # warm-up
        elif cmd["cmd"] == "step":
            assert reqs is not None
            answer = reqs.step()
        elif cmd["cmd"] == "ops":
            answer = bench_ops()
        elif cmd["cmd"] == "chats":
            answer = bench_chats(cmd["budget"])
        print(json.dumps(answer), flush=True)


class _Worker:
    def __init__(self, python: str) -> None:
        import subprocess

        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )

    def ask(self, **cmd) -> object:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        while True:  # the worker's own progress lines are not JSON answers
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the worker died")
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def ab(before_python: str, rounds: int, dtypes: list[str], budget: int) -> dict:
    """Before and after, interleaved: two worker processes (this file under the main
    checkout's Python, and under this one) take turns step by step, the order swapped
    every round, so both see the same load on a shared machine; best of `rounds`."""
    import tempfile

    workers = {"before": _Worker(before_python), "after": _Worker(sys.executable)}
    record: dict = {"rounds": rounds, "load_before": os.getloadavg(), "forward": {}}
    try:
        for name in dtypes:
            dtype = getattr(torch, name)
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "weights.pt"
                torch.save(random_stage(qwen_coder_1_5b(), dtype).state_dict(), path)
                for w in workers.values():
                    w.ask(cmd="load", dtype=name, path=str(path))
                rows_out = []
                for n, rows in SHAPES:
                    for w in workers.values():
                        w.ask(cmd="shape", n=n, rows=rows)
                    times: dict[str, list[float]] = {lb: [] for lb in workers}
                    for r in range(rounds):
                        order = list(workers) if r % 2 == 0 else list(workers)[::-1]
                        for lb in order:
                            times[lb].append(workers[lb].ask(cmd="step"))  # type: ignore[arg-type]
                    rec = {"requests": n, "rows": rows, "times_s": times}
                    rec.update({f"{lb}_best_s": min(ts) for lb, ts in times.items()})
                    print(
                        f"  {name:9s} {n:3d} x {rows:2d}: before {rec['before_best_s'] * 1e3:8.1f} ms, "
                        f"after {rec['after_best_s'] * 1e3:8.1f} ms (best of {rounds})",
                        flush=True,
                    )
                    rows_out.append(rec)
                record["forward"][name] = rows_out
                for w in workers.values():
                    w.ask(cmd="load", dtype=name, path=str(path))  # drop the requests
        for lb, w in workers.items():
            record[f"ops_{lb}"] = w.ask(cmd="ops")
            record[f"chats_{lb}"] = w.ask(cmd="chats", budget=budget)
    finally:
        for w in workers.values():
            w.close()
    record["load_after"] = os.getloadavg()
    return record


def table() -> str:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))}
    labels = list(runs)
    lines = ["| dtype | requests x rows | " + " | ".join(f"{lb} (ms)" for lb in labels) + " |"]
    lines.append("|---|---|" + "---|" * len(labels))
    for dtype in ("float32", "bfloat16"):
        for n, rows in SHAPES:
            cells = []
            for lb in labels:
                recs = [
                    r
                    for r in runs[lb]["forward"].get(dtype, [])
                    if (r["requests"], r["rows"]) == (n, rows)
                ]
                cells.append(f"{recs[0]['best_s'] * 1e3:.0f}" if recs else "-")
            lines.append(f"| {dtype} | {n} x {rows} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "| requests (1 row each) | "
        + " | ".join(f"{lb}: ops / not views / syncing" for lb in labels)
        + " |"
    )
    lines.append("|---|" + "---|" * len(labels))
    for n in (1, 2, 8, 32, 64):
        cells = []
        for lb in labels:
            recs = [r for r in runs[lb]["ops"] if r["requests"] == n]
            cells.append(
                f"{recs[0]['ops']} / {recs[0].get('kernels', '-')} / {sum(recs[0]['syncing'].values())}"
                if recs
                else "-"
            )
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    for lb in labels:
        c = runs[lb]["chats"]
        lines.append(
            f"- {lb}: {c['chats']} chats of {c['held_tokens']} tokens without max_tokens in "
            f"{c['budget_bytes'] / (1 << 30):.2f} GiB"
        )
    return "\n".join(lines)


def _kernels(ops: dict) -> int:
    return sum(v for k, v in ops["by_op"].items() if k not in ALIASES)


def ab_table(rec: dict) -> str:
    """The A/B run as markdown: forward times, operations per step, chats per budget."""
    lines = [
        "| dtype | requests x rows | before: best (median) ms | after: best (median) ms | after / before, best (median) |",
        "|---|---|---|---|---|",
    ]
    for name, rows in rec["forward"].items():
        for r in rows:
            b, a = r["before_best_s"], r["after_best_s"]
            mb, ma = (statistics.median(r["times_s"][lb]) for lb in ("before", "after"))
            lines.append(
                f"| {name} | {r['requests']} x {r['rows']} | {b * 1e3:.0f} ({mb * 1e3:.0f}) | "
                f"{a * 1e3:.0f} ({ma * 1e3:.0f}) | {a / b:.2f} ({ma / mb:.2f}) |"
            )
    lines += [
        "",
        "| requests (1 row each) | before: ops / not views / syncing | after: ops / not views / syncing |",
        "|---|---|---|",
    ]
    for b, a in zip(rec["ops_before"], rec["ops_after"], strict=True):
        cell = lambda r: f"{r['ops']} / {_kernels(r)} / {sum(r['syncing'].values())}"  # noqa: E731
        lines.append(f"| {b['requests']} | {cell(b)} | {cell(a)} |")
    lines.append("")
    for lb in ("before", "after"):
        c = rec[f"chats_{lb}"]
        lines.append(
            f"- {lb}: {c['chats']} chats of {c['held_tokens']} tokens without max_tokens in "
            f"{c['budget_bytes'] / (1 << 30):.2f} GiB (capacity {c['capacity']} rows each)"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="after")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--skip-forward", action="store_true")
    ap.add_argument("--chat-budget-gib", type=float, default=4.0)
    ap.add_argument("--table", action="store_true", help="print the comparison of saved runs")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--ab",
        metavar="BEFORE_PYTHON",
        help="before and after interleaved; BEFORE_PYTHON runs the code before (e.g. "
        "/work/main/.venv/bin/python); saves results/engine/ab.json",
    )
    ap.add_argument("--attention", action="store_true", help="only the attention variants")
    ap.add_argument("--flex", action="store_true", help="with --attention: FlexAttention too")
    args = ap.parse_args()
    if args.table:
        print(table())
        return
    if args.worker:
        worker()
        return
    if args.ab:
        rec = ab(
            args.ab, args.repeats, args.dtypes.split(","), int(args.chat_budget_gib * (1 << 30))
        )
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "ab.json").write_text(json.dumps(rec, indent=1))
        print(ab_table(rec))
        return
    if args.attention:
        res = {
            name: bench_attention(getattr(torch, name), args.repeats, args.flex)
            for name in args.dtypes.split(",")
        }
        RESULTS.mkdir(parents=True, exist_ok=True)
        name = "attention-flex.json" if args.flex else "attention.json"
        (RESULTS / name).write_text(json.dumps(res, indent=1))
        return
    record: dict = {
        "label": args.label,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_before": os.getloadavg(),
        "forward": {},
    }
    print("chats without max_tokens:")
    record["chats"] = bench_chats(int(args.chat_budget_gib * (1 << 30)))
    print("operations per stage step:")
    record["ops"] = bench_ops()
    if not args.skip_forward:
        print(f"forward of one stage, {CONTEXT} cached tokens per request:")
        for name in args.dtypes.split(","):
            record["forward"][name] = bench_forward(getattr(torch, name), args.repeats)
    record["load_after"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.label}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
