"""Benchmark of the network services (not a test).

1. Time between tokens (TBT) of `specpipe` and `pp` through a local multi-process
   deployment (`specpipe up`'s launcher), and of `autoregressive` decoding of the same
   target in this one process, on the same prompts; printed as ratios.
2. Per-hop latency of hidden states over UCX and over the TCP fallback, for 1, 16 and
   64 tokens of `--hidden` floats: a frame goes to an echo process and back; half the
   round trip is reported (median and p90).

Without --target, the models are made on the fly: a random Llama whose layers after
the first barely change the residual stream, and as draft its own first layer with the
same embedding and head (a self-speculative draft). The draft then agrees with the
target most of the time at a fraction of its cost, which is the regime SpecPipe is
built for; random models with a random draft would never hit. Wall-clock figures are
from this machine, all processes sharing its CPUs: compare ratios, not absolutes.

    python benchmarks/bench_services.py [--transport tcp] [--stages 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


# -- models --------------------------------------------------------------------------------
def make_models(
    root: Path, hidden: int, layers: int, vocab: int, seed: int = 0
) -> tuple[Path, Path]:
    """Synthetic target and its first-layer draft (see the module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=2048,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=vocab - 1,
    )
    target = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **cfg)).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.normal_(0, 1.0)
        target.lm_head.weight.normal_(0, 0.5)
        for i, layer in enumerate(target.model.layers):
            scale = 1.0 if i == 0 else 0.15  # later layers nudge the first one's prediction
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    target_dir, draft_dir = root / "target", root / "draft"
    target.save_pretrained(target_dir)
    draft = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, **cfg)).eval()
    state = {
        k: v
        for k, v in target.state_dict().items()
        if not k.startswith("model.layers.") or k.startswith("model.layers.0.")
    }
    draft.load_state_dict(state)
    draft.save_pretrained(draft_dir)
    return target_dir, draft_dir


def prompts(n: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]


