"""`specpipe selfcheck --device D`: does SpecPipe work on this machine's device, and how
fast is a stage step there? Offline once installed; each part says PASS, FAIL or SKIP.

Parts: the environment (versions, which attention kernel runs our attention's call),
the device tests of the suite, in-process generation on the device against the CPU
(fp64 and fp32 must be exact; bf16 divergence is reported, not hidden), a two-stage
deployment of separate processes on the device with a client (`--device cuda`: one GPU
per stage where there are two, as `specpipe up` places them), and stage-step timings at
1x1, 1x64, 8x8 and 64x1 requests x rows (host time, device time, kernels per step).
`--device cpu` runs the same parts on the CPU with small shapes (CI runs it, so the
check cannot rot); `scripts/gpu_check.sh` is the GPU entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .args import add_device_arg, parse_device

PARTS = ("environment", "tests", "generation", "services", "timings")
SHAPES = (1, 1), (1, 64), (8, 8), (64, 1)  # requests x rows per request in one step
TINY = dict(layers=4, hidden=48, heads=6, kv_heads=2, vocab=97, init=0.6)
PROMPT = [1, 5, 9, 14, 3, 27, 8, 60, 2, 11]


@dataclass
class Part:
    name: str
    status: str = "PASS"  # PASS, FAIL or SKIP
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0
    data: dict = field(default_factory=dict)

    def say(self, line: str) -> None:
        self.lines.append(line)

    def fail(self, line: str) -> None:
        self.status = "FAIL"
        self.say(line)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "selfcheck", help="check that SpecPipe works on a device and time a stage step there"
    )
    add_device_arg(p)
    p.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated parts to run (default: all of {', '.join(PARTS)})",
    )
    p.add_argument(
        "--timing-shape",
        choices=("qwen2.5-1.5b", "tiny"),
        default=None,
        help="stage timed: half of Qwen2.5-Coder-1.5B (14 layers, random weights; default "
        "on CUDA) or a tiny model (default on the CPU)",
    )
    p.add_argument("--context", type=int, default=None, help="cached tokens per request timed")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results here")
    p.set_defaults(func=_cmd_selfcheck)


def _cmd_selfcheck(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from .args import CliError

    hf_logging.disable_progress_bar()  # the random checkpoints' "Writing model shards"
    device = parse_device(args.device)
    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(wanted) - set(PARTS))
    if unknown:
        raise CliError(f"--parts: unknown {', '.join(unknown)} (choose from {', '.join(PARTS)})")
    on_gpu = device.startswith("cuda")
    shape = args.timing_shape or ("qwen2.5-1.5b" if on_gpu else "tiny")
    context = args.context if args.context is not None else (1000 if on_gpu else 64)
    runners: dict[str, Callable[[Part], None]] = {
        "environment": lambda part: _environment(part, device),
        "tests": lambda part: _tests(part, device),
        "generation": lambda part: _generation(part, device),
        "services": lambda part: _services(part, device),
        "timings": lambda part: _timings(part, device, shape, context),
    }
    results = []
    for name in wanted:
        part = Part(name)
        t0 = time.monotonic()
        try:
            runners[name](part)
        except Exception as e:  # a part that crashes fails; the others still run
            part.fail(f"crashed: {type(e).__name__}: {e}")
            part.say(traceback.format_exc(limit=4).rstrip())
        part.seconds = round(time.monotonic() - t0, 1)
        print(f"[{part.status}] {name} ({part.seconds} s)")
        for line in part.lines:
            print(f"    {line}")
        sys.stdout.flush()
        results.append(part)
    verdict = "FAIL" if any(p.status == "FAIL" for p in results) else "PASS"
    print(f"selfcheck on {device}: {verdict}")
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {"device": device, "verdict": verdict, "parts": [asdict(p) for p in results]},
                indent=2,
            )
        )
    return 0 if verdict == "PASS" else 1


# -- environment -------------------------------------------------------------------------
def _environment(part: Part, device: str) -> None:
    import torch

    part.say(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
             f"CUDA build {torch.version.cuda or 'none'}")  # fmt: skip
    if device.startswith("cuda"):
        idx = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(idx)
        free, total = torch.cuda.mem_get_info(idx)
        part.say(f"{props.name}: compute capability {props.major}.{props.minor}, "
                 f"{total / 2**30:.0f} GiB ({free / 2**30:.0f} GiB free), "
                 f"{torch.cuda.device_count()} visible")  # fmt: skip
    else:
        part.say(f"CPU: {os.cpu_count()} cores, {torch.get_num_threads()} torch threads")
    kernels = attention_kernels(device)
    part.data["attention_kernels"] = kernels
    runs = [k for k, ok in kernels.items() if ok]
    part.say("attention (bool tree mask, grouped K/V heads): " + (
        ", ".join(f"{k} {'runs' if ok else 'refuses'}" for k, ok in kernels.items())))  # fmt: skip
    if not runs:
        part.fail("no attention kernel runs our attention call")


def attention_kernels(device: str) -> dict[str, bool]:
    """Which of PyTorch's SDPA kernels accept the call a stage makes: a boolean mask over
    [cached + new] rows and fewer K/V heads than query heads (enable_gqa)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    q = torch.randn(1, 12, 8, 128, device=device, dtype=dtype)
    k = torch.randn(1, 2, 72, 128, device=device, dtype=dtype)
    v = torch.randn_like(k)
    mask = torch.ones(8, 72, dtype=torch.bool, device=device).tril(64)
    out = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):  # fmt: skip
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            out[backend.name.lower()] = True
        except RuntimeError:
            out[backend.name.lower()] = False
    return out


