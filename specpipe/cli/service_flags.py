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
    DeploymentConfig,
    DraftConfig,
    ModelServiceConfig,
    RouterConfig,
    SchedulingConfig,
    ServiceConfig,
    StageConfig,
)
from specpipe.services.settings import add_flags, setting_fields

from .args import add_dtype_arg, positive_int

# What `specpipe up` gives every stage and the draft, and its router, as they declare
# it: fields of DeploymentConfig too, and the router's keys and TLS files (loaded first).
UP_MODEL_SETTINGS = ("batch_wait", "emulate_costs")
UP_ROUTER_SETTINGS = ("http_port", "http_metrics", "tool_call_parser")
UP_ROUTER_FILES = ("api_keys", "api_key_files", "public_tls_cert", "public_tls_key")
# Every `specpipe up` flag that is a DeploymentConfig field as it is.
UP_FIELDS = (
    *(f.name for f, _ in setting_fields(DeploymentConfig)),
    *UP_MODEL_SETTINGS,
    *UP_ROUTER_SETTINGS,
)


def add_stage_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p, StageConfig)


def add_draft_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p, DraftConfig, required=("model",))


def add_router_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p, RouterConfig)


def add_up_flags(p: argparse.ArgumentParser) -> None:
    """`DeploymentConfig`'s flags, the ones it shares with the services from their
    declarations, and the few `deployment_config` turns into fields."""
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default="none", help="draft model, 'oracle' (the target) or 'none'")
    add_flags(p, DeploymentConfig)
    add_dtype_arg(p)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per model process, all along (0: each stage the host's cores "
        "shared by the stages, the draft every core, one for a small model; "
        "--split-cores-while-drafting splits them while the draft works; services/cpu_threads.py)",
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="every stage and the draft without the prefix cache (every prompt prefilled whole)",
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
    add_flags(p, ModelServiceConfig, only=UP_MODEL_SETTINGS)
    add_flags(p, RouterConfig, only=UP_ROUTER_SETTINGS + UP_ROUTER_FILES)
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
