"""`specpipe selfcheck --device D`: does SpecPipe work on this machine's device, and how
fast is a step there? Offline once installed; each part says PASS, FAIL or SKIP.

Parts: the environment (versions, which attention kernels accept our attention's call,
the installed packages), the device tests of the suite, in-process generation on the
device against the CPU (fp64 and fp32 must be exact; bf16 divergence is counted, not
hidden), step timings of both stages of a Qwen2.5-Coder-1.5B-shaped model and of its
draft at 1x1, 8x8 and 64x1 requests x rows over 1,000 cached tokens (the device's busy
time from the profiler against the weight-read floor, kernels per step, the attention
kernel that ran; `selfcheck_timing.py`), transformers' eager forward on the same shapes
(the reference), and `specpipe up` with a streamed client (time per token, tokens per
step; `selfcheck_serving.py`). `--part-timeout` runs each part in a process of its own
with a time limit (a hung device fails its part, not the check), within `--deadline`.
`--device cpu` runs the same parts on the CPU with tiny shapes (CI runs it, so the check
cannot rot); `scripts/gpu_check.sh` is the GPU entry point.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .args import add_device_arg, parse_device

# In the order they run: what matters most first, should the time run out.
PARTS = ("environment", "timings", "reference", "generation", "services", "tests")
# Seconds each part may take with --part-timeout on a GPU (8 minutes in all, less than
# their sum: the later parts are skipped if the earlier take their all). On the CPU, a
# shared machine's, only --part-timeout applies.
PART_SECONDS = {"environment": 60, "timings": 150, "reference": 90, "generation": 90,
                "services": 150, "tests": 150}  # fmt: skip
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
        help="models timed: both stages of Qwen2.5-Coder-1.5B and its 0.5B draft (random "
        "weights made on the device; default on CUDA) or tiny ones (default on the CPU)",
    )
    p.add_argument("--context", type=int, default=None, help="cached tokens per request timed")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results here")
    p.add_argument(
        "--part-timeout",
        type=float,
        default=None,
        help="run each part in its own process, stopped after this many seconds or its "
        "own limit, whichever is less (default: in this process, no limit)",
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds for the whole check: parts that would start past it are skipped",
    )
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
    from . import selfcheck_serving, selfcheck_timing

    shapes = selfcheck_timing.Shapes.for_device(device, args.timing_shape, args.context)
    runners: dict[str, Callable[[Part], None]] = {
        "environment": lambda part: _environment(part, device),
        "tests": lambda part: _tests(part, device),
        "generation": lambda part: _generation(part, device),
        "services": lambda part: selfcheck_serving.run_served(part, device, TINY, PROMPT),
        "timings": lambda part: selfcheck_timing.time_stages(part, device, shapes),
        "reference": lambda part: selfcheck_timing.time_reference(part, device, shapes),
    }
    start = time.monotonic()
    results = []
    for name in [p for p in PARTS if p in wanted]:
        left = None if args.deadline is None else args.deadline - (time.monotonic() - start)
        if left is not None and left < 10:
            part = Part(name, "SKIP", [f"no time left within --deadline {args.deadline:.0f} s"])
        elif args.part_timeout is None:
            part = _run_here(name, runners[name])
        else:
            own = PART_SECONDS[name] if device.startswith("cuda") else args.part_timeout
            limit = min(args.part_timeout, own, *(() if left is None else (left,)))
            part = _run_apart(name, args, limit)
        print(f"[{part.status}] {name} ({part.seconds} s)")
        for line in part.lines:
            print(f"    {line}")
        sys.stdout.flush()
        results.append(part)
    verdict = "FAIL" if any(p.status == "FAIL" for p in results) else "PASS"
    print(f"selfcheck on {device}: {verdict} ({time.monotonic() - start:.0f} s; "
          + ", ".join(f"{p.name} {p.status}" for p in results) + ")")  # fmt: skip
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {"device": device, "verdict": verdict, "parts": [asdict(p) for p in results]},
                indent=2,
            )
        )
    return 0 if verdict == "PASS" else 1


def _run_here(name: str, runner: Callable[[Part], None]) -> Part:
    part = Part(name)
    t0 = time.monotonic()
    try:
        runner(part)
    except Exception as e:  # a part that crashes fails; the others still run
        part.fail(f"crashed: {type(e).__name__}: {e}")
        part.say(traceback.format_exc(limit=4).rstrip())
    part.seconds = round(time.monotonic() - t0, 1)
    return part


def _run_apart(name: str, args: argparse.Namespace, limit: float) -> Part:
    """The part in a process of its own, stopped after `limit` seconds (a hung device or
    a crash of the process fails this part; the others still run)."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "part.json"
        cmd = [sys.executable, "-m", "specpipe.cli", "selfcheck", "--device", args.device,
               "--parts", name, "--json", str(out)]  # fmt: skip
        if args.timing_shape:
            cmd += ["--timing-shape", args.timing_shape]
        if args.context is not None:
            cmd += ["--context", str(args.context)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the part's process and what it started
            output, _ = proc.communicate()
            part = Part(name)
            part.fail(f"ran past its {limit:g} s limit; its last output:")
            part.lines += [f"  {ln}" for ln in output.splitlines()[-10:]]
        else:
            if out.exists():
                (got,) = json.loads(out.read_text())["parts"]
                part = Part(**got)
            else:
                part = Part(name)
                part.fail(f"its process exited {proc.returncode} without a result:")
                part.lines += [f"  {ln}" for ln in output.splitlines()[-10:]]
    part.seconds = round(time.monotonic() - t0, 1)
    return part


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
    from specpipe.services.transport.device_memory import cuda_module_error

    ucx = cuda_module_error()
    part.data["ucx_cuda_module"] = ucx or "loads"
    part.say(f"UCX's CUDA module: {ucx or 'loads'}")
    part.data["packages"] = sorted(
        f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
    )  # what download_wheels.py --have may list for this image


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
                "tests/unit/test_clock.py", "tests/unit/test_transport_device.py",
                "tests/unit/test_no_host_reads.py", "tests/unit/test_pool_allocation.py")  # fmt: skip