# -- the suite's device tests ------------------------------------------------------------
DEVICE_TESTS = ("tests/unit/test_services_device.py", "tests/unit/test_sampling.py",
                "tests/unit/test_clock.py", "tests/unit/test_transport_device.py")  # fmt: skip


def _tests(part: Part, device: str) -> None:
    root = Path(__file__).resolve().parents[2]
    files = [f for f in DEVICE_TESTS if (root / f).exists()]
    if not files:
        part.status = "SKIP"
        part.say(f"no test files under {root} (an installed package carries no tests)")
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *files]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    tail = [ln for ln in proc.stdout.splitlines() if ln.strip()][-6:]
    for line in tail:
        part.say(line)
    if proc.returncode != 0:
        part.fail(f"pytest exited {proc.returncode}")


# -- generation on the device against the CPU ----------------------------------------
def _generation_runs(model: Path, device: str, dtype: str) -> dict[str, list[int]]:
    """Tokens of every mode, greedy and sampled, in one process on `device`."""
    from specpipe.common.runtime.loader import build_local, parse_dtype
    from specpipe.common.runtime.lockstep import Generation
    from specpipe.common.spec.options import DecodeOptions
    from specpipe.common.spec.sampling import SamplingParams

    dep = build_local(model, 2, model, parse_dtype(dtype), device=device)
    out = {}
    for mode in ("specpipe", "pp", "specinfer"):
        for label, sampling in (("greedy", SamplingParams()),
                                ("sampled", SamplingParams(0.8, 0, 0.95, 7))):  # fmt: skip
            opts = DecodeOptions(max_new_tokens=24, sampling=sampling, width=4)
            gen = Generation(dep.pipeline, dep.draft, PROMPT, mode, opts)
            out[f"{mode}/{label}"] = gen.run()
    return out


def _generation(part: Part, device: str) -> None:
    from specpipe.common.model.synthetic import save_random_model

    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_model(Path(tmp) / "tiny", **TINY)
        for dtype in ("float64", "float32"):
            ref = _generation_runs(model, "cpu", dtype)
            got = _generation_runs(model, device, dtype)
            bad = [k for k in ref if ref[k] != got[k]]
            if bad:
                part.fail(f"{dtype}: {len(bad)} of {len(ref)} runs differ from the CPU: {bad}")
            else:
                part.say(f"{dtype}: {len(ref)} runs (3 modes, greedy and sampled) equal the CPU's")
        if device.startswith("cuda"):
            ref = _generation_runs(model, "cpu", "float32")
            got = _generation_runs(model, device, "bfloat16")
            diverged = {k: _first_difference(ref[k], got[k]) for k in ref if ref[k] != got[k]}
            part.data["bf16_diverged"] = diverged
            part.say(f"bfloat16 on {device} against float32 on the CPU: {len(diverged)} of "
                     f"{len(ref)} runs diverge" + (f" (first differing position: {diverged})"
                                                   if diverged else ""))  # fmt: skip


