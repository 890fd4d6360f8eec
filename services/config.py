"""Typed configurations of the three services and of `specpipe up`, and their command lines.

A `StageConfig`, `DraftConfig` or `RouterConfig` is everything one `specpipe
stage|draft|router` process runs with. It is built once from that process's command
line (`from_args`) or, for a child of `specpipe up`, by the launcher, which turns it
into the child's command line (`argv`): one field per flag, named as the flag is
(`--cache-fraction` is `cache_fraction`), so the two directions cannot drift apart
(tests/unit/test_service_config.py parses every `argv()` back). `services/serve.py` maps
a config onto its service's constructor. `DeploymentConfig` is what `specpipe up`
starts (`services/launcher.py`).

No I/O here: files a config names (TLS, API keys, cost models) are read by the process
that runs it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

DEFAULT_ROUTER_PORT = 50051  # the router's gRPC port unless told otherwise
DEFAULT_STAGE_PORT = 50052
DEFAULT_DRAFT_PORT = 50060
DEFAULT_DRAIN_SECONDS = 25.0
# The defaults of the modules that use them, repeated because those modules import torch
# or grpc, which a command line's parser should not wait for (a test checks each equals
# its origin): services/modelinfo.py, services/router/backends.py DEFAULT_STALL_SECONDS,
# services/security.py, common/runtime/lease.py, common/spec/scheduler.py,
# services/transport/__init__.py, services/router/edge.py, services/auth.py.
DEFAULT_CACHE_FRACTION = 0.8
DEFAULT_REPLICA_STALL_SECONDS = 2.0
DEFAULT_SERVER_NAME = "specpipe-internal"
DEFAULT_LEASE_SECONDS = 60.0
DEFAULT_MAX_RUNNING = 64
DEFAULT_MAX_WAITING = 256
DEFAULT_MAX_WAITING_PER_KEY = 64  # requests one API key (or client address) may queue
DEFAULT_HTTP_PER_CLIENT = 64  # connections one client address may hold on the HTTP port
DEFAULT_HTTP_HEADER_TIMEOUT = 5.0
DEFAULT_MAX_PRIORITY = 10  # a client's highest priority unless its API key says otherwise
HTTP_METRICS_ACCESS = ("key", "open", "off")  # services/router/side_endpoints.py
DEFAULT_HTTP_METRICS = HTTP_METRICS_ACCESS[0]
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "none")  # common/spec/tool_parsers.py
DEFAULT_TOOL_CALL_PARSER = TOOL_CALL_PARSERS[0]
TRANSPORTS = ("ucx", "tcp")  # every data plane
TCP = TRANSPORTS[1]

Render = Callable[[str, Any], list[str]]


def flag(default: Any = None, *, name: str | None = None, render: Render | None = None) -> Any:
    """A field that is one command-line flag: `--<field-name>` unless `name` says
    otherwise; `render` writes its value as arguments (default: booleans as a bare flag
    when true, tuples as a repeated flag, None as nothing, anything else as `str`)."""
    return field(default=default, metadata={"flag": name, "render": render})


def _comma(name: str, values: Sequence[str]) -> list[str]:
    return [name, ",".join(values)] if values else []


def _ms(name: str, seconds: float | None) -> list[str]:
    if seconds is None:
        return []
    ms = seconds * 1e3
    return [name, str(int(ms)) if ms == int(ms) else repr(ms)]


def _security_mode(_: str, secure: bool) -> list[str]:
    return ["--secure"] if secure else ["--insecure"]


def _render(name: str, value: Any) -> list[str]:
    if value is None or value is False:
        return []
    if value is True:
        return [name]
    if isinstance(value, tuple):
        return [a for v in value for a in (name, str(v))]
    return [name, str(value)]


C = TypeVar("C", bound="CommandLine")


@dataclass(frozen=True, kw_only=True)
class CommandLine:
    """A configuration whose fields are flags (see `flag`); a field holding another
    `CommandLine` contributes that one's flags."""

    def argv(self) -> list[str]:
        """The command-line arguments that parse back into this configuration."""
        out: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, CommandLine):
                out += value.argv()
                continue
            name = f.metadata.get("flag") or f"--{f.name.replace('_', '-')}"
            out += (f.metadata.get("render") or _render)(name, value)
        return out

    @classmethod
    def from_args(cls: type[C], args: argparse.Namespace) -> C:
        """From parsed arguments whose names are this configuration's fields (lists, as
        argparse's repeated flags give them, become tuples)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            factory = f.default_factory
            if isinstance(factory, type) and issubclass(factory, CommandLine):
                values[f.name] = factory.from_args(args)
                continue
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class SchedulingConfig(CommandLine):
    """The router's admission, elastic width and the defaults of what requests leave
    unset (None: the router's or the engine's default; "auto": the router tunes it)."""

    max_running: int = flag(DEFAULT_MAX_RUNNING)
    max_waiting: int = flag(DEFAULT_MAX_WAITING)
    # Fair shares per API key (or client address without keys): running (None: all but
    # an eighth of max_running, kept for the others) and waiting.
    max_running_per_key: int | None = flag()
    max_waiting_per_key: int = flag(DEFAULT_MAX_WAITING_PER_KEY)
    row_budget: int | str | None = flag()  # tree rows per step shared by running requests
    width: int | str | None = flag()
    layers_per_step: int | str | None = flag()
    token_source: str | None = flag()
    tune_calibration_tokens: int | None = flag()
    tune_price: str | None = flag()  # "wall" or "model"
    late_draft_wait_ms: float | None = flag()

    @classmethod
    def of(cls, values: SchedulingConfig | Mapping[str, object] | None) -> SchedulingConfig:
        """From a mapping of field names (None values: the default)."""
        if isinstance(values, SchedulingConfig):
            return values
        return cls(**{k: v for k, v in (values or {}).items() if v is not None})

    @property
    def tunes(self) -> bool:
        """Some setting is left to the router's tuner."""
        return "auto" in (self.width, self.layers_per_step, self.token_source)

    def needs_costs(self, stage: bool) -> bool:
        """Whether the stages (`stage`) or the draft must measure their cost curves at
        start (`--measure-costs`): the router prices steps with them for auto settings,
        and a stage's also for `--row-budget auto`."""
        return self.tunes or (stage and self.row_budget == "auto")


