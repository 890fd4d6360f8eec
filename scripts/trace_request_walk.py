"""Follow one streamed HTTP chat request through the router and count its walk.

The real HTTP API and the real engine serve a streamed /v1/chat/completions request
in this process, over the in-process fake stages and draft of the router's unit tests
(tests/unit/router_fakes.py) and a character tokenizer with a chat template. A
profiler (sys.setprofile) sees every Python call from the request's arrival to its
last SSE chunk; only functions in the repository's common/ and services/ count.

It prints, for the whole walk and for its front half (the HTTP API, the OpenAI
mapping, the engine and its checks; not the driver, path, controller and wire): calls (function entries; a generator resumed counts again), distinct
functions, modules, stays (runs of consecutive calls in one module), re-entries (stays
in a module already left before), the modules entered most often, and how often the
model and the request's size are checked. Run it from a checkout's root with that
checkout's Python (it adapts to the router before the engine held its front ends):

    .venv/bin/python scripts/trace_request_walk.py [--tokens 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import inspect
import json
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the checkout's tests (their fakes)
import specpipe.services

# The checkout whose files the `specpipe` packages map to (run with its own Python).
ROOT = Path(specpipe.services.__file__).resolve().parents[1]
COUNTED = tuple(str(ROOT / d) + "/" for d in ("common", "services"))
# The front half: the HTTP API, the OpenAI mapping, the engine and what it checks a
# request with; the rest (the driver, the path, the controller, the wire) is the back
# half, which every front end shares.
FRONT = (
    *(
        f"services/router/{m}.py"
        for m in (
            "http_guard", "http_api", "openai_compat", "side_endpoints", "tool_calls",
            "service", "engine", "requests", "admission", "tokenizing", "bounds", "edge",
            "cache_scope", "tuning", "keepalive", "step_fit", "text_run", "openai_responses", "http_stream", "http_errors",
        )
    ),
    "services/auth.py", "common/spec/request_options.py", "common/text.py",
)  # fmt: skip


class Walk:
    """The counted calls, in order, per thread."""

    def __init__(self) -> None:
        self.calls: dict[int, list[tuple[str, str]]] = collections.defaultdict(list)
        self.on = False

    def profile(self, frame, event, arg):
        if event != "call" or not self.on:
            return
        path = frame.f_code.co_filename
        if path.startswith(COUNTED):
            module = path[len(str(ROOT)) + 1 :]
            self.calls[threading.get_ident()].append((module, frame.f_code.co_qualname))

    def summary(self, only: tuple[str, ...] = ()) -> dict:
        """The main thread's walk (`only`: over these modules alone)."""
        main = self.calls.get(threading.main_thread().ident, [])
        main = [c for c in main if not only or c[0] in only]
        others = sum(len(c) for t, c in self.calls.items() if t != threading.main_thread().ident)
        stays, seen, reentries = [], set(), 0
        entered = collections.Counter()
        for module, _ in main:
            if not stays or stays[-1] != module:
                if module in seen:
                    reentries += 1
                seen.add(module)
                stays.append(module)
                entered[module] += 1
        checks = collections.Counter(c for c in main if c[0] == "services/router/requests.py")
        return {
            "calls": len(main),
            "functions": len(set(main)),
            "modules": len(seen),
            "stays": len(stays),
            "reentries": reentries,
            "calls_on_other_threads": others,
            # the checks themselves (requests.py's), whoever calls them
            "check_model": checks["services/router/requests.py", "check_model"],
            "check_size": checks["services/router/requests.py", "check_size"],
            "most_entered": entered.most_common(8),
        }


def build(tokenizer_dir: str):
    """An engine over the fake deployment, its HTTP server, and the deployment."""
    from specpipe.services.router.engine import RouterEngine
    from specpipe.services.router.http_api import HttpServer
    from specpipe.services.router.requests import load_codec

    from tests.unit.router_fakes import deployment

    dep = deployment()
    if "config" in inspect.signature(RouterEngine).parameters:  # the engine is held
        from specpipe.services.config import RouterConfig

        engine = RouterEngine(RouterConfig(stages=("127.0.0.1:9",), target=tokenizer_dir))
    else:  # before: the gRPC service was the engine, and the HTTP API held the service
        from specpipe.services.router.service import RouterService

        engine = RouterService(["127.0.0.1:9"], None, tokenizer_dir=tokenizer_dir)
    return engine, HttpServer(engine), dep, load_codec(tokenizer_dir)


async def run(tokens: int, tokenizer_dir: str) -> dict:
    import openai

    engine, http, dep, codec = build(tokenizer_dir)
    await engine.backends.close()
    engine.backends, engine.inbox, engine.codec = dep.backends, dep.inbox, codec
    for b in dep.backends.all:
        b.desc.max_step_rows = 0  # no limit published
    port = await http.start("127.0.0.1", 0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
    request = dict(model="", messages=[{"role": "user", "content": "Hello there"}],
                   max_tokens=tokens, temperature=0, stream=True)  # fmt: skip
    walk = Walk()
    sys.setprofile(walk.profile)
    threading.setprofile(walk.profile)
    try:
        await client.models.list()  # the connection and the app warmed up
        walk.on = True
        chunks = [c async for c in await client.chat.completions.create(**request)]
        walk.on = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        await client.close()
        await http.stop()
        await asyncio.sleep(0.05)  # the release runs in the background
        engine._tokenizing.shutdown()
    assert chunks[-1].choices[0].finish_reason == "length", chunks[-1]
    return {"chunks": len(chunks), "all": walk.summary(), "front": walk.summary(FRONT)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8, help="max_tokens of the request")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    from tests.integration.conftest import add_char_tokenizer

    with tempfile.TemporaryDirectory() as d:
        add_char_tokenizer(Path(d))
        figures = asyncio.run(run(args.tokens, d))
    print(f"chunks: {figures['chunks']}")
    for part in ("all", "front"):
        print(f"-- {part}")
        for key, value in figures[part].items():
            print(f"{key:>24}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
