"""Wait for a `specpipe up` child to serve its HTTP API: the evaluation scripts run in
their tools' own virtual environments (bfcl-eval, lm-eval), without specpipe installed,
so they share this stdlib-only helper by path."""

from __future__ import annotations

import subprocess
import time
import urllib.request


def wait_until_serving(
    proc: subprocess.Popen, port: int, timeout: float, log_name: str, poll: float = 2.0
) -> subprocess.Popen:
    """`proc` once `/health` answers on `port`; exits naming the log if it dies or is late."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"specpipe up exited: see {log_name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(poll)
    proc.terminate()
    raise SystemExit("specpipe up did not serve in time")