def _tests(part: Part, device: str) -> None:
    root = Path(__file__).resolve().parents[2]
    files = [f for f in DEVICE_TESTS if (root / f).exists()]
    if not files:
        part.status = "SKIP"
        part.say(f"no test files under {root} (an installed package carries no tests)")
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *files]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    tail = [ln for ln in proc.stdout.splitlines() if ln.strip()][-6:]
    for line in tail:
        part.say(line)
    if proc.returncode != 0:
        part.fail(f"pytest exited {proc.returncode}")


# -- generation on the device against the CPU ----------------------------------------
def generation_runs(
    model: Path,
    device: str,
    dtype: str,
    modes: tuple[str, ...] = ("specpipe", "pp", "specinfer"),
    new_tokens: int = 24,
) -> dict[str, list[int]]:
    """Tokens of every mode, greedy and sampled, in one process on `device`."""
    from specpipe.common.runtime.loader import build_local, parse_dtype
    from specpipe.common.runtime.lockstep import LockstepGeneration
    from specpipe.common.spec.options import DecodeOptions
    from specpipe.common.spec.sampling import SamplingParams

    # a small KV budget: a tiny model, and several deployments in turn on one device
    dep = build_local(model, 2, model, parse_dtype(dtype), device=device, max_cache_bytes=256 << 20)
    out = {}
    for mode in modes:
        for label, sampling in (("greedy", SamplingParams()),
                                ("sampled", SamplingParams(0.8, 0, 0.95, 7))):  # fmt: skip
            opts = DecodeOptions(max_new_tokens=new_tokens, sampling=sampling, width=4)
            gen = LockstepGeneration(dep.pipeline, dep.draft, PROMPT, mode, opts)
            out[f"{mode}/{label}"] = gen.run()
    return out


def _generation(part: Part, device: str) -> None:
    from specpipe.common.model.synthetic import save_random_model

    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_model(Path(tmp) / "tiny", **TINY)
        for dtype in ("float64", "float32"):
            ref = generation_runs(model, "cpu", dtype)
            got = generation_runs(model, device, dtype)
            bad = [k for k in ref if ref[k] != got[k]]
            if bad:
                part.fail(f"{dtype}: {len(bad)} of {len(ref)} runs differ from the CPU: {bad}")
            else:
                part.say(f"{dtype}: {len(ref)} runs (3 modes, greedy and sampled) equal the CPU's")
        if device.startswith("cuda"):
            ref = generation_runs(model, "cpu", "float32")
            got = generation_runs(model, device, "bfloat16")
            diverged = {k: _first_difference(ref[k], got[k]) for k in ref if ref[k] != got[k]}
            part.data["bf16_diverged"] = diverged
            part.say(f"bfloat16 on {device} against float32 on the CPU: {len(diverged)} of "
                     f"{len(ref)} runs diverge" + (f" (first differing position: {diverged})"
                                                   if diverged else ""))  # fmt: skip


def _first_difference(a: list[int], b: list[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
