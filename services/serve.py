"""Process entry points of the three services (used by `specpipe stage|draft|router`).

Each runs one asyncio loop until SIGINT/SIGTERM, then drains (NOT_SERVING in gRPC
health, new requests refused with UNAVAILABLE, open ones finish for up to
`--drain-seconds`) and stops; a second signal stops at once. With
`ready_file`, the process writes its addresses there once it serves, which is how
`specpipe up` and the tests learn that a child is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

log = logging.getLogger("specpipe.services")


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
    )


def security_of(args):
    """The internal planes' credentials of `--secure` (None without it)."""
    if not getattr(args, "secure", False):
        return None
    from .security import Security

    return Security.load(args.tls_dir, args.data_key_file, args.tls_server_name)


def exit_stopped(code: int = 0) -> NoReturn:
    """End a process that has stopped cleanly (a service: servers and data plane closed,
    open requests drained or failed; `specpipe up`: every child stopped) without the
    interpreter's teardown: collecting the objects of torch, transformers and grpc took
    3.5 to 4.9 s of an idle stage's stop on a loaded 2-core machine, 0.15 s without
    (docs/deploy.md, "Stopping a pod"). Logs and standard streams are flushed first;
    nothing else is left to do."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def write_ready(path: str | None, **info) -> None:
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **info}))
    tmp.replace(path)


def dump_tasks() -> None:
    """Log the stack of every asyncio task and thread (SIGUSR1): a process that serves
    but makes no progress shows where its coroutines wait, which a thread dump alone
    cannot (they all idle in the event loop)."""
    import io
    import sys
    import traceback

    out = io.StringIO()
    tasks = asyncio.all_tasks()
    out.write(f"{len(tasks)} asyncio tasks:\n")
    for task in sorted(tasks, key=lambda t: t.get_name()):
        out.write(f"--- task {task.get_name()}: {task.get_coro()!r}\n")
        for frame in task.get_stack():  # frames of compiled coroutines may lack lines
            code = frame.f_code
            out.write(f"  {code.co_filename}:{frame.f_lineno} in {code.co_name}\n")
    for ident, frame in sys._current_frames().items():
        out.write(f"--- thread {ident}\n{''.join(traceback.format_stack(frame))}")
    log.warning("task dump (SIGUSR1):\n%s", out.getvalue())


async def _serve_until_stopped(svc, drain_seconds: float, also_stop=()) -> None:
    """Serve until SIGTERM/SIGINT, drain for up to `drain_seconds` (a second signal cuts
    the drain short), then stop (`svc`, then the `also_stop` coroutine functions).
    Returns normally, so the process exits 0."""
    signals = [asyncio.Event(), asyncio.Event()]  # first, second signal
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        signals[1 if signals[0].is_set() else 0].set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, on_signal)
    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
    try:
        await signals[0].wait()
        log.info("stopping: draining for up to %.0f s (signal again to stop now)", drain_seconds)
        drain = asyncio.ensure_future(svc.drain(drain_seconds))
        hurry = asyncio.ensure_future(signals[1].wait())
        await asyncio.wait({drain, hurry}, return_when=asyncio.FIRST_COMPLETED)
        for task in (drain, hurry):
            task.cancel()
        await asyncio.gather(drain, hurry, return_exceptions=True)
    finally:
        await svc.stop()
        for stop in also_stop:
            await stop()


async def run_stage(args) -> None:
    from specpipe.common.model.config import ModelConfig
    from specpipe.common.model.partition import parse_layer_range
    from specpipe.common.runtime.loader import load_model

    from .stage_service import StageService

    model = None
    if args.model:
        layers = None
        if args.layers:
            num_layers = ModelConfig.from_dir(args.model).num_layers
            r = parse_layer_range(args.layers, num_layers)
            layers = (r.start, r.end)
        model = load_model(
            args.model,
            layers,
            args.dtype,
            args.model_id,
            device=args.device,
            max_cache_bytes=_gib(args.max_cache_gib),
        )
        _set_cache_budget(model.runtime, args)
    pacer = _pacer(args, "stage")
    if model is not None and args.measure_costs:
        from specpipe.common.perf.cost_model import row_budget

        model.cost_curve = _cost_curve(model.runtime, pacer)
        model.row_budget = row_budget(model.cost_curve)
        log.info(
            "cost per row count %s: row budget %d", model.cost_curve.to_dict(), model.row_budget
        )
    svc = StageService(
        model,
        transport_kind=args.transport,
        bind_host=args.host,
        advertise_host=args.advertise_host,
        max_cache_bytes=_gib(args.max_cache_gib),
        device=args.device,
        cache_fraction=args.cache_fraction,
        lease_seconds=args.lease_seconds,
        security=security_of(args),
        allow_configure=args.allow_configure,
        peers=args.peers,
        batch_wait=args.batch_wait_ms,
    )
    svc.pacer = pacer
    metrics = _serve_metrics(svc.metrics, args, svc.transport.advertise_host)
    port = await svc.start(args.host, args.port, args.data_port, args.health_port)
    addr = f"{svc.transport.advertise_host}:{port}"
    write_ready(args.ready_file, grpc=addr, data=svc.transport.address, **metrics)
    log.info("%s ready at %s (data %s)", svc.name, addr, svc.transport.address)
    await _serve_until_stopped(svc, args.drain_seconds, [_closer(svc.metrics), _report(pacer)])


def _cost_curve(runtime, pacer):
    """--measure-costs: seconds per forward of n rows, this device's or, with
    --emulate-costs, the emulated device's."""
    from specpipe.common.perf.cost_model import (
        BUDGET_ROWS,
        COST_CONTEXT,
        CostCurve,
        measure_runtime,
    )

    if pacer is not None:  # the emulated device's costs, not this CPU's
        return CostCurve(list(BUDGET_ROWS), [pacer.cost(n, COST_CONTEXT) for n in BUDGET_ROWS])
    return measure_runtime(runtime, BUDGET_ROWS, context=COST_CONTEXT, repeats=2)


