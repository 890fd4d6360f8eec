"""`specpipe selfcheck`'s step timings: both stages of a Qwen2.5-Coder-1.5B-shaped model
(random weights made on the device), the draft's forward (Qwen2.5-Coder-0.5B-shaped),
and transformers' eager forward of the whole model on the same shapes, each as the
device's busy time per step from the profiler beside the weight-read floor (the stage's
weights at the bandwidth a device-to-device copy reaches), with the kernels per step and
the attention kernels that ran. On the CPU the same with tiny shapes (the "device" is
the CPU: busy time is the step's wall time, kernels are aten operations).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

SHAPES = (1, 1), (8, 8), (64, 1)  # requests x tree rows per request in one step
QWEN25_0_5B = {  # Qwen2.5-Coder-0.5B's config.json: the draft of the 1.5B target
    "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": True,
}  # fmt: skip
TINY_SHAPE = {"vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
# Substrings of the names of fused attention kernels (CUDA) and SDPA's operations.
ATTENTION_KERNELS = {
    "flash": ("flash_fwd", "pytorch_flash", "_flash_attention", "flash_attention"),
    "efficient": ("fmha_cutlass", "efficient_attention", "mem_efficient"),
    "cudnn": ("cudnn_attention", "cudnn_generated", "sdpa_fprop", "fprop_sdpa"),
    "flex": ("flex_attention", "triton_tem_fused"),
    "flashinfer": ("BatchPrefillWithPagedKVCache", "BatchDecodeWithPagedKVCache"),
    "math": ("_scaled_dot_product_attention_math", "attention_math"),
}


@dataclass(frozen=True)
class Shapes:
    """What is timed: the target's config (both stages), the draft's, dtype, context."""

    target: dict
    draft: dict
    dtype: torch.dtype
    context: int
    label: str

    @classmethod
    def for_device(cls, device: str, shape: str | None, context: int | None) -> Shapes:
        from specpipe.common.model.synthetic import QWEN25_1_5B

        on_gpu = device.startswith("cuda")
        shape = shape or ("qwen2.5-1.5b" if on_gpu else "tiny")
        context = context if context is not None else (1000 if on_gpu else 64)
        if shape == "qwen2.5-1.5b":
            return cls(QWEN25_1_5B, QWEN25_0_5B, torch.bfloat16, context, shape)
        tiny = {**QWEN25_1_5B, **TINY_SHAPE}
        draft = {**tiny, "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128}
        return cls(tiny, draft, torch.float32, context, shape)


# -- measuring ---------------------------------------------------------------------------
def copy_bandwidth(device: str) -> float:
    """Bytes per second a device-to-device copy moves, reads and writes counted: the
    memory's bandwidth, which a step reading its weights once can at best reach (the
    floor: weight bytes / this; issue 38's 0.30 ms for stage 0's 1.31 GB at 4.3 TB/s)."""
    from specpipe.common.perf.clock import device_timer, measuring_costs

    n = (1 << 30) if device.startswith("cuda") else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm
    with measuring_costs(), device_timer(device) as elapsed:
        for _ in range(5):
            dst.copy_(src)
    return 5 * 2 * n / elapsed.seconds


def profile_step(fn: Callable[[], object], device: str, repeats: int | None = None) -> dict:
    """The device's busy time per call of `fn` (the union of its kernels' intervals, from
    the profiler), kernels per call, and which attention kernels and SDPA operations ran.
    On the CPU: the call's wall time and its aten operations."""
    from torch.profiler import ProfilerActivity, profile

    from specpipe.common.perf.clock import synchronize

    on_gpu = device.startswith("cuda")
    repeats = repeats or (3 if on_gpu else 1)
    fn()  # warm (allocations, kernel selection)
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        walls = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            walls.append(time.perf_counter() - t0)
    events = list(prof.events())
    names = {e.name for e in events}
    sdpa = sorted(n for n in names if "scaled_dot_product" in n or "attention" in n.lower())
    ran = sorted(
        kind
        for kind, marks in ATTENTION_KERNELS.items()
        if any(m in n for n in names for m in marks)
    )
    if on_gpu:
        spans = sorted(
            (e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA"
        )
        busy, end = 0.0, float("-inf")
        for s, e in spans:  # union of intervals, microseconds
            busy += max(0.0, e - max(s, end))
            end = max(end, e)
        busy_ms, kernels = busy / 1e3 / repeats, len(spans) // repeats
    else:  # the CPU runs the work as it is issued: busy is the wall time
        busy_ms = 1e3 * statistics.median(walls)
        kernels = sum(1 for e in events if e.name.startswith("aten::")) // repeats
    return {
        "busy_ms": round(busy_ms, 4),
        "wall_ms": round(1e3 * statistics.median(walls), 4),
        "kernels": kernels,
        "attention": ran or ["none seen"],
        "sdpa_ops": sdpa[:6],
    }


# -- the stages and the draft ------------------------------------------------------------
def time_stages(part, device: str, shapes: Shapes) -> None:
    """Both stages of the target (the last with its LM head), then the draft."""
    from specpipe.common.model.partition import LayerRange
    from specpipe.common.model.synthetic import random_stage
    from specpipe.common.perf.cost_model import StepProbe
    from specpipe.common.runtime.draft import DraftRuntime
    from specpipe.common.runtime.stage import StageRuntime

    bandwidth = copy_bandwidth(device)
    part.data["copy_gb_per_s"] = round(bandwidth / 1e9, 1)
    part.say(f"device copy: {bandwidth / 1e9:.0f} GB/s (read + write); shapes {shapes.label}, "
             f"{str(shapes.dtype)[6:]}, {shapes.context} cached tokens per request")  # fmt: skip
    part.say(f"{'':>7} {'req x rows':>10} {'busy ms':>8} {'floor ms':>8} {'x floor':>7} "
             f"{'wall ms':>8} {'kernels':>7}  attention")  # fmt: skip
    layers = shapes.target["num_hidden_layers"]
    half = layers // 2
    budget = _cache_budget(shapes, device)
    runs: list[tuple[str, Callable[[], object], str]] = [
        ("stage0", lambda: StageRuntime(
            random_stage(shapes.target, LayerRange(0, half, layers), shapes.dtype, device), budget
        ), "stage"),
        ("stage1", lambda: StageRuntime(
            random_stage(shapes.target, LayerRange(half, layers, layers), shapes.dtype, device), budget
        ), "stage"),
        ("draft", lambda: DraftRuntime(random_stage(
            shapes.draft, LayerRange(0, shapes.draft["num_hidden_layers"],
                                     shapes.draft["num_hidden_layers"]), shapes.dtype, device), budget
        ), "draft"),
    ]  # fmt: skip
    for name, build, kind in runs:
        built = build()
        runtime = built.runtime if kind == "draft" else built
        weights = runtime.model.num_bytes()
        floor_ms = 1e3 * weights / bandwidth  # each weight read once per step
        part.data[name] = {"weight_bytes": weights, "floor_ms": round(floor_ms, 4)}
        with torch.inference_mode():
            for requests, rows in SHAPES:
                with StepProbe(runtime, shapes.context, requests, requests * rows) as probe:
                    step = _stepper(
                        built if kind == "draft" else None, runtime, probe, requests * rows
                    )
                    t = profile_step(step, device)
                t["x_floor"] = round(t["busy_ms"] / floor_ms, 2) if floor_ms else None
                part.data[name][f"{requests}x{rows}"] = t
                part.say(f"{name:>7} {f'{requests} x {rows}':>10} {t['busy_ms']:>8.3f} "
                         f"{floor_ms:>8.3f} {t['x_floor']:>7} {t['wall_ms']:>8.3f} "
                         f"{t['kernels']:>7}  {','.join(t['attention'])}")  # fmt: skip
        built = runtime = None
        _free(device)


def _stepper(draft, runtime, probe, rows: int) -> Callable[[], None]:
    """One step of `rows` tree rows: the stage's forward, or the draft's proposal (its
    forward, top-k and the candidates' copy to the host)."""
    from specpipe.common.perf.cost_model import stage_step
    from specpipe.common.runtime.draft import Proposal

    def step() -> None:
        if draft is not None:
            draft.propose_many([Proposal(a, 4) for a in probe.batch(rows)])
        else:
            stage_step(runtime, probe.batch(rows))
        probe.drop()

    return step


def _cache_budget(shapes: Shapes, device: str) -> int:
    """KV bytes for the largest timed step of any of the models, with room to spare."""
    cfgs = (shapes.target, shapes.draft)
    per_token = max(
        2 * c["num_hidden_layers"] * c["num_key_value_heads"]
        * (c["hidden_size"] // c["num_attention_heads"]) * shapes.dtype.itemsize
        for c in cfgs
    )  # fmt: skip
    tokens = max(r * (shapes.context + r * q + 16) for r, q in SHAPES) + 64 * 16 * 8
    return 2 * per_token * tokens


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# -- transformers' eager forward, the reference --------------------------------------------
def time_reference(part, device: str, shapes: Shapes) -> None:
    """transformers' Qwen2 (eager attention) of the target's shape on the same device,
    dtype and shapes: a forward of `rows` new tokens for each of `requests` sequences
    over `context` cached tokens (a chain, not a tree: transformers has no tree mask)."""
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{k: v for k, v in shapes.target.items() if k != "model_type"})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(shapes.dtype).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device)
    floor_ms = 1e3 * weights / bandwidth
    part.data["model"] = {"weight_bytes": weights, "floor_ms": round(floor_ms, 4),
                          "transformers": __import__("transformers").__version__}  # fmt: skip
    part.say(f"transformers {part.data['model']['transformers']} Qwen2 eager, whole model "
             f"({weights / 1e9:.2f} GB), {shapes.context} cached tokens")  # fmt: skip
    part.say(f"{'req x rows':>10} {'busy ms':>8} {'floor ms':>8} {'x floor':>7} {'kernels':>7}")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for requests, rows in SHAPES:
            vocab = config.vocab_size
            prompt = torch.randint(0, vocab, (requests, shapes.context), generator=gen)
            new = torch.randint(0, vocab, (requests, rows), generator=gen).to(device)
            cache = DynamicCache()
            model(prompt.to(device), past_key_values=cache, use_cache=True)

            def step(cache=cache, new=new) -> None:
                model(new, past_key_values=cache, use_cache=True)
                if hasattr(cache, "crop"):
                    cache.crop(-new.shape[1])  # back to the context (negative: v4 and v5)

            if not hasattr(cache, "crop"):  # each call on a fresh copy of the cache
                base = copy.deepcopy(cache)
                step = lambda base=base, new=new: model(  # noqa: E731
                    new, past_key_values=copy.deepcopy(base), use_cache=True
                )
            t = profile_step(step, device)
            t["x_floor"] = round(t["busy_ms"] / floor_ms, 2)
            part.data[f"{requests}x{rows}"] = t
            part.say(f"{f'{requests} x {rows}':>10} {t['busy_ms']:>8.3f} {floor_ms:>8.3f} "
                     f"{t['x_floor']:>7} {t['kernels']:>7}")  # fmt: skip
            del cache
    model.to("meta")  # its memory back before the next part
    _free(device)
