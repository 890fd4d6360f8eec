"""CPU time of the request controller per pipeline step (not a test).

The router runs every request's controller on one event loop: at every step each
request's tree is verified, pruned and grown on the router's CPU. Whatever that costs
per request is added to every step once the router is busy (`bench_emulated.py`
measures the whole gap through the services; this measures the controller's share of
it, alone and reproducibly).

A small random Llama with the target as its own draft (every token a hit: the tree is
always full) runs in the in-process lockstep engine, closed loop at each concurrency;
the time spent inside the controller's event handlers (`start`, `on_verified`,
`on_candidates`) is summed and divided by the engine's steps and by the verifications.
Model forwards are not counted. The tokens are written too, so that two versions of
the controller can be checked to decide the same thing (same steps, same tokens).

    python benchmarks/bench_controller.py [--modes specpipe,specinfer] [--concurrency 1,8]
    python benchmarks/bench_controller.py --modes specpipe --stages 4 --width 4 --replay 10

`--replay N`: the controllers' events of each cell are recorded and replayed N times on
fresh controllers, no model and no engine between them; it prints the CPU time (this
thread's) per verification, the least of the N (the replays repeat the same decisions:
their statistics are checked equal), the figure least moved by a shared machine's load.

`--cold`: the replays evict the CPU's caches before every event (a pass over 64 MiB, not
timed) and time each event alone. The router meets its events so at one client: each
comes after some 20 ms in which other processes ran on its core. The controller then
costs about 3.5x its warm replay (session 44: 450-466 against 128-130 us per
verification), the ~430 us measured in the router (`bench_router_loop.py --wrap`). A
change that makes fewer calls per step, not just shorter ones, shows here.

`--save-events FILE` / `--check-events FILE`: the recorded events of every cell and the
commands each produced, saved; then replayed on this checkout's controllers, every
command compared (fails at the first that differs): two versions of the controller
decide exactly the same on the same events (`--sampling seeded` adds misses).

Replays (timed, and `--check-events`) hand each draft answer to the controller as the
checkout's network executor makes it from the draft's message (`answer_candidates`:
numpy arrays since session 45, tensors before), the conversion timed with the handler:
the router's work per answer either way. Commands are compared as an in-process
executor reads them (`plain`), so the checkouts before and after session 45 (whose
commands carry numpy arrays with torch views) compare equal when they decide the same.
"""

from __future__ import annotations

import argparse
import copyreg
import functools
import json
import pickle
import platform
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
from bench_serve import make_model  # noqa: E402
from specpipe.common.perf.timeline import Ask, closed_loop  # noqa: E402
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local  # noqa: E402
from specpipe.common.runtime.lockstep import LockstepEngine  # noqa: E402
from specpipe.common.spec.controller import Controller, make_controller  # noqa: E402
from specpipe.common.spec.options import DecodeOptions  # noqa: E402
from specpipe.common.spec.sampling import SamplingParams  # noqa: E402
from specpipe.common.spec.specinfer import SpecInferController  # noqa: E402
from specpipe.common.spec.specpipe import SpecPipeController  # noqa: E402
from specpipe.v1 import draft_pb2  # noqa: E402

try:  # the checkout's network executor's reading of a draft answer
    from specpipe.services.router.executor import answer_candidates
except ImportError:  # before session 45: tensors, made inline in the executor
    from specpipe.common.spec.messages import Candidates
    from specpipe.services.control import tensor_of

    def answer_candidates(resp: draft_pb2.ProposeResponse) -> Candidates:
        return Candidates(
            tensor_of(resp.parent_ids), tensor_of(resp.token_ids), tensor_of(resp.probs, np.float32)
        )


HANDLERS = ("start", "on_verified", "on_candidates")
Event = tuple[str, str, tuple]  # (request id, handler, its arguments)


