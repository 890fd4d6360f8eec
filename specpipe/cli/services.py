"""`specpipe stage|draft|router|up|certs`: the network services' command lines.

The flags (`service_flags.py`) are the fields of each command's configuration
(`services/config.py`); `*_config(args)` here builds the typed configuration once, with
every check a user may fail, before anything loads, and the command runs it."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from specpipe.services.config import (
    DeploymentConfig,
    DraftConfig,
    ModelServiceConfig,
    RouterConfig,
    SchedulingConfig,
    ServiceConfig,
    StageConfig,
)

from . import service_flags as flags
from .args import CliError, parse_device


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `stage`, `draft`, `router`, `up` and `certs` commands."""
    p = sub.add_parser("stage", help="serve layers of the target model (a pipeline stage)")
    flags.add_stage_flags(p)
    p.set_defaults(func=_cmd_stage)
    p = sub.add_parser("draft", help="serve a draft model that proposes tree layers")
    flags.add_draft_flags(p)
    p.set_defaults(func=_cmd_draft)
    p = sub.add_parser("router", help="serve clients: trees, verification, streaming")
    flags.add_router_flags(p)
    p.set_defaults(func=_cmd_router)
    p = sub.add_parser("up", help="run router, draft and stages as local processes")
    flags.add_up_flags(p)
    p.set_defaults(func=_cmd_up)
    p = sub.add_parser(
        "certs",
        help="make a CA, a certificate and a data-plane key for --secure (ca.crt, tls.crt, "
        "tls.key, data.key: a Kubernetes Secret's files)",
    )
    flags.add_certs_flags(p)
    p.set_defaults(func=_cmd_certs)


# -- configurations ----------------------------------------------------------------------

INSECURE_WARNING = (
    "--insecure: gRPC and the data plane among router, stages and draft are plaintext and "
    "unauthenticated; anyone who reaches these ports can call them (use --secure)"
)


def _check_security_mode(args: argparse.Namespace) -> None:
    """Services started by hand say how they talk to each other: nothing is insecure by
    default (docs/architecture.md, "9. Security")."""
    if not (args.secure or args.insecure):
        raise CliError(
            f"specpipe {args.command} needs --secure (with --tls-dir: `specpipe certs DIR` "
            "makes one) or --insecure (plaintext, only on a network you trust completely)"
        )


def _checked_security(config: ServiceConfig) -> None:
    if not config.secure:
        return
    if not config.tls_dir:
        raise CliError("--secure needs --tls-dir (or $SPECPIPE_TLS_DIR)")
    from specpipe.services.security import SecurityError
    from specpipe.services.serve import security_of

    try:
        security_of(config)
    except SecurityError as e:
        raise CliError(str(e)) from None


def _default_transport() -> str:
    from specpipe.services.transport import TCP, UCX
    from specpipe.services.transport.ucx import available

    return UCX if available() else TCP


def _resolve(spec: str | None) -> str | None:
    if spec is None:
        return None
    from specpipe.common.store.resolver import resolve_model

    return str(resolve_model(spec))


def _check_costs(config: ModelServiceConfig, stage: int | None = None) -> None:
    """A bad --emulate-costs file is a usage error before anything loads."""
    if not config.emulate_costs:
        return
    from specpipe.common.perf.emulate import EmulatedCosts

    try:
        costs = EmulatedCosts.load(config.emulate_costs)
        if isinstance(config, StageConfig):
            costs.stage(config.emulate_stage)
    except ValueError as e:
        raise CliError(str(e)) from None


def stage_config(args: argparse.Namespace) -> StageConfig:
    """`specpipe stage`'s configuration, checked (the model not resolved yet)."""
    from specpipe.services.peers import Peers

    _check_security_mode(args)
    config = StageConfig.from_args(args)
    if not config.model and not config.allow_configure:
        raise CliError("a stage without --model waits for Configure: give --allow-configure")
    _check_costs(config)
    try:
        Peers.parse(config.peers)
    except ValueError as e:
        raise CliError(f"--peers: {e}") from None
    return config


def draft_config(args: argparse.Namespace) -> DraftConfig:
    """`specpipe draft`'s configuration, checked (the model not resolved yet)."""
    _check_security_mode(args)
    config = DraftConfig.from_args(args)
    _check_costs(config)
    return config


