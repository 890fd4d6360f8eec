"""Process entry points of the three services (used by `specpipe stage|draft|router`):
each takes its typed configuration (services/config.py) and maps it onto its service's
constructor, here and nowhere else.

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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from .config import TCP, DraftConfig, ModelServiceConfig, RouterConfig, ServiceConfig, StageConfig
from .cpu_threads import publish, stage_share

if TYPE_CHECKING:
    from .auth import ApiKeys
    from .router.discovery import Discovery
    from .security import PublicTls

log = logging.getLogger("specpipe.services")


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
    )


def security_of(config: ServiceConfig):
    """The internal planes' credentials of `--secure` (None without it)."""
    if not config.secure:
        return None
    from .security import Security

    return Security.load(config.tls_dir, config.data_key_file, config.tls_server_name)


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


async def run_stage(config: StageConfig) -> None:
    from specpipe.common.model.config import ModelConfig
    from specpipe.common.model.partition import parse_layer_range
    from specpipe.common.runtime.loader import load_model

    from .stage_service import StageService

    model = None
    if config.model:
        layers = None
        if config.layers:
            num_layers = ModelConfig.from_dir(config.model).num_layers
            r = parse_layer_range(config.layers, num_layers)
            layers = (r.start, r.end)
        model = load_model(
            config.model,
            layers,
            config.dtype,
            config.model_id,
            device=config.device,
            max_cache_bytes=config.max_cache_bytes,
            batch_invariant=config.invariance,
        )
        _set_cache_budget(model.runtime, config)
    pacer = _pacer(config)
    if model is not None and config.measure_costs:
        from specpipe.common.perf.cost_model import row_budget

        model.cost_curve = _cost_curve(model.runtime, pacer)
        model.row_budget = row_budget(model.cost_curve)
        log.info(
            "cost per row count %s: row budget %d", model.cost_curve.to_dict(), model.row_budget
        )
    svc = StageService(
        model,
        transport_kind=config.transport or TCP,
        bind_host=config.host,
        advertise_host=config.advertise_host,
        max_cache_bytes=config.max_cache_bytes,
        device=config.device,
        cache_fraction=config.cache_fraction,
        lease_seconds=config.lease_seconds,
        security=security_of(config),
        allow_configure=config.allow_configure,
        peers=config.peers,
        batch_wait=config.batch_wait,
        pacer=pacer,
        batch_invariant=config.invariance,
    )
    if model is not None:  # its torch threads while the draft of this host works
        share = stage_share(
            model.runtime.model, config.draft_activity, config.threads, config.threads_with_draft
        )
        svc.rounds.before_forward = share or svc.rounds.before_forward
    metrics = _serve_metrics(svc.metrics, config, svc.transport.advertise_host)
    port = await svc.start(config.host, config.port, config.data_port, config.health_port)
    addr = f"{svc.transport.advertise_host}:{port}"
    write_ready(config.ready_file, grpc=addr, data=svc.transport.address, **metrics)
    log.info("%s ready at %s (data %s)", svc.name, addr, svc.transport.address)
    stops = [_closer(svc.metrics), _report(pacer)]
    await _serve_until_stopped(svc, config.drain_seconds, stops)


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


async def run_draft(config: DraftConfig) -> None:
    from .draft_service import DraftService

    svc = DraftService(
        config.model,
        config.dtype,
        config.model_id,
        device=config.device,
        max_cache_bytes=config.max_cache_bytes,
        lease_seconds=config.lease_seconds,
        security=security_of(config),
        pacer=_pacer(config),
        batch_wait=config.batch_wait,
        transport_kind=None if config.data_port is None else config.transport or TCP,
        bind_host=config.host,
        advertise_host=config.advertise_host,
        peers=config.peers,
    )
    _set_cache_budget(svc.runtime.runtime, config)
    if config.measure_costs:
        svc.cost_curve = _cost_curve(svc.runtime.runtime, svc.pacer)
        log.info("draft cost per row count %s", svc.cost_curve.to_dict())
    host = config.advertise_host or _local(config.host)
    metrics = _serve_metrics(svc.metrics, config, host)
    port = await svc.start(config.host, config.port, config.data_port or 0, config.health_port)
    addr = f"{host}:{port}"
    data = {"data": svc.transport.address} if svc.transport is not None else {}
    write_ready(config.ready_file, grpc=addr, **data, **metrics)
    log.info("draft %s ready at %s %s", svc.model_id, addr, data)
    stops = [_closer(svc.metrics), _report(svc.pacer)]
    if config.draft_activity:  # the stages of this host follow whether it holds requests
        idle = publish(config.draft_activity, config.activity_slot, svc.leases.__len__)
        stops.append(_setter(idle))
    await _serve_until_stopped(svc, config.drain_seconds, stops)


def load_api_keys(config: RouterConfig):
    """The API keys of `--api-key` and `--api-key-file` (an `ApiKeyError`, a ValueError,
    for a file that cannot be read or lists none)."""
    from .auth import ApiKeys

    return ApiKeys.load(config.api_keys, config.api_key_files, config.max_priority)


def load_public_tls(config: RouterConfig):
    """The public ports' TLS (`--public-tls-cert/-key`), checked now; None without it."""
    if not config.public_tls_cert:
        return None
    from .security import PublicTls

    return PublicTls.load(config.public_tls_cert, config.public_tls_key)


