"""The flags of `specpipe stage|draft|router|up|certs`.

A service command's flags are built from the fields of its configuration
(`services/config.py`: each field declares its flag's help, parsing and choices once,
`services/settings.py`), and `StageConfig.from_args` and the others read the parsed
flags back. What the commands do with them is `services.py`. `specpipe up` and `certs`
have flags of their own (`DeploymentConfig` gives shared values once for all children);
the ones `up` shares with the services come from the same fields."""

from __future__ import annotations

import argparse

from specpipe.services.config import (
    TRANSPORTS,
    DeploymentConfig,
    DraftConfig,
    ModelServiceConfig,
    RouterConfig,
    SchedulingConfig,
    ServiceConfig,
    StageConfig,
)
from specpipe.services.settings import add_flags, comma_list

from .args import DEFAULT_ROUTER_PORT, add_dtype_arg, positive_int

# The router's public-API settings that `specpipe up` passes on to its router.
HTTP_SETTINGS = (
    "http_port",
    "http_metrics",
    "tool_call_parser",
    "api_keys",
    "api_key_files",
    "public_tls_cert",
    "public_tls_key",
)


def add_stage_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p, StageConfig)


def add_draft_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p, DraftConfig, required=("model",))


def add_router_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p, RouterConfig)


def add_up_flags(p: argparse.ArgumentParser) -> None:
    defaults = DeploymentConfig(target="")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default="none", help="draft model, 'oracle' (the target) or 'none'")
    p.add_argument("--stages", type=positive_int, default=defaults.stages)
    p.add_argument(
        "--stage-replicas",
        type=positive_int,
        default=1,
        help="replicas of every stage (the router picks one of each per request)",
    )
    p.add_argument("--layers", default=None, help="per-stage layer ranges: 0:7,7:14,...")
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="every stage and the draft without the prefix cache (every prompt prefilled whole)",
    )
    p.add_argument(
        "--transport",
        choices=list(TRANSPORTS),
        default=defaults.transport,
        help="data plane between the local processes (default tcp: on one host UCX has no "
        "RDMA/NVLink to use, and its polling progress was measured slower on small CPU nodes)",
    )
    p.add_argument("--router-port", type=int, default=DEFAULT_ROUTER_PORT)
    p.add_argument("--host", default=defaults.host)
    add_dtype_arg(p)
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: auto)")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--device",
        default=defaults.device,
        help="where the stages and the draft run: cuda (one GPU per service, round-robin "
        "over the visible GPUs; with fewer GPUs than services some share one, as printed at "
        "start), cuda:N (all on GPU N), cpu (default), or auto (cuda if available, else cpu)",
    )
    where.add_argument(
        "--devices",
        type=comma_list,
        default=tuple(defaults.devices),
        help="every service's device instead: one per stage process (in pipeline order, a "
        "stage's replicas together), then the draft's, e.g. cuda:0,cuda:1,cuda:1",
    )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=defaults.drain_seconds,
        help="on Ctrl-C/SIGTERM: how long open requests may finish before the processes stop",
    )
    p.add_argument("--log-dir", default=None, help="keep child logs here")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--max-cache-gib", type=float, default=None, help="KV cache budget per stage")
    p.add_argument(
        "--step-memory-mib",
        type=float,
        default=None,
        help="working memory one step may take per stage and draft (default: a share of "
        "the device's free memory)",
    )
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
    add_flags(p, ModelServiceConfig, only=("batch_wait", "emulate_costs"))
    add_flags(p, RouterConfig, only=HTTP_SETTINGS)
    add_flags(p, SchedulingConfig)


def add_certs_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="directory to write them to (created)")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        help="an extra name or IP the certificate carries (repeatable)",
    )
    p.add_argument("--server-name", default=ServiceConfig().tls_server_name)
    p.add_argument("--days", type=positive_int, default=365)
