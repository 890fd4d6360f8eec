"""The router's event-loop census (benchmarks/bench_router_loop.py puts this folder on
the router's PYTHONPATH): with SPECPIPE_LOOP_CENSUS=<file> set, a process started as
`specpipe.cli router` counts its event loop's turns, the callbacks it runs (by kind, with
their thread CPU time), its socket writes and its garbage collections. A real-time signal
starts a count (`SIGRTMIN`) and writes it to <file> as JSON (`SIGRTMIN + 1`); the router
itself is untouched (its own SIGUSR1 dumps its tasks). With SPECPIPE_LOOP_CENSUS_WRAP
("module:Class.function ..."), those functions' calls and thread CPU time (inclusive)
are counted too, wrapped at the first count's start (where the router has imported
them; a function imported by name elsewhere is wrapped only where named). Nothing
happens in any other process, or without the variable. SPECPIPE_LOOP_CENSUS_PROCESS
names another command to count instead (`bench_router_loop.py --process draft`)."""

import os
import sys

_PROCESS = os.environ.get("SPECPIPE_LOOP_CENSUS_PROCESS", "router")  # or "draft"

if sys.argv[1:2] == [_PROCESS] and os.environ.get("SPECPIPE_LOOP_CENSUS"):
    import asyncio.base_events
    import asyncio.events
    import asyncio.selector_events
    import collections
    import gc
    import json
    import signal
    import time

    _cpu = time.thread_time
    _callbacks: dict = collections.defaultdict(lambda: [0, 0.0])  # kind -> [count, CPU s]
    _counts: collections.Counter = collections.Counter()
    _gc = {"collections": 0, "seconds": 0.0, "began": 0.0}
    _functions: dict = collections.defaultdict(lambda: [0, 0.0])  # name -> [calls, CPU s]
    _wrapped: list[str] = []

    def _kind(callback) -> str:
        """A callback's kind: a task's coroutine, a future's callback, or the function."""
        owner = getattr(callback, "__self__", None)
        if isinstance(owner, asyncio.Task):
            coro = owner.get_coro()
            return f"task {getattr(coro, '__qualname__', None) or type(coro).__name__}"
        f = getattr(callback, "func", None) or getattr(callback, "__func__", None) or callback
        return str(getattr(f, "__qualname__", None) or type(f).__name__)

    _run = asyncio.events.Handle._run

    def _timed_run(self) -> None:
        c = _callbacks[_kind(self._callback)]  # before it runs: a handle may drop it
        t0 = _cpu()
        try:
            _run(self)
        finally:
            c[0] += 1
            c[1] += _cpu() - t0

    _turn = asyncio.base_events.BaseEventLoop._run_once

    def _counted_turn(self) -> None:
        _counts["loop turns"] += 1
        _turn(self)

    _write = asyncio.selector_events._SelectorSocketTransport.write

    def _counted_write(self, data) -> None:
        _counts["socket writes"] += 1
        _write(self, data)

    def _on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            _gc["began"] = _cpu()
        else:
            _gc["collections"] += 1
            _gc["seconds"] += _cpu() - _gc["began"]

    def _wrap(spec: str) -> None:
        import importlib

        module, _, path = spec.partition(":")
        owner = importlib.import_module(module)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        f = getattr(owner, name)
        stats = _functions[path]

        def timed(*args, **kwargs):
            t0 = _cpu()
            try:
                return f(*args, **kwargs)
            finally:
                stats[0] += 1
                stats[1] += _cpu() - t0

        setattr(owner, name, timed)
        _wrapped.append(spec)

    def _start(*_) -> None:
        if not _wrapped:
            for spec in os.environ.get("SPECPIPE_LOOP_CENSUS_WRAP", "").split():
                _wrap(spec)
        for stats in _functions.values():  # in place: the wrappers hold them
            stats[:] = [0, 0.0]
        _callbacks.clear()
        _counts.clear()
        _gc.update(collections=0, seconds=0.0)
        _counts["thread cpu at start"] = _cpu()

    def _dump(*_) -> None:
        out = {
            "main_thread_cpu_s": _cpu() - _counts.pop("thread cpu at start", 0.0),
            "counts": dict(_counts),
            "gc": {k: _gc[k] for k in ("collections", "seconds")},
            "callbacks": {k: {"count": n, "cpu_s": s} for k, (n, s) in _callbacks.items()},
            "functions": {k: {"count": n, "cpu_s": s} for k, (n, s) in _functions.items()},
        }
        with open(os.environ["SPECPIPE_LOOP_CENSUS"], "w") as f:
            json.dump(out, f)

    asyncio.events.Handle._run = _timed_run
    asyncio.base_events.BaseEventLoop._run_once = _counted_turn
    asyncio.selector_events._SelectorSocketTransport.write = _counted_write
    gc.callbacks.append(_on_gc)
    signal.signal(signal.SIGRTMIN, _start)
    signal.signal(signal.SIGRTMIN + 1, _dump)
