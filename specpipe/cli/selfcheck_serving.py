"""`specpipe selfcheck`'s served run: `specpipe up --device D` as its own process (router,
draft and two stages), a streamed client, and what a user sees: the time to the first
token and between tokens, tokens per pipeline step, and the tokens against the
in-process engine's (the same random model, greedy: they must be equal).
"""

from __future__ import annotations

import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# The served model: a random one big enough to put work on a GPU, tiny on the CPU. The
# draft is the target itself (`--draft oracle`): tokens per step are then the pipeline's
# own, with no draft quality in them.
GPU_MODEL = dict(arch="qwen2", layers=8, hidden=1024, heads=8, kv_heads=2, vocab=32000, init=0.6)
NEW_TOKENS = 48


def run_served(part, device: str, tiny: dict, prompt: list[int]) -> None:
    from specpipe.common.model.synthetic import save_random_model

    from .selfcheck import generation_runs

    shape = GPU_MODEL if device.startswith("cuda") else tiny
    dtype = "float32"  # the served tokens must equal the in-process engine's
    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_model(Path(tmp) / "model", **shape)
        want = generation_runs(model, device, dtype, modes=("specpipe",), new_tokens=NEW_TOKENS)
        cmd = [sys.executable, "-m", "specpipe.cli", "up", "--target", str(model),
               "--draft", "oracle", "--stages", "2", "--device", device, "--dtype", dtype,
               "--insecure", "--max-cache-gib", "1", "--log-dir", str(Path(tmp) / "logs"),
               "--startup-timeout", "150"]  # fmt: skip
        part.say(f"specpipe up --device {device}: 2 stages, --draft oracle, a random "
                 f"{shape['layers']}-layer model of hidden {shape['hidden']}, {dtype}")  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        lines: list[str] = []
        try:
            address = _router_address(proc, lines, timeout=180)
            for line in lines:
                if line.startswith("  "):
                    part.say(line.rstrip())
            _stream(part, address, prompt, want["specpipe/greedy"])
        finally:
            _stop(proc)
            tail = [ln.rstrip() for ln in lines[-8:] if "Traceback" in ln or "Error" in ln]
            for line in tail:
                part.say(f"  up: {line}")


def _router_address(proc: subprocess.Popen, lines: list[str], timeout: float) -> str:
    """The address `specpipe up` prints once every service is ready."""
    found: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("router: ") and not found:
                found.append(line.split(": ", 1)[1].strip())

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found:
        if proc.poll() is not None:
            time.sleep(0.2)  # the reader's last lines
            raise RuntimeError(f"specpipe up exited {proc.returncode}: {''.join(lines[-12:])}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"specpipe up not ready in {timeout:.0f} s: {''.join(lines[-12:])}")
        time.sleep(0.1)
    return found[0]


def _stream(part, address: str, prompt: list[int], want: list[int]) -> None:
    from specpipe.client import Client

    with Client(address, timeout=120) as client:
        client.generate(prompt_ids=prompt, max_new_tokens=4)  # warm: first forwards, caches
        t0 = time.perf_counter()
        stream = client.stream(prompt_ids=prompt, max_new_tokens=NEW_TOKENS)
        arrivals: list[tuple[float, int]] = []
        for chunk in stream:
            arrivals.append((time.perf_counter(), len(chunk.token_ids)))
        done = stream.result()
    tokens = list(done.token_ids)
    first = arrivals[0][0] - t0 if arrivals else float("nan")
    gaps = [(b[0] - a[0]) / b[1] for a, b in itertools.pairwise(arrivals)]
    per_token = statistics.median(gaps) if gaps else float("nan")
    total = arrivals[-1][0] - t0 if arrivals else float("nan")
    data = {
        "tokens": len(tokens),
        "first_token_ms": round(1e3 * first, 2),
        "per_token_ms_median": round(1e3 * per_token, 3),
        "per_token_ms_mean": round(1e3 * (total - first) / max(1, len(tokens) - 1), 3),
        "tokens_per_step": done.stats.get("tokens_per_step"),
        "chunks": len(arrivals),
    }
    part.data.update(data)
    part.say(f"streamed {len(tokens)} tokens in {len(arrivals)} chunks: first after "
             f"{data['first_token_ms']} ms, then {data['per_token_ms_median']} ms per token "
             f"(median; mean {data['per_token_ms_mean']}), {data['tokens_per_step']} tokens "
             "per step")  # fmt: skip
    if tokens != want[: len(tokens)] or len(tokens) != len(want):
        part.fail(f"the served tokens differ from the in-process engine's: {tokens} vs {want}")
    else:
        part.say("the served tokens equal the in-process engine's")


def _stop(proc: subprocess.Popen) -> None:
    """Stop `specpipe up` and every process it started (its own session)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