# -- time between tokens --------------------------------------------------------------------
def tbt_of(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")


def run_service_mode(address: str, mode: str, prompt_set, max_new: int, width: int) -> dict:
    from specpipe.client import Client

    tbts, hits, tps, outputs = [], [], [], []
    with Client(address, timeout=600) as client:
        client.generate(
            prompt_ids=prompt_set[0][:4], mode=mode, max_new_tokens=4, ignore_eos=True, width=width
        )
        for p in prompt_set:
            stream = client.stream(
                prompt_ids=p, mode=mode, max_new_tokens=max_new, ignore_eos=True, width=width
            )
            times = []
            for chunk in stream:
                now = time.perf_counter()
                times.extend([now] * len(chunk.token_ids))
            done = stream.result()
            tbts.append(tbt_of(times))
            hits.append(done.stats["hit_rate"])
            tps.append(done.stats["tokens_per_step"])
            outputs.append(done.token_ids)
    return {
        "tbt_ms": 1e3 * statistics.mean(tbts),
        "tbt_ms_per_prompt": [round(1e3 * t, 3) for t in tbts],
        "hit_rate": statistics.mean(hits),
        "tokens_per_step": statistics.mean(tps),
        "outputs": outputs,
    }


def run_autoregressive(target: Path, prompt_set, max_new: int, threads: int) -> dict:
    from specpipe.common.runtime.loader import build_local
    from specpipe.common.runtime.lockstep import LockstepGeneration
    from specpipe.common.spec.options import DecodeOptions

    torch.set_num_threads(threads)
    dep = build_local(target, 1)
    opts = DecodeOptions(max_new_tokens=max_new)
    LockstepGeneration(
        dep.pipeline, None, prompt_set[0][:4], "autoregressive", DecodeOptions(max_new_tokens=4)
    ).run()
    tbts, outputs = [], []
    for p in prompt_set:
        times = []
        gen = LockstepGeneration(dep.pipeline, None, p, "autoregressive", opts)
        for _ in gen:
            times.append(time.perf_counter())
        tbts.append(tbt_of(times))
        outputs.append(gen.output)
    return {
        "tbt_ms": 1e3 * statistics.mean(tbts),
        "tbt_ms_per_prompt": [round(1e3 * t, 3) for t in tbts],
        "outputs": outputs,
    }


def bench_tbt(args, target: Path, draft: Path) -> dict:
    from specpipe.common.model.config import ModelConfig
    from specpipe.services.launcher import ServicesDeployment

    prompt_set = prompts(args.prompts, args.prompt_len, ModelConfig.from_dir(target).vocab_size)
    dep = ServicesDeployment(
        target, draft, args.stages, transport=args.transport, threads=args.threads
    )
    print(f"starting {args.stages} stages + draft + router ({args.transport}) ...", flush=True)
    dep.start()
    try:
        results = {}
        for mode in ("pp", "specpipe"):
            results[mode] = run_service_mode(
                dep.router_address, mode, prompt_set, args.max_new_tokens, args.width
            )
            print(
                f"  {mode:9s} TBT {results[mode]['tbt_ms']:8.2f} ms  tokens/step {results[mode]['tokens_per_step']:.3f}  hit rate {results[mode]['hit_rate']:.3f}",
                flush=True,
            )
    finally:
        dep.stop()
    results["autoregressive"] = run_autoregressive(
        target, prompt_set, args.max_new_tokens, args.threads or os.cpu_count() or 1
    )
    print(
        f"  {'autoreg.':9s} TBT {results['autoregressive']['tbt_ms']:8.2f} ms  (one process, whole target)",
        flush=True,
    )
    same = all(
        results[m]["outputs"] == results["autoregressive"]["outputs"] for m in ("pp", "specpipe")
    )
    for m in results.values():
        m.pop("outputs")
    sp, pp, ar = (results[m]["tbt_ms"] for m in ("specpipe", "pp", "autoregressive"))
    ratios = {
        "pp_over_specpipe": pp / sp,
        "autoregressive_over_specpipe": ar / sp,
        "pp_over_autoregressive": pp / ar,
    }
    print(f"  ratios: TBT(pp)/TBT(specpipe) = {ratios['pp_over_specpipe']:.2f}, "
          f"TBT(autoregressive)/TBT(specpipe) = {ratios['autoregressive_over_specpipe']:.2f}, "
          f"TBT(pp)/TBT(autoregressive) = {ratios['pp_over_autoregressive']:.2f}; "
          f"identical tokens in all modes: {same}", flush=True)  # fmt: skip
    return {
        "modes": results,
        "ratios": ratios,
        "identical_tokens": same,
        "prompts": len(prompt_set),
    }


# -- per-hop latency ----------------------------------------------------------------------
async def _hops(kind: str, hidden: int, sizes: list[int], iters: int) -> dict:
    from specpipe.common.spec.messages import Activation
    from specpipe.services.transport import make_transport
    from specpipe.services.transport.codec import encode

    port_file = Path(tempfile.mkdtemp()) / "echo"
    echo = subprocess.Popen([sys.executable, str(HERE / "hop_echo.py"), kind, str(port_file)])
    try:
        while not port_file.is_file() or not port_file.read_text():
            await asyncio.sleep(0.05)
            if echo.poll() is not None:
                raise RuntimeError(f"{kind} echo process exited ({echo.returncode})")
        peer = port_file.read_text()
        queue: asyncio.Queue = asyncio.Queue()
        transport = make_transport(kind, queue.put_nowait)
        me = await transport.start()
        out = {}
        try:
            for n in sizes:
                act = Activation("hop", torch.arange(n), node_ids=torch.arange(n), parent_ids=torch.arange(n) - 1,
                                 hidden=torch.randn(n, hidden))  # fmt: skip
                samples = []
                for i in range(iters + 20):
                    t0 = time.perf_counter()
                    header, payload = encode(act, i, 0, me)
                    await transport.send_frame(peer, header, payload)
                    await queue.get()
                    if i >= 20:
                        samples.append((time.perf_counter() - t0) / 2)
                samples.sort()
                out[str(n)] = {
                    "bytes": n * hidden * 4,
                    "median_us": round(1e6 * statistics.median(samples), 1),
                    "p90_us": round(1e6 * samples[int(0.9 * len(samples))], 1),
                }
        finally:
            await transport.close()
        return out
    finally:
        echo.kill()
        echo.wait()


def bench_hops(args) -> dict:
    from specpipe.services.transport.ucx import available

    kinds = ["tcp"] + (["ucx"] if available() else [])
    results = {}
    for kind in kinds:
        results[kind] = asyncio.run(_hops(kind, args.hidden, [1, 16, 64], args.hop_iters))
        for n, r in results[kind].items():
            print(f"  {kind}: {n:>2} tokens x {args.hidden} ({r['bytes'] / 1024:.0f} KiB): one hop "
                  f"{r['median_us']:.0f} us median, {r['p90_us']:.0f} us p90", flush=True)  # fmt: skip
    if "ucx" in results:
        results["tcp_over_ucx_median"] = {
            n: results["tcp"][n]["median_us"] / results["ucx"][n]["median_us"]
            for n in results["tcp"]
        }
    return results


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--target", default=None, help="target model (default: synthetic, made on the fly)"
    )
    p.add_argument("--draft", default=None, help="draft model (with --target)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--transport", choices=["tcp", "ucx"], default="tcp")
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--model-hidden", type=int, default=1024, help="synthetic model width")
    p.add_argument("--model-layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1536, help="hidden size of the per-hop frames")
    p.add_argument("--hop-iters", type=int, default=300)
    p.add_argument("--skip-tbt", action="store_true")
    p.add_argument("--skip-hops", action="store_true")
    p.add_argument("--out", default=str(HERE / "results" / "services.json"))
    args = p.parse_args()

    report: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "args": vars(args),
    }
    if not args.skip_tbt:
        with tempfile.TemporaryDirectory() as tmp:
            if args.target is None:
                target, draft = make_models(
                    Path(tmp), args.model_hidden, args.model_layers, args.vocab
                )
                report["models"] = (
                    f"synthetic Llama {args.model_layers}x{args.model_hidden}, vocab {args.vocab}; draft = its first layer"
                )
            else:
                from specpipe.common.store.resolver import resolve_model

                target, draft = resolve_model(args.target), resolve_model(args.draft)
                report["models"] = f"target {args.target}, draft {args.draft}"
            print(f"time between tokens ({report['models']}):", flush=True)
            report["time_between_tokens"] = bench_tbt(args, target, draft)
    if not args.skip_hops:
        print(
            "per-hop latency of hidden states (half a round trip through an echo process):",
            flush=True,
        )
        report["per_hop_latency"] = bench_hops(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
