"""`specpipe stage|draft|router|up|client`: the network services' command lines."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from specpipe.common.runtime.alignment import AUTO_CAP, MAX_WAIT

from .args import (
    DEFAULT_ROUTER_PORT,
    CliError,
    add_device_arg,
    add_dtype_arg,
    auto_or_positive_int,
    non_negative_float,
    parse_device,
    positive_int,
)

DEFAULT_DRAIN_SECONDS = 25.0


def _default_transport() -> str:
    from specpipe.services.transport import TCP, UCX
    from specpipe.services.transport.ucx import available

    return UCX if available() else TCP


def _service_args(p: argparse.ArgumentParser, port: int, data_plane: bool) -> None:
    from specpipe.services.transport import TRANSPORTS

    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    p.add_argument("--advertise-host", default=None, help="address others reach this one at")
    p.add_argument("--port", type=int, default=port, help="gRPC port (0: any free port)")
    if data_plane:
        p.add_argument("--data-port", type=int, default=0, help="hidden-state port (0: any)")
        p.add_argument(
            "--transport",
            choices=list(TRANSPORTS),
            default=None,
            help="data plane (default: ucx if installed)",
        )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=DEFAULT_DRAIN_SECONDS,
        help="on SIGTERM: NOT_SERVING, refuse new requests, let open ones finish this long "
        "(keep it below the pod's terminationGracePeriodSeconds)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at /metrics on this port (0: any free port; default: none)",
    )
    p.add_argument("--ready-file", default=None, help="write addresses here (JSON) once serving")
    p.add_argument("--log-level", default=os.environ.get("SPECPIPE_LOG_LEVEL", "INFO"))
    _secure_args(p)


def _secure_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "security (docs/architecture.md, section 9); one of --secure and --insecure is required"
    )
    mode = g.add_mutually_exclusive_group()
    mode.add_argument(
        "--secure",
        action="store_true",
        help="mutual TLS on gRPC among router, stages and draft, and authenticated "
        "data-plane frames (needs --tls-dir)",
    )
    mode.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext, unauthenticated gRPC and data plane among the services (anyone "
        "who reaches their ports can call them): only on a network you trust completely",
    )
    g.add_argument(
        "--tls-dir",
        default=os.environ.get("SPECPIPE_TLS_DIR") or None,
        help="ca.crt, tls.crt, tls.key (a Kubernetes TLS Secret's layout) and optionally "
        "data.key (default: $SPECPIPE_TLS_DIR)",
    )
    g.add_argument(
        "--data-key-file",
        default=None,
        help="the data plane's shared secret (default: TLS_DIR/data.key, else derived "
        "from tls.key, which every service then must share)",
    )
    g.add_argument(
        "--tls-server-name",
        default="specpipe-internal",
        help="the name the deployment's certificates carry (checked instead of hosts)",
    )
    g.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also serve plaintext gRPC health alone on this port (Kubernetes' gRPC probes "
        "speak no TLS)",
    )


def _model_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--model", required=required, help="model: name, HF directory or GGUF file")
    p.add_argument(
        "--model-id", default="", help="name reported to clients (default: directory name)"
    )
    add_dtype_arg(p)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument(
        "--max-cache-gib",
        type=float,
        default=None,
        help="KV cache budget (default: --cache-fraction of the device's free memory)",
    )
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=0.8,
        help="without --max-cache-gib: this share of the device's free memory once the "
        "weights are loaded",
    )
    p.add_argument(
        "--lease-seconds",
        type=float,
        default=60.0,
        help="free a request's state when its router has not renewed it for this long",
    )
    add_device_arg(p)
    _emulate_arg(p)
    _prefix_cache_arg(p)


def _prefix_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="turn the prefix cache off: no KV cache blocks shared between requests with a "
        "common prompt prefix, every prompt prefilled whole",
    )


def _batch_wait_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--batch-wait-ms",
        type=_batch_wait,
        default=None,
        metavar="MS|auto",
        help="how long a stage's (or the draft's) round may wait for requests of the same "
        "pipeline step, so that they share one forward (default auto: half the stage's recent forward "
        f"time, at most {AUTO_CAP * 1e3:.0f} ms; 0: never wait)",
    )


def _batch_wait(text: str) -> float | None:
    """Milliseconds as seconds, or None for auto."""
    if text == "auto":
        return None
    try:
        ms = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds or 'auto', got {text!r}") from None
    if not 0 <= ms <= MAX_WAIT * 1e3:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_WAIT * 1e3:.0f}] ms, got {text}")
    return ms / 1e3


def _emulate_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--emulate-costs",
        default=None,
        metavar="FILE",
        help="emulated device: pace every forward to the cost model in FILE (JSON: a "
        "measured curve of seconds per row count, or flat), sleeping the rest of its "
        "modelled time (docs/architecture.md, 'Emulated devices')",
    )


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `stage`, `draft`, `router`, `up` and `client` commands."""
    from specpipe.services.transport import TCP, TRANSPORTS

    p = sub.add_parser("stage", help="serve layers of the target model (a pipeline stage)")
    _model_args(p, required=False)
    p.add_argument("--layers", default=None, help="START:END decoder layers (default: all)")
    p.add_argument(
        "--measure-costs",
        action="store_true",
        help="measure this stage's cost per row count at start and report the rows a step "
        "can take nearly free (for the router's --row-budget auto)",
    )
    p.add_argument(
        "--emulate-stage",
        type=int,
        default=None,
        metavar="K",
        help="with --emulate-costs: which of FILE's stage curves this stage paces to "
        "(0-based; default: FILE's only one)",
    )
    p.add_argument(
        "--allow-configure",
        action="store_true",
        help="accept Configure calls (loading other weights over gRPC; off by default)",
    )
    p.add_argument(
        "--peers",
        default="",
        help="comma-separated hosts, addresses and CIDR networks a request's next hop and "
        "report address may name, in every mode (default: loopback only)",
    )
    _batch_wait_arg(p)
    _service_args(p, 50052, data_plane=True)
    p.set_defaults(func=_cmd_stage)

    p = sub.add_parser("draft", help="serve a draft model that proposes tree layers")
    _model_args(p, required=True)
    p.add_argument(
        "--measure-costs",
        action="store_true",
        help="measure the draft's cost per row count at start (for the router's auto settings)",
    )
    _batch_wait_arg(p)
    _service_args(p, 50060, data_plane=False)
    p.set_defaults(func=_cmd_draft)

    p = sub.add_parser("router", help="serve clients: trees, verification, streaming")
    p.add_argument(
        "--stages",
        default=None,
        help="comma-separated stage gRPC addresses HOST:PORT (a static list)",
    )
    p.add_argument(
        "--draft", default=None, help="draft gRPC address(es) HOST:PORT, comma-separated"
    )
    p.add_argument(
        "--discovery",
        default=None,
        metavar="SOURCE",
        help="where the stage and draft replicas are, followed while serving instead of "
        "--stages/--draft: file:PATH (one 'stage|draft HOST:PORT [GROUP]' a line, re-read "
        "when it changes) or kubernetes (the EndpointSlices of the release's stage and "
        "draft Services, watched through the API server)",
    )
    p.add_argument(
        "--discovery-namespace",
        default=None,
        help="kubernetes: the namespace to watch (default: the pod's own)",
    )
    p.add_argument(
        "--discovery-selector",
        default=None,
        help="kubernetes: label selector of the EndpointSlices (default: "
        "'app.kubernetes.io/component in (stage,draft)')",
    )
    p.add_argument(
        "--replay-seconds",
        type=float,
        default=10.0,
        help="when a replica on a request's path is lost: how long to wait for another "
        "path before the request fails UNAVAILABLE",
    )
    p.add_argument(
        "--max-replays",
        type=positive_int,
        default=8,
        help="how many times one request may be replayed on another path before it fails "
        "UNAVAILABLE (each replica lost on its path costs one)",
    )
    p.add_argument(
        "--stall-seconds",
        type=float,
        default=60.0,
        help="the watchdog: a path that sends nothing for this long counts as lost (the "
        "request is replayed on another, and fails UNAVAILABLE after --replay-seconds "
        "without one)",
    )

    def stall_seconds(text: str) -> float:
        value = float(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
        return value

    p.add_argument(
        "--replica-stall-seconds",
        type=stall_seconds,
        default=2.0,  # services/router/backends.py DEFAULT_STALL_SECONDS (a test checks)
        help="a replica that answers no health check for this long is stalled: it takes "
        "no new requests, and a request waiting on it is replayed on another path as if "
        "it had died (default %(default)s)",
    )
    p.add_argument("--target", default=None, help="target model directory (for its tokenizer)")
    p.add_argument("--model-id", default="", help="name clients use (default: the stages')")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument(
        "--router-name",
        default="",
        help="this router's name on the stages and the draft (default HOST:PORT): a router "
        "restarted under the same name frees its predecessor's requests at once",
    )
    _service_args(p, DEFAULT_ROUTER_PORT, data_plane=True)
    _http_args(p)
    _scheduling_args(p)
    p.set_defaults(func=_cmd_router)

    p = sub.add_parser("up", help="run router, draft and stages as local processes")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default="none", help="draft model, 'oracle' (the target) or 'none'")
    p.add_argument("--stages", type=positive_int, default=2)
    p.add_argument(
        "--stage-replicas",
        type=positive_int,
        default=1,
        help="replicas of every stage (the router picks one of each per request)",
    )
    p.add_argument("--layers", default=None, help="per-stage layer ranges: 0:7,7:14,...")
    p.add_argument(
        "--transport",
        choices=list(TRANSPORTS),
        default=TCP,
        help="data plane between the local processes (default tcp: on one host UCX has no "
        "RDMA/NVLink to use, and its polling progress was measured slower on small CPU nodes)",
    )
    p.add_argument("--router-port", type=int, default=DEFAULT_ROUTER_PORT)
    p.add_argument("--host", default="127.0.0.1")
    add_dtype_arg(p)
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: auto)")
    add_device_arg(p)
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=DEFAULT_DRAIN_SECONDS,
        help="on Ctrl-C/SIGTERM: how long open requests may finish before the processes stop",
    )
    p.add_argument("--log-dir", default=None, help="keep child logs here")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--max-cache-gib", type=float, default=None, help="KV cache budget per stage")
    p.add_argument(
        "--no-metrics",
        action="store_true",
        help="do not give every process a Prometheus metrics port",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--secure",
        action="store_true",
        help="the default: mutual TLS and authenticated frames among the processes, with a "
        "throwaway CA and certificate made in the log directory, and next hops only to "
        "this host (--peers)",
    )
    mode.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext, unauthenticated gRPC and data plane among the processes (their "
        "ports listen on --host): only on a network you trust completely",
    )
    p.add_argument("--lease-seconds", type=float, default=None, help="of the stages and draft")
    _batch_wait_arg(p)
    _emulate_arg(p)
    _prefix_cache_arg(p)
    _http_args(p)
    _scheduling_args(p)
    p.set_defaults(func=_cmd_up)

    p = sub.add_parser(
        "certs",
        help="make a CA, a certificate and a data-plane key for --secure (ca.crt, tls.crt, "
        "tls.key, data.key: a Kubernetes Secret's files)",
    )
    p.add_argument("out", help="directory to write them to (created)")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        help="an extra name or IP the certificate carries (repeatable)",
    )
    p.add_argument("--server-name", default="specpipe-internal")
    p.add_argument("--days", type=positive_int, default=365)
    p.set_defaults(func=_cmd_certs)