async def run_draft(args) -> None:
    from .draft_service import DraftService

    svc = DraftService(
        args.model,
        args.dtype,
        args.model_id,
        device=args.device,
        max_cache_bytes=_gib(args.max_cache_gib),
        lease_seconds=args.lease_seconds,
        security=security_of(args),
        pacer=_pacer(args, "draft"),
        batch_wait=args.batch_wait_ms,
    )
    _set_cache_budget(svc.runtime.runtime, args)
    if args.measure_costs:
        svc.cost_curve = _cost_curve(svc.runtime.runtime, svc.pacer)
        log.info("draft cost per row count %s", svc.cost_curve.to_dict())
    host = args.advertise_host or _local(args.host)
    metrics = _serve_metrics(svc.metrics, args, host)
    port = await svc.start(args.host, args.port, args.health_port)
    addr = f"{host}:{port}"
    write_ready(args.ready_file, grpc=addr, **metrics)
    log.info("draft %s ready at %s", svc.model_id, addr)
    stops = [_closer(svc.metrics), _report(svc.pacer)]
    await _serve_until_stopped(svc, args.drain_seconds, stops)


TUNING_FLAGS = (
    "width",
    "layers_per_step",
    "token_source",
    "tune_calibration_tokens",
    "tune_price",
)
POLICY_FLAGS = (*TUNING_FLAGS, "late_draft_wait_ms")


def scheduling_options(args) -> dict[str, object]:
    """The router's scheduling flags (`--max-running`, `--max-waiting`, `--row-budget`, the
    request defaults and tuning, `TUNING_FLAGS`, and `--late-draft-wait-ms`) by name: what
    `specpipe up` passes its router (None: the router's default)."""
    return dict(
        max_running=args.max_running,
        max_waiting=args.max_waiting,
        row_budget=args.row_budget,
        **{k: getattr(args, k, None) for k in POLICY_FLAGS},
    )


def router_options(options: dict[str, object]) -> dict[str, object]:
    """`scheduling_options` as keyword arguments of RouterService."""
    from .router.requests import RequestDefaults
    from .router.tuning import RouterTuning

    kw = {k: v for k, v in options.items() if k not in POLICY_FLAGS}
    tuning = {
        "calibration_tokens": options.get("tune_calibration_tokens"),
        "price": options.get("tune_price"),
    }
    defaults = {k: options.get(k) for k in ("width", "layers_per_step", "token_source")}
    return dict(
        kw,
        defaults=RequestDefaults(**defaults),
        tuning=RouterTuning(**{k: v for k, v in tuning.items() if v is not None}),
        late_draft_wait=float(options.get("late_draft_wait_ms") or 0) / 1e3,
    )