def _first_difference(a: list[int], b: list[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


# -- a deployment of separate processes on the device ----------------------------------
def _services(part: Part, device: str) -> None:
    from specpipe.client import Client
    from specpipe.common.model.synthetic import save_random_model
    from specpipe.services.launcher import ServicesDeployment

    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_model(Path(tmp) / "tiny", **TINY)
        ref = _generation_runs(model, "cpu", "float64")
        dep = ServicesDeployment(model, "oracle", 2, dtype="float64", device=device, threads=1,
                                 log_dir=Path(tmp) / "logs")  # fmt: skip
        try:
            dep.start()
            part.say("router, draft and 2 stages started, each stage and the draft on:")
            for line in [*dep.placement.report(), dep.data_plane()]:
                part.say(f"  {line}")
            part.data["devices"] = dep.placement.devices
            key = dep.api_keys[0] if dep.api_keys else None
            with Client(dep.router_address, timeout=120, api_key=key) as client:
                for mode in ("specpipe", "pp"):
                    result = client.generate(
                        prompt_ids=PROMPT, mode=mode, max_new_tokens=24, width=4
                    )
                    want = ref[f"{mode}/greedy"]
                    if list(result.token_ids) != want:
                        part.fail(f"{mode}: the services' tokens differ from in-process: "
                                  f"{list(result.token_ids)} vs {want}")  # fmt: skip
                    else:
                        part.say(f"{mode}: {len(want)} tokens equal the in-process run's")
        finally:
            dep.stop()


# -- stage-step timings ----------------------------------------------------------------
def _timings(part: Part, device: str, shape: str, context: int) -> None:
    import torch

    from specpipe.common.model.partition import LayerRange
    from specpipe.common.model.synthetic import QWEN25_1_5B, random_stage
    from specpipe.common.runtime.stage import StageRuntime

    if shape == "qwen2.5-1.5b":
        raw, layers, dtype = QWEN25_1_5B, LayerRange(0, 14, 28), torch.bfloat16
    else:
        raw = {**QWEN25_1_5B, "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
        layers, dtype = LayerRange(0, 2, 4), torch.float32
    runtime = StageRuntime(random_stage(raw, layers, dtype, device))
    part.say(f"stage: layers {layers.start}:{layers.end} of a {raw['num_hidden_layers']}-layer "
             f"model of hidden {raw['hidden_size']} ({shape}), {str(dtype)[6:]}, "
             f"{context} cached tokens per request")  # fmt: skip
    part.say(f"{'requests x rows':>16} {'host ms':>9} {'device ms':>10} {'kernels':>8}")
    for requests, rows in SHAPES:
        t = time_step(runtime, requests, rows, context)
        part.data[f"{requests}x{rows}"] = t
        part.say(f"{f'{requests} x {rows}':>16} {t['host_ms']:>9.2f} {t['device_ms']:>10.2f} "
                 f"{t['kernels']:>8}")  # fmt: skip


def time_step(runtime, requests: int, rows: int, context: int, repeats: int = 5) -> dict:
    """One stage step of `requests` x `rows` tree rows: the host's time to issue it (the
    clock read without waiting for the device), the device's time (waiting for it), and
    the kernels (CUDA) or aten operations (CPU) it runs."""
    import statistics

    import torch

    from specpipe.common.perf.clock import device_timer, synchronize
    from specpipe.common.perf.cost_model import StepProbe

    device = runtime.model.device
    host, dev = [], []
    with torch.inference_mode(), StepProbe(runtime, context, requests, requests * rows) as probe:
        for i in range(repeats + 1):  # the first warms up
            acts = probe.batch(requests * rows)
            synchronize(device)
            with device_timer(device) as elapsed:
                t0 = time.perf_counter()
                runtime.forward_many(acts)
                issued = time.perf_counter() - t0
            if i:
                host.append(issued)
                dev.append(elapsed.seconds)
            probe.drop()
        kernels = count_kernels(lambda: runtime.forward_many(probe.batch(requests * rows)), device)
        probe.drop()
    return {"host_ms": 1e3 * statistics.median(host), "device_ms": 1e3 * statistics.median(dev),
            "kernels": kernels}  # fmt: skip


def count_kernels(fn: Callable[[], object], device) -> int:
    """Kernels `fn` launches on a CUDA device, or aten operations it runs on the CPU."""
    import torch

    if torch.device(device).type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n