def _scheduling_args(p: argparse.ArgumentParser) -> None:
    from specpipe.common.spec.scheduler import DEFAULT_MAX_RUNNING, DEFAULT_MAX_WAITING

    p.add_argument(
        "--max-running",
        type=positive_int,
        default=DEFAULT_MAX_RUNNING,
        help="requests decoding at once; more wait, by priority",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=DEFAULT_MAX_WAITING,
        help="requests queued beyond --max-running; more are refused (RESOURCE_EXHAUSTED)",
    )
    p.add_argument(
        "--row-budget",
        default=None,
        type=auto_or_positive_int,
        help="tree rows per pipeline step shared by the running requests (elastic width: "
        "best-effort requests shrink first); N, or 'auto' from the stages' measured costs "
        "(default: every request keeps its width)",
    )
    # Defaults for requests that leave these unset; "auto": the router tunes them.
    p.add_argument(
        "--width",
        default=None,
        type=auto_or_positive_int,
        help="tree width of requests that set none: N or 'auto' (chosen from the measured "
        "costs and tokens per step; default: the engine's)",
    )
    p.add_argument(
        "--layers-per-step",
        default=None,
        type=auto_or_positive_int,
        help="specpipe tree layers per step of requests that set none: K or 'auto'",
    )
    p.add_argument(
        "--token-source",
        default=None,
        choices=["draft", "ngram", "hybrid", "auto"],
        help="what proposes tree tokens for requests that set none (default: draft)",
    )
    p.add_argument(
        "--tune-calibration-tokens",
        default=None,
        type=positive_int,
        help="auto settings: tokens measured with each candidate before the best is chosen "
        "(default 256)",
    )
    p.add_argument(
        "--tune-price",
        default=None,
        choices=["wall", "model"],
        help="auto settings go by the time between tokens measured (wall, default) or by "
        "the cost curves over tokens per step (model)",
    )
    p.add_argument(
        "--late-draft-wait-ms",
        default=None,
        type=non_negative_float,
        help="how long a verification may wait for a draft answer that is late (lockstep "
        "would have it): the tree keeps its layer instead of missing it (default 0: never "
        "wait)",
    )


