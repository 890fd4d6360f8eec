"""Quick start: a real generation through the real services on the default models.

Pulls the models (once), starts router, draft and S stages as separate processes with
`specpipe up`, streams a chat completion through the client SDK's command line, prints
tokens per step, hit rate and time between tokens, then stops the deployment.

    python scripts/quickstart.py [--target NAME] [--draft NAME] [--stages S] [--prompt TEXT]
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def wait_for_router(proc: subprocess.Popen[str], timeout: float) -> str:
    """Echo `specpipe up`'s output until it prints the router address."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        print(f"  [up] {line.rstrip()}", flush=True)
        m = re.search(r"router:\s*(\S+:\d+)", line)
        if m:
            return m.group(1)
        if time.monotonic() > deadline:
            break
    raise SystemExit(f"quickstart: the deployment did not come up (exit code {proc.poll()})")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--mode", default="specpipe")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    args = ap.parse_args()

    print(f"== pulling {args.target} and {args.draft} (first time only)", flush=True)
    subprocess.run(["specpipe", "models", "pull", args.target, args.draft], check=True)

    print(
        f"== starting router, draft and {args.stages} stages (specpipe up: mutual TLS among "
        "them, with a throwaway CA)",
        flush=True,
    )
    up = subprocess.Popen(
        [
            "specpipe",
            "up",
            "--target",
            args.target,
            "--draft",
            args.draft,
            "--stages",
            str(args.stages),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        router = wait_for_router(up, args.startup_timeout)
        print(f"== {args.mode}: {args.prompt!r}", flush=True)
        gen = subprocess.run(
            [
                "specpipe",
                "client",
                "generate",
                "--router",
                router,
                "--chat",
                "--prompt",
                args.prompt,
                "--mode",
                args.mode,
                "--max-new-tokens",
                str(args.max_new_tokens),
            ],
        )
        return gen.returncode
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
        print("== deployment stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