async def run_router(args) -> None:
    from .metrics import RouterMetrics
    from .router import RouterService

    api_keys = args.api_keys  # an ApiKeys (the command line loaded it)
    router_metrics = RouterMetrics()
    svc = RouterService(
        tokenizer_dir=args.target,
        transport_kind=args.transport,
        bind_host=args.host,
        advertise_host=args.advertise_host,
        model_id=args.model_id,
        api_keys=api_keys,
        **router_options(scheduling_options(args)),
        discovery=args.discovery,  # the command line built it
        replay_seconds=args.replay_seconds,
        max_replays=args.max_replays,
        stall_seconds=args.stall_seconds,
        metrics=router_metrics,
        name=args.router_name,
        security=security_of(args),
        public_tls=args.public_tls,
    )
    router_metrics.watch(svc)
    svc.backends.stall_seconds = args.replica_stall_seconds
    host = args.advertise_host or _local(args.host)
    log.info("replicas from %s", args.discovery.describe())
    http, info = None, _serve_metrics(router_metrics, args, host)
    if args.http_port is not None:  # first: /health says "starting" while stages load
        from .router.http_api import HttpServer

        http = HttpServer(svc)
        info["http"] = f"{host}:{await http.start(args.host, args.http_port, args.public_tls)}"
        log.info("OpenAI-compatible HTTP API at http://%s/v1", info["http"])
    try:
        port = await svc.start(
            args.host, args.port, args.data_port, args.startup_timeout, args.health_port
        )
    except BaseException:
        if http:
            await http.stop()
        raise
    addr = f"{host}:{port}"
    if api_keys.enabled:
        log.info("API keys on: %d key(s)", len(api_keys))
    write_ready(args.ready_file, grpc=addr, data=svc.transport.address, **info)
    log.info("router ready at %s (model %s)", addr, svc.model.model_id if svc.model else "?")
    stops = [*([http.stop] if http else []), _closer(router_metrics)]
    await _serve_until_stopped(svc, args.drain_seconds, stops)


def _pacer(args, kind: str):
    """--emulate-costs FILE: this stage's (--emulate-stage) or the draft's cost model
    (common/perf/emulate.py); None without it, or for a draft the file has no costs for."""
    if not getattr(args, "emulate_costs", None):
        return None
    from specpipe.common.perf.emulate import EmulatedCosts, Pacer

    costs = EmulatedCosts.load(args.emulate_costs)
    cost = costs.stage(args.emulate_stage) if kind == "stage" else costs.draft()
    if cost is None:
        log.info("emulated costs %s: none for the draft; its forwards are not paced", costs.source)
        return None
    log.info("emulated device: every forward paced to %s (1 row: %.2f ms)", costs.source,
             1e3 * cost(1, 128))  # fmt: skip
    return Pacer(cost, name=kind)


def _report(pacer):
    """At stop: what the emulated device did (a benchmark reads it from the log)."""

    async def report() -> None:
        if pacer is not None:
            log.info("emulated device summary %s", json.dumps(pacer.summary()))

    return report


def _serve_metrics(metrics, args, host: str) -> dict[str, str]:
    """Start the /metrics server when --metrics-port is given; its address for the
    ready file."""
    if args.metrics_port is None:
        return {}
    port = metrics.serve(args.host, args.metrics_port)
    log.info("metrics at http://%s:%d/metrics", host, port)
    return {"metrics": f"{host}:{port}"}


def _closer(metrics):
    async def close() -> None:
        metrics.close()

    return close


def _set_cache_budget(runtime, args) -> None:
    """Without --max-cache-gib: a share of the device's free memory once the weights are
    loaded (--cache-fraction), not a fixed size whatever the machine. The prefix cache is
    on unless --no-prefix-cache."""
    from .modelinfo import cache_budget

    runtime.prefix_caching = not getattr(args, "no_prefix_cache", False)
    if args.max_cache_gib is None:
        runtime.max_cache_bytes = cache_budget(runtime.model.device, args.cache_fraction)
    log.info("KV cache budget %.2f GiB", runtime.max_cache_bytes / (1 << 30))


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _gib(value: float | None) -> int | None:
    return None if value is None else int(value * (1 << 30))