def _http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health) on this port (0: any free port; default: no HTTP API)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require this key (Authorization: Bearer KEY) on the HTTP API and the gRPC "
        "Generation API; repeatable",
    )
    p.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        metavar="FILE",
        help="require one of the keys in FILE (one a line, '#' comments); repeatable",
    )
    p.add_argument(
        "--public-tls-cert",
        default=None,
        help="serve the public gRPC and HTTP ports over TLS with this certificate (PEM)",
    )
    p.add_argument("--public-tls-key", default=None, help="the key of --public-tls-cert (PEM)")


def _public_tls(args: argparse.Namespace):
    if bool(args.public_tls_cert) != bool(args.public_tls_key):
        raise CliError("--public-tls-cert and --public-tls-key go together")
    if not args.public_tls_cert:
        return None
    from specpipe.services.security import PublicTls, SecurityError

    try:
        return PublicTls.load(args.public_tls_cert, args.public_tls_key)
    except (SecurityError, ValueError) as e:
        raise CliError(f"public TLS: {e}") from None


def _api_keys(args: argparse.Namespace):
    from specpipe.services.auth import ApiKeyError, ApiKeys

    try:
        return ApiKeys.load(args.api_key, args.api_key_file)
    except ApiKeyError as e:
        raise CliError(str(e)) from None


