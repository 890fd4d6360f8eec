"""`specpipe up` as a user runs it (issue 22): secure with no flags, stops every process
on SIGINT/SIGTERM (at once when nothing is open, after the open requests otherwise), and
leaves no process behind when it is killed itself.

The stop bounds are requirements, asserted generously: with a 60 s drain, an idle
deployment must be gone well before the drain could have run out."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from specpipe.services.security import Security
from specpipe.v1 import dataplane_pb2, stage_pb2_grpc

from specpipe.client import Client

from .conftest import reference

ENTRY = "import sys; from specpipe.cli import main; sys.exit(main(sys.argv[1:]))"
DRAIN = 60  # --drain-seconds: what an idle stop must not wait for
IDLE_STOP = 5.0  # the requirement: nothing open, everything stopped within this
SLACK = 10.0  # a loaded 2-core machine (process exits, reaping)


def _up(model: Path, log_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", ENTRY, "up", "--target", str(model), "--draft", "oracle",
         "--stages", "2", "--transport", "tcp", "--router-port", "0", "--threads", "1",
         "--dtype", "float64", "--log-dir", str(log_dir), "--drain-seconds", str(DRAIN),
         "--no-metrics", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _router_address(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    if not line.startswith("router: "):
        proc.kill()
        pytest.fail(f"specpipe up did not start: {line!r} {proc.stderr.read()}")
    return line.split()[1]


def _children(log_dir: Path) -> dict[str, int]:
    return {f.stem: json.loads(f.read_text())["pid"] for f in log_dir.glob("*.ready")}


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit status waits for init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def _wait_gone(pids, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _stop(proc: subprocess.Popen, pids) -> None:
    """Whatever a failed run left: the launcher, then its children."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in pids:
        if _running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_up_without_flags_is_secure_and_an_idle_stop_is_prompt(llama_dir, tmp_path) -> None:
    log_dir = tmp_path / "logs"
    proc, pids = _up(llama_dir, log_dir), {}
    try:
        address = _router_address(proc)
        pids = _children(log_dir)
        assert set(pids) == {"router", "stage0", "stage1", "draft"}
        for name, pid in pids.items():
            argv = _argv(pid)
            assert "--secure" in argv and "--insecure" not in argv, (name, argv)
            if name.startswith("stage"):
                assert argv[argv.index("--peers") + 1] == "127.0.0.1", argv
        stage0 = json.loads((log_dir / "stage0.ready").read_text())["grpc"]
        with grpc.insecure_channel(stage0) as ch, pytest.raises(grpc.RpcError) as info:
            stage_pb2_grpc.StageStub(ch).Describe(dataplane_pb2.DescribeRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # no TLS, no call
        sec = Security.load(log_dir / "pki")
        creds, opts = sec.channel_credentials(), sec.channel_options()
        with grpc.secure_channel(stage0, creds, opts) as ch:
            stub = stage_pb2_grpc.StageStub(ch)
            assert stub.Describe(dataplane_pb2.DescribeRequest(), timeout=10).ready
        with Client(address, timeout=60) as client:  # the public port: plaintext, as before
            done = client.generate(prompt_ids=[1, 2, 3], max_new_tokens=6, ignore_eos=True)
        assert len(done.token_ids) == 6
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=IDLE_STOP + SLACK) == 0  # not the 60 s drain
        assert _wait_gone(pids.values(), 1.0) == []
    finally:
        _stop(proc, pids.values())


def test_a_killed_launcher_leaves_no_process(llama_dir, tmp_path) -> None:
    """SIGKILL: no handler runs in `specpipe up`, yet its children stop (they watch a
    pipe only it holds). Also: --insecure warns once, in one line."""
    log_dir = tmp_path / "logs"
    proc, pids = _up(llama_dir, log_dir, "--insecure"), {}
    try:
        _router_address(proc)
        pids = _children(log_dir)
        assert len(pids) == 4 and all(_running(p) for p in pids.values())
        for name, pid in pids.items():
            assert "--insecure" in _argv(pid), name
            log = (log_dir / f"{name}.log").read_text()
            assert sum("--insecure:" in line for line in log.splitlines()) == 1, log
        proc.kill()
        proc.wait()
        assert _wait_gone(pids.values(), IDLE_STOP + SLACK) == []
        warned = [line for line in proc.stderr.read().splitlines() if "--insecure:" in line]
        assert len(warned) == 1, warned
    finally:
        _stop(proc, pids.values())


def test_sigterm_lets_open_requests_finish_then_stops_everything(llama_dir, tmp_path) -> None:
    log_dir = tmp_path / "logs"
    proc, pids = _up(llama_dir, log_dir), {}
    prompt, n = [3, 14, 15], 120
    try:
        address = _router_address(proc)
        pids = _children(log_dir)
        with Client(address, timeout=120) as client:
            stream = client.stream(prompt_ids=prompt, mode="pp", max_new_tokens=n, ignore_eos=True)
            chunks = iter(stream)
            first = next(chunks)
            proc.send_signal(signal.SIGTERM)
            rest = [t for chunk in chunks for t in chunk.token_ids]
            done = stream.result()
        tokens = first.token_ids + rest
        assert len(first.token_ids) < n and done.finish_reason == "length"
        assert tokens == done.token_ids == reference(llama_dir, "oracle", 2, prompt, "pp", n)
        assert proc.wait(timeout=DRAIN + 5 + SLACK) == 0
        assert _wait_gone(pids.values(), 1.0) == []
    finally:
        _stop(proc, pids.values())