class HandlerClock:
    """Seconds spent inside the controllers' event handlers while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved: list[tuple[type, str, Callable]] = []
        self.events: list[Event] = []  # every handler call, in order (`replay_cpu`)
        self.made: dict[str, Callable[[], Controller]] = {}  # a fresh copy of each request's

    def __enter__(self) -> HandlerClock:
        for cls in (SpecPipeController, SpecInferController):
            for name in HANDLERS:
                f = getattr(cls, name)
                self._saved.append((cls, name, f))
                setattr(cls, name, self._timed(f))
        return self

    def __exit__(self, *exc) -> None:
        for cls, name, f in self._saved:
            setattr(cls, name, f)

    def _timed(self, f: Callable) -> Callable:
        def timed(ctrl: Controller, *args, **kwargs):
            self.events.append((ctrl.request_id, f.__name__, args))
            if f.__name__ == "start":
                self.made[ctrl.request_id] = functools.partial(
                    type(ctrl), ctrl.request_id, list(ctrl.prompt), ctrl.mode, ctrl.opts,
                    ctrl.num_stages,
                )  # fmt: skip
            t0 = time.perf_counter()
            try:
                return f(ctrl, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


COLD_BYTES = 64 << 20  # larger than this CPU's caches


def replay_cpu(
    events: list[Event],
    made: dict[str, Callable[[], Controller]],
    repeats: int,
    cold: bool = False,
) -> tuple[float, int, dict[str, float]]:
    """(least CPU seconds of `repeats` replays of `events` on fresh controllers, the
    verifications of one replay, the least seconds of each handler); `made[request_id]()`
    makes a request's controller. `cold`: the caches are evicted before each event
    (untimed; each event timed alone, and each handler's seconds summed)."""
    best, stats, by_handler = None, None, {}
    junk = np.ones(COLD_BYTES // 8) if cold else None
    events = as_sent(events)
    for _ in range(repeats):
        ctrls = {rid: make() for rid, make in made.items()}
        if junk is None:
            t0 = time.thread_time()
            for rid, name, args in events:
                handle(ctrls[rid], name, args)
            cpu = time.thread_time() - t0
        else:
            cpu, by = 0.0, dict.fromkeys(HANDLERS, 0.0)
            for rid, name, args in events:
                junk.sum()  # what the other processes' 20 ms leave in the caches
                t0 = time.thread_time()
                handle(ctrls[rid], name, args)
                dt = time.thread_time() - t0
                cpu += dt
                by[name] += dt
            by_handler = {k: min(v, by_handler.get(k, v)) for k, v in by.items()}
        best = cpu if best is None else min(best, cpu)
        now = {rid: str(c.stats) for rid, c in ctrls.items()}
        if stats is not None and now != stats:
            raise AssertionError("a replay decided differently from the first")
        stats = now
    verifications = sum(c.stats.verifications for c in ctrls.values())
    return best or 0.0, verifications, by_handler


def as_sent(events: list[Event]) -> list[Event]:
    """The events with each draft answer as its message (`draft_pb2.ProposeResponse`),
    as the draft sends it to a router."""
    sent = []
    for rid, name, args in events:
        if name == "on_candidates":
            ticket, cand = args
            resp = draft_pb2.ProposeResponse(
                parent_ids=cand.parent_ids.tolist(),
                token_ids=cand.tokens.tolist(),
                probs=cand.probs.tolist(),
            )
            args = (ticket, resp)
        sent.append((rid, name, args))
    return sent


def handle(ctrl: Controller, name: str, args: tuple) -> list:
    """One event on `ctrl`: a draft answer read as the checkout's router reads it."""
    if name == "on_candidates":
        return ctrl.on_candidates(args[0], answer_candidates(args[1]))
    return getattr(ctrl, name)(*args)


def _proxy(d: dict) -> types.MappingProxyType:
    return types.MappingProxyType(d)


# the options' read-only mappings (logit bias), for `--save-events`
copyreg.pickle(types.MappingProxyType, lambda m: (_proxy, (dict(m),)))


# Commands' numpy fields (session 45) by the tensor views an in-process executor reads,
# the fields of the same names before
VIEWS = {
    ("Feed", "rows"): "act",
    ("Propose", "rows"): "layer",
    ("BroadcastPrune", "ids"): "prune",
    ("DraftPrune", "ids"): "prune",
}


def plain(x: object) -> object:
    """A command (or anything in one) as plain values: tensors and arrays as lists with
    their dtype (numpy's name), dataclasses as their fields (`VIEWS`)."""
    if isinstance(x, torch.Tensor | np.ndarray):
        return (str(x.dtype).removeprefix("torch."), x.tolist())
    if isinstance(x, list | tuple):
        return [plain(y) for y in x]
    if hasattr(x, "__dataclass_fields__"):
        name = type(x).__name__
        keys = [VIEWS.get((name, k), k) for k in x.__dataclass_fields__]
        return (name, {k: plain(getattr(x, k)) for k in keys})
    return x


def replay_commands(events: list[Event], made: dict[str, tuple]) -> list[object]:
    """The commands every event gives on fresh controllers (`made`: each request's
    `make_controller` arguments), as plain values."""
    ctrls = {rid: make_controller(*args) for rid, args in made.items()}
    return [plain(handle(ctrls[rid], name, args)) for rid, name, args in as_sent(events)]


def check_events(path: Path) -> None:
    """Replay the saved cells on this checkout's controllers; exit 1 at a difference."""
    for cell, (events, made, want) in pickle.loads(path.read_bytes()).items():
        got = replay_commands(events, made)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            if g != w:
                sys.exit(f"{cell}: event {i} ({events[i][1]}) decided differently:\n{w}\n{g}")
        print(f"{cell}: {len(events)} events, every command the same", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="specpipe,specinfer")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--layers-per-step", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--replay", type=int, default=0, help="replays of each cell's events")
    ap.add_argument("--cold", action="store_true", help="replays with the caches evicted")
    ap.add_argument("--out", default=str(HERE / "results" / "controller"))
    ap.add_argument("--sampling", choices=("greedy", "seeded"), default="greedy",
                    help="seeded: temperature 0.8, top-k 20, top-p 0.9, seed 7")  # fmt: skip
    # (not "ngram": its controllers answer their own asks, inside the handlers timed)
    ap.add_argument("--token-source", default="draft", choices=("draft", "hybrid"))
    ap.add_argument("--save-events", type=Path, help="save each cell's events and commands")
    ap.add_argument("--check-events", type=Path, help="replay saved events, compare commands")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.check_events:
        check_events(args.check_events)
        return

    with tempfile.TemporaryDirectory(prefix="bench-controller-") as tmp:
        local = build_local(make_model(Path(tmp), 8, 256, 512), args.stages, ORACLE_DRAFT)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 511, (32,), generator=g).tolist() for _ in range(args.requests)]
    opts = DecodeOptions(
        max_new_tokens=args.max_new_tokens,
        width=args.width,
        layers_per_step=args.layers_per_step,
        token_source=args.token_source,
        sampling=SamplingParams()
        if args.sampling == "greedy"
        else SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7),
    )
    rows, tokens, saved = [], {}, {}
    for mode in args.modes.split(","):
        for conc in (int(c) for c in args.concurrency.split(",")):
            engine = LockstepEngine(local.pipeline, local.draft)
            with HandlerClock() as clock:
                load = closed_loop(engine, [Ask(p, mode, opts) for p in prompts], conc)
            verifications = sum(x.stats.verifications for x in load.served)
            row = {
                "mode": mode,
                "concurrency": conc,
                "steps": engine.steps,
                "tokens": sum(len(x.tokens) for x in load.served),
                "verifications": verifications,
                "controller_s": round(clock.seconds, 4),
                "controller_ms_per_step": round(1e3 * clock.seconds / engine.steps, 3),
                "controller_us_per_verification": round(1e6 * clock.seconds / verifications, 1),
            }
            if args.replay:
                cpu, nv, by = replay_cpu(clock.events, clock.made, args.replay, args.cold)
                row["replay_cpu_us_per_verification"] = round(1e6 * cpu / nv, 1)
                if by:
                    row["replay_cpu_us_per_verification_by_handler"] = {
                        k: round(1e6 * v / nv, 1) for k, v in by.items()
                    }
            if args.save_events:
                made = {rid: (mode, rid, m.args[1], m.args[3], m.args[4])
                        for rid, m in clock.made.items()}  # fmt: skip
                saved[f"{mode}@{conc}"] = (clock.events, made, replay_commands(clock.events, made))
            rows.append(row)
            tokens[f"{mode}@{conc}"] = [x.tokens for x in load.served]
            print(
                f"{mode:10s} c={conc:<3d} steps {row['steps']:4d} tokens {row['tokens']:5d} "
                f"controller {row['controller_ms_per_step']:7.2f} ms/step "
                f"{row['controller_us_per_verification']:7.1f} us/verification"
                + (
                    f", replayed {row['replay_cpu_us_per_verification']:.1f} us CPU/verification"
                    if args.replay
                    else ""
                )
                + "".join(
                    f", {k} {v:.1f}"
                    for k, v in row.get("replay_cpu_us_per_verification_by_handler", {}).items()
                ),
                flush=True,
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"config": vars(args), "machine": platform.machine(), "torch": torch.__version__}
    (out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))
    (out / "tokens.json").write_text(json.dumps(tokens))
    if args.save_events:
        args.save_events.write_bytes(pickle.dumps(saved))
        print(f"wrote {args.save_events}")
    print(f"wrote {out}/results.json and tokens.json")


if __name__ == "__main__":
    main()