def router_config(args: argparse.Namespace) -> RouterConfig:
    """`specpipe router`'s configuration."""
    from specpipe.services.router.edge import EdgeLimits

    _check_security_mode(args)
    try:
        config = RouterConfig.from_args(args)
        EdgeLimits.of(config)  # checked now: a bad limit is a command-line error
    except ValueError as e:
        raise CliError(str(e)) from None
    return config


def deployment_config(args: argparse.Namespace) -> DeploymentConfig:
    """`specpipe up`'s configuration (API keys and public TLS loaded from their files)."""
    from specpipe.services.serve import load_api_keys, load_public_tls

    try:
        router = RouterConfig(  # the router's flags that `up` has too
            api_keys=tuple(args.api_keys),
            api_key_files=tuple(args.api_key_files),
            public_tls_cert=args.public_tls_cert,
            public_tls_key=args.public_tls_key,
        )
        api_keys, public_tls = load_api_keys(router), load_public_tls(router)
    except ValueError as e:
        raise CliError(str(e)) from None
    given = {name: getattr(args, name) for name in flags.UP_FIELDS}
    given.update(device=parse_device(args.device), devices=tuple(map(parse_device, args.devices)))
    return DeploymentConfig(
        **given,
        target=_resolve(args.target),
        draft=args.draft if args.draft in ("oracle", "none") else _resolve(args.draft),
        dtype=args.dtype,
        threads=args.threads or None,
        api_keys=api_keys.lines,  # with their attributes (max_priority=N, operator)
        scheduling=SchedulingConfig.from_args(args),
        metrics=not args.no_metrics,
        secure=not args.insecure,
        public_tls=public_tls,
        prefix_cache=not args.no_prefix_cache,
    )


# -- commands ----------------------------------------------------------------------------


def _prepare(config: ServiceConfig) -> None:
    """What every service process does first: stop with its launcher, log, warn when
    insecure, check its credentials."""
    from specpipe.services.launcher import watch_parent
    from specpipe.services.serve import log, setup_logging

    watch_parent()  # started by `specpipe up`: stop when it is gone
    setup_logging(config.log_level)
    if not config.secure:
        log.warning(INSECURE_WARNING)
    _checked_security(config)


def _set_threads(threads: int) -> None:
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def _cmd_stage(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from specpipe.services.serve import exit_stopped, run_stage

    config = stage_config(args)
    config = replace(config, device=parse_device(config.device))
    _prepare(config)
    config = replace(
        config, transport=config.transport or _default_transport(), model=_resolve(config.model)
    )
    _set_threads(config.threads)
    asyncio.run(run_stage(config))
    exit_stopped()
    return 0


def _cmd_draft(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from specpipe.services.serve import exit_stopped, run_draft

    config = draft_config(args)
    config = replace(config, device=parse_device(config.device))
    _prepare(config)
    config = replace(config, model=_resolve(config.model))
    _set_threads(config.threads)
    asyncio.run(run_draft(config))
    exit_stopped()
    return 0


def _cmd_router(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from specpipe.services.serve import RouterInputs, exit_stopped, run_router

    config = router_config(args)
    _prepare(config)
    config = replace(
        config, transport=config.transport or _default_transport(), target=_resolve(config.target)
    )
    try:
        inputs = RouterInputs.load(config)
    except ValueError as e:
        raise CliError(str(e)) from None
    asyncio.run(run_router(config, inputs))
    exit_stopped()
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from specpipe.services.launcher import (
        LaunchError,
        ServicesDeployment,
        StopRequested,
        stop_on_signals,
    )
    from specpipe.services.serve import exit_stopped

    config = deployment_config(args)
    try:
        dep = ServicesDeployment(config)
    except ValueError as e:
        raise CliError(str(e)) from None
    replicas = f" x{args.stage_replicas}" if args.stage_replicas > 1 else ""
    print(
        f"starting {len(dep.ranges)} stages{replicas} "
        f"({', '.join(f'{r.start}:{r.end}' for r in dep.ranges)}), "
        f"draft={config.draft}, transport={config.transport} ...",
        file=sys.stderr,
        flush=True,
    )
    for line in [*dep.placement.report(), dep.data_plane()]:
        print(f"  {line}", file=sys.stderr, flush=True)
    if not config.secure:
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
                scheme = "https" if config.public_tls else "http"
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