INSECURE_WARNING = (
    "--insecure: gRPC and the data plane among router, stages and draft are plaintext and "
    "unauthenticated; anyone who reaches these ports can call them (use --secure)"
)


def _check_security_mode(args: argparse.Namespace) -> None:
    """Services started by hand say how they talk to each other: nothing is insecure by
    default (DESIGN.md, section 8)."""
    if not (args.secure or args.insecure):
        raise CliError(
            f"specpipe {args.command} needs --secure (with --tls-dir: `specpipe certs DIR` "
            "makes one) or --insecure (plaintext, only on a network you trust completely)"
        )


def _prepare(args: argparse.Namespace) -> None:
    from specpipe.services.launcher import watch_parent
    from specpipe.services.serve import log, security_of, setup_logging

    watch_parent()  # started by `specpipe up`: stop when it is gone
    _check_security_mode(args)
    setup_logging(args.log_level)
    if args.insecure:
        log.warning(INSECURE_WARNING)
    if args.secure and not args.tls_dir:
        raise CliError("--secure needs --tls-dir (or $SPECPIPE_TLS_DIR)")
    if args.secure:
        from specpipe.services.security import SecurityError

        try:
            security_of(args)
        except SecurityError as e:
            raise CliError(str(e)) from None
    if getattr(args, "transport", "x") is None:
        args.transport = _default_transport()
    threads = getattr(args, "threads", 0)
    if threads and threads > 0:
        import torch

        torch.set_num_threads(threads)


def _resolve(spec: str | None) -> str | None:
    if spec is None:
        return None
    from specpipe.common.store.resolver import resolve_model

    return str(resolve_model(spec))


def _check_costs(args: argparse.Namespace, stage: bool) -> None:
    """A bad --emulate-costs file is a usage error before anything loads."""
    if not args.emulate_costs:
        return
    from specpipe.common.perf.emulate import EmulatedCosts

    try:
        costs = EmulatedCosts.load(args.emulate_costs)
        if stage:
            costs.stage(args.emulate_stage)
    except ValueError as e:
        raise CliError(str(e)) from None


def _cmd_stage(args: argparse.Namespace) -> int:
    from specpipe.services.peers import Peers
    from specpipe.services.serve import exit_stopped, run_stage

    if not args.model and not args.allow_configure:
        raise CliError("a stage without --model waits for Configure: give --allow-configure")
    _check_costs(args, stage=True)
    args.peers = [h.strip() for h in args.peers.split(",") if h.strip()]
    try:
        Peers.parse(args.peers)
    except ValueError as e:
        raise CliError(f"--peers: {e}") from None
    args.device = parse_device(args.device)
    _prepare(args)
    args.model = _resolve(args.model)
    asyncio.run(run_stage(args))
    exit_stopped()
    return 0