@dataclass(frozen=True)
class RouterInputs:
    """What a router's configuration names, made or read: the source of its replicas,
    its API keys and its public TLS. `load` raises ValueError (DiscoveryError,
    ApiKeyError, SecurityError) with a message for the user."""

    discovery: Discovery
    api_keys: ApiKeys
    public_tls: PublicTls | None

    @classmethod
    def load(cls, config: RouterConfig) -> RouterInputs:
        from .router.discovery import discovery_of

        discovery = discovery_of(config)
        return cls(discovery, load_api_keys(config), load_public_tls(config))


async def run_router(config: RouterConfig, inputs: RouterInputs | None = None) -> None:
    """`inputs`: loaded already (the command line checks them first); None: load them."""
    from .metrics import RouterMetrics
    from .router import RouterEngine, RouterService

    inputs = inputs or RouterInputs.load(config)
    router_metrics = RouterMetrics()
    engine = RouterEngine(
        config,
        discovery=inputs.discovery,
        api_keys=inputs.api_keys,
        security=security_of(config),
        metrics=router_metrics,
    )
    svc = RouterService(engine, inputs.public_tls)
    router_metrics.watch(engine)
    host = config.advertise_host or _local(config.host)
    log.info("replicas from %s", inputs.discovery.describe())
    http, info = None, _serve_metrics(router_metrics, config, host)
    if config.http_port is not None:  # first: /health says "starting" while stages load
        from .router.http_api import HttpServer

        http = HttpServer(engine)
        port = await http.start(config.host, config.http_port, inputs.public_tls)
        info["http"] = f"{host}:{port}"
        log.info("OpenAI-compatible HTTP API at http://%s/v1", info["http"])
    try:
        port = await svc.start(
            config.host,
            config.port,
            config.data_port,
            config.startup_timeout,
            config.health_port,
        )
    except BaseException:
        if http:
            await http.stop()
        raise
    addr = f"{host}:{port}"
    if inputs.api_keys.enabled:
        log.info("API keys on: %d key(s)", len(inputs.api_keys))
    write_ready(config.ready_file, grpc=addr, data=engine.transport.address, **info)
    log.info("router ready at %s (model %s)", addr, engine.model.model_id if engine.model else "?")
    stops = [*([http.stop] if http else []), _closer(router_metrics)]
    await _serve_until_stopped(svc, config.drain_seconds, stops)


def _pacer(config: ModelServiceConfig):
    """--emulate-costs FILE: this stage's (--emulate-stage) or the draft's cost model
    (common/perf/emulate.py); None without it, or for a draft the file has no costs for."""
    if not config.emulate_costs:
        return None
    from specpipe.common.perf.emulate import EmulatedCosts, Pacer

    costs = EmulatedCosts.load(config.emulate_costs)
    stage = isinstance(config, StageConfig)
    cost = costs.stage(config.emulate_stage) if stage else costs.draft()
    if cost is None:
        log.info("emulated costs %s: none for the draft; its forwards are not paced", costs.source)
        return None
    log.info("emulated device: every forward paced to %s (1 row: %.2f ms)", costs.source,
             1e3 * cost(1, 128))  # fmt: skip
    return Pacer(cost, name="stage" if stage else "draft")


def _report(pacer):
    """At stop: what the emulated device did (a benchmark reads it from the log)."""

    async def report() -> None:
        if pacer is not None:
            log.info("emulated device summary %s", json.dumps(pacer.summary()))

    return report


def _serve_metrics(metrics, config: ServiceConfig, host: str) -> dict[str, str]:
    """Start the /metrics server when --metrics-port is given; its address for the
    ready file."""
    if config.metrics_port is None:
        return {}
    port = metrics.serve(config.host, config.metrics_port)
    log.info("metrics at http://%s:%d/metrics", host, port)
    return {"metrics": f"{host}:{port}"}


def _setter(event):
    """A stop that sets `event` (the draft's activity flag: idle from then on)."""

    async def set_it() -> None:
        event.set()

    return set_it


def _closer(metrics):
    async def close() -> None:
        metrics.close()

    return close


def _set_cache_budget(runtime, config: ModelServiceConfig) -> None:
    """Without --max-cache-gib: a share of the device's free memory once the weights are
    loaded (--cache-fraction), not a fixed size whatever the machine; the same for a
    step's working memory without --step-memory-mib. The prefix cache is on unless
    --no-prefix-cache."""
    from specpipe.common.runtime.step_budget import step_bytes_for

    from .modelinfo import cache_budget, free_memory_bytes

    runtime.prefix_caching = not config.no_prefix_cache
    step_mib = getattr(config, "step_memory_mib", None)
    if step_mib is not None:
        runtime.step_bytes = int(step_mib * (1 << 20))
    else:  # measured before the cache takes its share
        runtime.step_bytes = step_bytes_for(free_memory_bytes(runtime.model.device))
    if config.max_cache_gib is None:
        runtime.max_cache_bytes = cache_budget(runtime.model.device, config.cache_fraction)
    log.info("KV cache budget %.2f GiB, step memory %.0f MiB",
             runtime.max_cache_bytes / (1 << 30), runtime.step_bytes / (1 << 20))  # fmt: skip


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