@dataclass(frozen=True, kw_only=True)
class ServiceConfig(CommandLine):
    """What every service has: where it listens, how it drains, logs and reports
    readiness, and how it talks to the others (docs/architecture.md, "9. Security")."""

    host: str = flag("127.0.0.1")
    advertise_host: str | None = flag()
    port: int = flag(0)
    drain_seconds: float = flag(DEFAULT_DRAIN_SECONDS)
    metrics_port: int | None = flag()
    ready_file: str | None = flag()
    log_level: str = flag("INFO")
    secure: bool = flag(True, render=_security_mode)  # False: --insecure
    tls_dir: str | None = flag()
    data_key_file: str | None = flag()
    tls_server_name: str = flag(DEFAULT_SERVER_NAME)
    health_port: int | None = flag()


@dataclass(frozen=True, kw_only=True)
class ModelServiceConfig(ServiceConfig):
    """A service that holds a model and KV caches: a stage or the draft."""

    model: str | None = flag()
    model_id: str = flag("")
    dtype: str = flag("float32")
    threads: int = flag(0)  # torch CPU threads; 0: torch's default
    device: str = flag("cpu")
    max_cache_gib: float | None = flag()  # None: cache_fraction of the free memory
    cache_fraction: float = flag(DEFAULT_CACHE_FRACTION)
    step_memory_mib: float | None = flag()  # None: a share of the free memory
    lease_seconds: float = flag(DEFAULT_LEASE_SECONDS)
    emulate_costs: str | None = flag()  # a cost model file: an emulated device
    measure_costs: bool = flag(False)
    # How long a round may wait for requests of the same step, in seconds (None: auto).
    batch_wait: float | None = flag(name="--batch-wait-ms", render=_ms)
    no_prefix_cache: bool = flag(False)  # no KV blocks shared by requests' common prefixes

    @property
    def max_cache_bytes(self) -> int | None:
        return None if self.max_cache_gib is None else int(self.max_cache_gib * (1 << 30))


@dataclass(frozen=True, kw_only=True)
class StageConfig(ModelServiceConfig):
    """`specpipe stage`: layers of the target model."""

    port: int = flag(DEFAULT_STAGE_PORT)
    data_port: int = flag(0)
    transport: str | None = flag()  # None: UCX where it imports, else TCP
    layers: str | None = flag()  # START:END; None: every layer
    emulate_stage: int | None = flag()  # which stage curve of emulate_costs
    allow_configure: bool = flag(False)
    peers: tuple[str, ...] = flag((), render=_comma)


@dataclass(frozen=True, kw_only=True)
class DraftConfig(ModelServiceConfig):
    """`specpipe draft`: the draft model."""

    port: int = flag(DEFAULT_DRAFT_PORT)