def _cmd_draft(args: argparse.Namespace) -> int:
    from specpipe.services.serve import exit_stopped, run_draft

    args.device = parse_device(args.device)
    _check_costs(args, stage=False)
    _prepare(args)
    args.model = _resolve(args.model)
    asyncio.run(run_draft(args))
    exit_stopped()
    return 0


def _cmd_router(args: argparse.Namespace) -> int:
    from specpipe.services.router.discovery import DiscoveryError, make_discovery
    from specpipe.services.serve import exit_stopped, run_router

    _prepare(args)
    stages = [s.strip() for s in (args.stages or "").split(",") if s.strip()]
    drafts = [s.strip() for s in (args.draft or "").split(",") if s.strip()]
    try:
        args.discovery = make_discovery(
            args.discovery, stages, drafts, args.discovery_namespace, args.discovery_selector
        )
    except DiscoveryError as e:
        raise CliError(str(e)) from None
    args.api_keys = _api_keys(args)
    args.public_tls = _public_tls(args)
    args.target = _resolve(args.target)
    asyncio.run(run_router(args))
    exit_stopped()
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from specpipe.services.launcher import (
        LaunchError,
        ServicesDeployment,
        StopRequested,
        stop_on_signals,
    )
    from specpipe.services.serve import exit_stopped, scheduling_options

    transport = args.transport
    device = parse_device(args.device)
    target = _resolve(args.target)
    draft = args.draft if args.draft in ("oracle", "none") else _resolve(args.draft)
    api_keys = _api_keys(args)
    public_tls = _public_tls(args)
    try:
        dep = ServicesDeployment(
            target,
            draft,
            args.stages,
            transport=transport,
            router_port=args.router_port,
            layers=args.layers,
            host=args.host,
            dtype=args.dtype,
            threads=args.threads or None,
            device=device,
            drain_seconds=args.drain_seconds,
            log_dir=args.log_dir,
            startup_timeout=args.startup_timeout,
            max_cache_gib=args.max_cache_gib,
            http_port=args.http_port,
            api_keys=api_keys.keys,
            scheduling=scheduling_options(args),
            stage_replicas=args.stage_replicas,
            metrics=not args.no_metrics,
            secure=not args.insecure,
            lease_seconds=args.lease_seconds,
            public_tls=public_tls,
            emulate_costs=args.emulate_costs,
            batch_wait=args.batch_wait_ms,
            prefix_cache=not args.no_prefix_cache,
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    replicas = f" x{args.stage_replicas}" if args.stage_replicas > 1 else ""
    print(
        f"starting {len(dep.ranges)} stages{replicas} "
        f"({', '.join(f'{r.start}:{r.end}' for r in dep.ranges)}), "
        f"draft={draft}, transport={transport}, device={device} ...",
        file=sys.stderr,
        flush=True,
    )
    if args.insecure:
        print(f"specpipe up: warning: {INSECURE_WARNING}", file=sys.stderr, flush=True)
    with stop_on_signals(dep):  # from here to the end: a second Ctrl-C kills at once
        try:
            address = dep.start()
        except LaunchError as e:
            raise CliError(str(e)) from None
        except StopRequested:
            exit_stopped(128 + (dep.stop_signal or signal.SIGINT))
        try:
            print(f"router: {address}", flush=True)
            if dep.http_address:
                scheme = "https" if public_tls else "http"
                print(f"http: {scheme}://{dep.http_address}/v1", flush=True)
            for name, metrics in dep.metrics_addresses().items():
                print(f"metrics {name}: http://{metrics}/metrics", flush=True)
            print("serving; Ctrl-C stops every process", file=sys.stderr, flush=True)
            code = dep.wait()
        finally:
            dep.stop()
    exit_stopped(code)
    return code


def _cmd_certs(args: argparse.Namespace) -> int:
    from specpipe.services.security import make_pki

    hosts = ["127.0.0.1", "localhost", *args.host]
    out = make_pki(args.out, hosts=hosts, server_name=args.server_name, days=args.days)
    print(f"wrote {out}/ca.crt, tls.crt, tls.key, data.key (the CA's key is not kept)")
    print(f"kubectl create secret generic specpipe-internal-tls --from-file={out}")
    return 0


# -- client ------------------------------------------------------------------------------