@dataclass(frozen=True, kw_only=True)
class RouterConfig(ServiceConfig):
    """`specpipe router`: where the replicas are, how lost ones are replaced, the public
    APIs and the scheduling."""

    port: int = flag(DEFAULT_ROUTER_PORT)
    data_port: int = flag(0)
    transport: str | None = flag()
    stages: tuple[str, ...] = flag((), render=_comma)  # a static list of HOST:PORT
    drafts: tuple[str, ...] = flag((), name="--draft", render=_comma)
    discovery: str | None = flag()  # file:PATH or kubernetes, instead of the lists
    discovery_namespace: str | None = flag()
    discovery_selector: str | None = flag()
    replay_seconds: float = flag(10.0)
    max_replays: int = flag(8)
    stall_seconds: float = flag(60.0)
    replica_stall_seconds: float = flag(DEFAULT_REPLICA_STALL_SECONDS)
    target: str | None = flag()  # the target's directory, for its tokenizer
    model_id: str = flag("")
    startup_timeout: float = flag(180.0)
    router_name: str = flag("")
    http_port: int | None = flag()
    http_metrics: str = flag(DEFAULT_HTTP_METRICS)  # /metrics on the HTTP port: key|open|off
    tool_call_parser: str = flag(DEFAULT_TOOL_CALL_PARSER)  # tool_choice "auto"'s format
    api_keys: tuple[str, ...] = flag((), name="--api-key")
    api_key_files: tuple[str, ...] = flag((), name="--api-key-file")
    public_tls_cert: str | None = flag()
    public_tls_key: str | None = flag()
    # The public ports' limits (services/router/edge.py, EdgeLimits; None: its default).
    http_max_connections: int | None = flag()
    http_max_connections_per_client: int = flag(DEFAULT_HTTP_PER_CLIENT)
    http_header_timeout: float = flag(DEFAULT_HTTP_HEADER_TIMEOUT)
    max_priority: int = flag(DEFAULT_MAX_PRIORITY)
    # Cached prompt prefixes shared across API keys (default: per key and cache_salt).
    share_prefix_cache: bool = flag(False)
    # Without API keys, callers on this host see replicas' addresses in Describe.
    describe_internals: bool = flag(False)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)

    def __post_init__(self) -> None:
        if bool(self.public_tls_cert) != bool(self.public_tls_key):
            raise ValueError("--public-tls-cert and --public-tls-key go together")


@dataclass(frozen=True, kw_only=True)
class DeploymentConfig:
    """`specpipe up`: router, draft and stages as local processes (`ServicesDeployment`).
    Values the children share are given once here; the launcher turns them into each
    child's `StageConfig`, `DraftConfig` and `RouterConfig`."""

    target: str | Path
    draft: str | Path | None = None  # a model, "oracle" (the target) or None / "none"
    stages: int = 2
    stage_replicas: int | Sequence[int] = 1  # of every stage, or per stage
    layers: str | None = None  # per-stage ranges 0:7,7:14,...; None: an even split
    transport: str = TCP
    router_port: int = 0  # 0: a free port
    host: str = "127.0.0.1"
    dtype: str = "float32"
    threads: int | None = None  # per process; None: the CPUs but one (the router's), shared
    # Where the stages and the draft run (services/placement.py): "cuda" one GPU per
    # service, round-robin over the visible ones; cpu or cuda:N all on that device.
    device: str = "cpu"
    devices: Sequence[str] = ()  # or one per stage process, then the draft's (--devices)
    drain_seconds: float = DEFAULT_DRAIN_SECONDS
    log_dir: str | Path | None = None  # None: a temporary directory, removed at stop
    startup_timeout: float = 180.0
    env: Mapping[str, str] | None = None  # added to the children's environment
    max_cache_gib: float | None = None  # per stage and draft; None: a share of free memory
    step_memory_mib: float | None = None  # per stage and draft; None: a share of free memory
    http_port: int | None = None  # the router's HTTP API; None: off, 0: any free port
    http_metrics: str = DEFAULT_HTTP_METRICS  # the router's (RouterConfig)
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER  # the router's (RouterConfig)
    api_keys: Sequence[str] = ()
    scheduling: SchedulingConfig | Mapping[str, object] | None = None
    metrics: bool = False  # every process gets a --metrics-port
    replay_seconds: float | None = None  # the router's; None: its default
    group: str = ""  # discovery group (model version) of the first children
    lease_seconds: float | None = None  # of the stages and the draft; None: theirs
    secure: bool = True  # a throwaway CA and certificate; False: --insecure
    public_tls: Any = None  # a security.PublicTls for the router's public ports
    emulate_costs: str | Path | None = None  # every stage (its own curve) and the draft
    batch_wait: float | None = None  # seconds, of every stage and the draft; None: auto
    prefix_cache: bool = True  # False: --no-prefix-cache on every stage and the draft

    def __post_init__(self) -> None:
        # Tests and benchmarks give scheduling as a mapping of field names.
        object.__setattr__(self, "scheduling", SchedulingConfig.of(self.scheduling))
