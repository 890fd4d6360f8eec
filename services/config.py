"""Typed configurations of the three services and of `specpipe up`, and their command lines.

A `StageConfig`, `DraftConfig` or `RouterConfig` is everything one `specpipe
stage|draft|router` process runs with. It is built once from that process's command
line (`from_args`) or, for a child of `specpipe up`, by the launcher, which turns it
into the child's command line (`argv`): one field per flag, named as the flag is
(`--cache-fraction` is `cache_fraction`), and each field declares its flag's help,
parsing and choices (`settings.flag`), from which `specpipe/cli/service_flags.py`
builds the parsers; so a setting is written once and the directions cannot drift apart
(tests/unit/test_service_config.py parses every `argv()` back,
tests/unit/test_service_flags.py checks every flag is a field's). `services/serve.py` maps
a config onto its service's constructor. `DeploymentConfig` is what `specpipe up`
starts (`services/launcher.py`).

One module, though long: it is every service setting with its flag's help, looked up by
name in one file (these were written twice before, here and in the parser).

No I/O here: files a config names (TLS, API keys, cost models) are read by the process
that runs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpipe.common.runtime.alignment import AUTO_CAP, MAX_WAIT

from .settings import (
    CommandLine,
    auto_or_positive_int,
    comma_list,
    flag,
    ms_or_auto,
    non_negative_float,
    positive_int,
    positive_seconds,
    render_comma,
    render_ms,
)

__all__ = ["CommandLine", "flag"]  # re-exported: tests and the launcher import them here

DEFAULT_ROUTER_PORT = 50051  # the router's gRPC port unless told otherwise
DEFAULT_STAGE_PORT = 50052
DEFAULT_DRAFT_PORT = 50060
DEFAULT_DRAIN_SECONDS = 25.0
# The router's defaults, named once: services/router/driver.py and path_session.py use
# them too (services/router/service.py and serve.py should: a note for their rewrite).
DEFAULT_REPLAY_SECONDS = 10.0  # how long a request waits for another path when one is lost
DEFAULT_PATH_STALL_SECONDS = 60.0  # a path silent this long counts as lost
# None: a verification may wait up to one measured pipeline step for a late draft answer
# (services/router/late_draft.py, StepWait)
DEFAULT_LATE_DRAFT_WAIT_MS: float | None = None
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
TOOL_CALL_PARSERS = (
    "auto",
    "hermes",
    "llama3_json",
    "qwen2_5_coder",
    "none",
)  # common/spec/tool_parsers.py
DEFAULT_TOOL_CALL_PARSER = TOOL_CALL_PARSERS[0]
TRANSPORTS = ("ucx", "tcp")  # every data plane
TCP = TRANSPORTS[1]
DTYPE_CHOICES = ("float32", "bfloat16", "float64")
SECURITY = (
    'security (docs/architecture.md, "9. Security"); one of --secure and --insecure is required'
)
EDGE = "public ports' limits"


def _security_mode(_: str, secure: bool) -> list[str]:
    return ["--secure"] if secure else ["--insecure"]


def _add_security_mode(container: Any, dest: str, default: bool) -> None:
    """--secure or --insecure, one of them: a service started by hand says how it talks
    to the others (specpipe/cli/services.py checks that one is given)."""
    mode = container.add_mutually_exclusive_group()
    mode.add_argument(
        "--secure",
        dest=dest,
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


def _port(default: int) -> Any:
    return flag(default, help="gRPC port (0: any free port)")


def _data_port() -> Any:
    return flag(0, help="hidden-state port (0: any)")


def _transport() -> Any:
    return flag(choices=TRANSPORTS, help="data plane (default: ucx if installed)")


def _peers(sends: str) -> Any:
    return flag(
        (),
        parse=comma_list,
        render=render_comma,
        help=f"comma-separated hosts, addresses and CIDR networks {sends} may name, in every "
        "mode (default: loopback only)",
    )


@dataclass(frozen=True, kw_only=True)
class SchedulingConfig(CommandLine):
    """The router's admission, elastic width and the defaults of what requests leave
    unset (None: the router's or the engine's default; "auto": the router tunes it)."""

    max_running: int = flag(
        DEFAULT_MAX_RUNNING,
        parse=positive_int,
        help="requests decoding at once; more wait, by priority",
    )
    max_waiting: int = flag(
        DEFAULT_MAX_WAITING,
        help="requests queued beyond --max-running; more are refused (RESOURCE_EXHAUSTED)",
    )
    max_running_per_key: int | None = flag(
        parse=positive_int,
        help="requests one API key (or client address, without keys) runs at once; a freed "
        "slot goes to the key running fewest (default: all but an eighth of --max-running, "
        "kept for the others)",
    )
    max_waiting_per_key: int = flag(
        DEFAULT_MAX_WAITING_PER_KEY,
        help="requests one API key (or client address) may queue; more are refused "
        "(default %(default)s)",
    )
    row_budget: int | str | None = flag(
        parse=auto_or_positive_int,
        help="tree rows per pipeline step shared by the running requests (elastic width: "
        "best-effort requests shrink first); N, or 'auto' from the stages' measured costs "
        "(default: every request keeps its width)",
    )
    # Defaults for requests that leave these unset; "auto" (and, with a draft, unset):
    # the router tunes them.
    width: int | str | None = flag(
        parse=auto_or_positive_int,
        help="tree width of requests that set none: N or 'auto' (chosen from the measured "
        "costs and tokens per step; default: auto with a draft, else the engine's)",
    )
    layers_per_step: int | str | None = flag(
        parse=auto_or_positive_int,
        help="specpipe tree layers per step of requests that set none: K or 'auto' "
        "(default: auto with a draft)",
    )
    token_source: str | None = flag(
        choices=("draft", "ngram", "hybrid", "auto"),
        help="what proposes tree tokens for requests that set none (default: auto with a "
        "draft, no draft among the choices)",
    )
    tune_calibration_tokens: int | None = flag(
        parse=positive_int,
        help="auto settings: tokens measured with each candidate before the best is chosen "
        "(default 256)",
    )
    tune_price: str | None = flag(
        choices=("wall", "model"),
        help="auto settings go by the time between tokens measured (wall, default) or by "
        "the cost curves over tokens per step (model)",
    )
    late_draft_wait_ms: float | None = flag(
        DEFAULT_LATE_DRAFT_WAIT_MS,
        parse=non_negative_float,
        help="how long a verification may wait for a draft answer that is late (lockstep "
        "would have it): the tree keeps its layer instead of missing it (default: one "
        "pipeline step as measured, paused while the waits run out; 0: never wait)",
    )

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

    host: str = flag("127.0.0.1", help="address to listen on (0.0.0.0: all)")
    advertise_host: str | None = flag(help="address others reach this one at")
    port: int = _port(0)
    drain_seconds: float = flag(
        DEFAULT_DRAIN_SECONDS,
        help="on SIGTERM: NOT_SERVING, refuse new requests, let open ones finish this long "
        "(keep it below the pod's terminationGracePeriodSeconds)",
    )
    metrics_port: int | None = flag(
        help="serve Prometheus metrics at /metrics on this port (0: any free port; default: none)"
    )
    ready_file: str | None = flag(help="write addresses here (JSON) once serving")
    log_level: str = flag(
        "INFO", env="SPECPIPE_LOG_LEVEL", help="(default: $SPECPIPE_LOG_LEVEL or INFO)"
    )
    secure: bool = flag(True, render=_security_mode, add=_add_security_mode, group=SECURITY)
    tls_dir: str | None = flag(
        env="SPECPIPE_TLS_DIR",
        group=SECURITY,
        help="ca.crt, tls.crt, tls.key (a Kubernetes TLS Secret's layout) and optionally "
        "data.key (default: $SPECPIPE_TLS_DIR)",
    )
    data_key_file: str | None = flag(
        group=SECURITY,
        help="the data plane's shared secret (default: TLS_DIR/data.key, else derived "
        "from tls.key, which every service then must share)",
    )
    tls_server_name: str = flag(
        DEFAULT_SERVER_NAME,
        group=SECURITY,
        help="the name the deployment's certificates carry (checked instead of hosts)",
    )
    health_port: int | None = flag(
        group=SECURITY,
        help="also serve plaintext gRPC health alone on this port (Kubernetes' gRPC probes "
        "speak no TLS)",
    )


@dataclass(frozen=True, kw_only=True)
class ModelServiceConfig(ServiceConfig):
    """A service that holds a model and KV caches: a stage or the draft."""

    model: str | None = flag(help="model: name, HF directory or GGUF file")
    model_id: str = flag("", help="name reported to clients (default: directory name)")
    dtype: str = flag(
        "float32",
        choices=DTYPE_CHOICES,
        help="float64: exactness checks (no rounding noise between cache shapes)",
    )
    threads: int = flag(0, help="torch CPU threads (0: torch default)")
    draft_activity: str | None = flag(
        metavar="FILE",
        help="a host shared with the draft (specpipe up makes it): the file where a draft "
        "says whether it holds requests and a stage with --threads-with-draft reads it "
        "(services/cpu_threads.py)",
    )
    device: str = flag(
        "cpu",
        help="where the model and its KV caches live: cpu (default), cuda, cuda:N, or auto "
        "(cuda if available, else cpu)",
    )
    max_cache_gib: float | None = flag(
        help="KV cache budget (default: --cache-fraction of the device's free memory)"
    )
    cache_fraction: float = flag(
        DEFAULT_CACHE_FRACTION,
        help="without --max-cache-gib: this share of the device's free memory once the "
        "weights are loaded",
    )
    step_memory_mib: float | None = flag(
        help="working memory one step may take beside weights and KV cache: attention, "
        "activations (default: a share of the device's free memory once the weights are "
        "loaded); a long prompt's step is split until it fits"
    )
    lease_seconds: float = flag(
        DEFAULT_LEASE_SECONDS,
        help="free a request's state when its router has not renewed it for this long",
    )
    emulate_costs: str | None = flag(
        metavar="FILE",
        help="emulated device: pace every forward to the cost model in FILE (JSON: a "
        "measured curve of seconds per row count, or flat), sleeping the rest of its "
        "modelled time "
        '(docs/architecture.md, "5. The request controller and its executors", '
        '"Emulated devices")',
    )
    measure_costs: bool = flag(
        False,
        help="measure this service's cost per row count at start (for the router's auto "
        "settings); a stage also reports the rows a step can take nearly free (for the "
        "router's --row-budget auto)",
    )
    # How long a round may wait for requests of the same step, in seconds (None: auto).
    batch_wait: float | None = flag(
        name="--batch-wait-ms",
        parse=ms_or_auto(MAX_WAIT * 1e3),
        render=render_ms,
        metavar="MS|auto",
        help="how long a stage's (or the draft's) round may wait for requests of the same "
        "pipeline step, so that they share one forward (default auto: half the stage's "
        f"recent forward time, at most {AUTO_CAP * 1e3:.0f} ms; 0: never wait)",
    )
    no_prefix_cache: bool = flag(
        False,
        help="turn the prefix cache off: no KV cache blocks shared between requests with a "
        "common prompt prefix, every prompt prefilled whole",
    )

    @property
    def max_cache_bytes(self) -> int | None:
        return None if self.max_cache_gib is None else int(self.max_cache_gib * (1 << 30))


@dataclass(frozen=True, kw_only=True)
class StageConfig(ModelServiceConfig):
    """`specpipe stage`: layers of the target model."""

    port: int = _port(DEFAULT_STAGE_PORT)
    data_port: int = _data_port()
    transport: str | None = _transport()  # None: UCX where it imports, else TCP
    layers: str | None = flag(help="START:END decoder layers (default: all)")
    emulate_stage: int | None = flag(
        metavar="K",
        help="with --emulate-costs: which of FILE's stage curves this stage paces to "
        "(0-based; default: FILE's only one)",
    )
    allow_configure: bool = flag(
        False, help="accept Configure calls (loading other weights over gRPC; off by default)"
    )
    peers: tuple[str, ...] = _peers("a request's next hop and report address")
    threads_with_draft: int = flag(
        0,
        help="with --draft-activity: torch threads of the forwards while the draft holds "
        "requests (--threads while it holds none; 0: --threads always)",
    )
    no_batch_invariant: bool = flag(
        False,
        help="half precision on a CPU: verify a tree's rows in shared kernels (faster with "
        "many rows or long contexts, but a near-tie may then round unlike plain decoding; "
        "default: each row computed as it would be alone, common/model/batch_invariant.py)",
    )

    @property
    def invariance(self) -> bool | None:
        """`load_stage`'s `batch_invariant`: None (its default by dtype and device) or off."""
        return False if self.no_batch_invariant else None


@dataclass(frozen=True, kw_only=True)
class DraftConfig(ModelServiceConfig):
    """`specpipe draft`: the draft model (its --model is required)."""

    port: int = _port(DEFAULT_DRAFT_PORT)
    data_port: int | None = flag(
        help="take the router's calls as data-plane control frames on this port (0: any "
        "free port; default: none, they ride the gRPC control stream)"
    )
    transport: str | None = _transport()  # None: UCX where it imports, else TCP
    peers: tuple[str, ...] = _peers("a control frame's reply address")
    activity_slot: int = flag(0, help="with --draft-activity: this draft's slot in FILE")


@dataclass(frozen=True, kw_only=True)
class RouterConfig(ServiceConfig):
    """`specpipe router`: where the replicas are, how lost ones are replaced, the public
    APIs and the scheduling."""

    port: int = _port(DEFAULT_ROUTER_PORT)
    data_port: int = _data_port()
    transport: str | None = _transport()
    stages: tuple[str, ...] = flag(
        (),
        parse=comma_list,
        render=render_comma,
        help="comma-separated stage gRPC addresses HOST:PORT (a static list)",
    )
    drafts: tuple[str, ...] = flag(
        (),
        name="--draft",
        parse=comma_list,
        render=render_comma,
        help="draft gRPC address(es) HOST:PORT, comma-separated",
    )
    discovery: str | None = flag(
        metavar="SOURCE",
        help="where the stage and draft replicas are, followed while serving instead of "
        "--stages/--draft: file:PATH (one 'stage|draft HOST:PORT [GROUP]' a line, re-read "
        "when it changes) or kubernetes (the EndpointSlices of the release's stage and "
        "draft Services, watched through the API server)",
    )
    discovery_namespace: str | None = flag(
        help="kubernetes: the namespace to watch (default: the pod's own)"
    )
    discovery_selector: str | None = flag(
        help="kubernetes: label selector of the EndpointSlices (default: "
        "'app.kubernetes.io/component in (stage,draft)')"
    )
    replay_seconds: float = flag(
        DEFAULT_REPLAY_SECONDS,
        help="when a replica on a request's path is lost: how long to wait for another "
        "path before the request fails UNAVAILABLE",
    )
    max_replays: int = flag(
        8,
        parse=positive_int,
        help="how many times one request may be replayed on another path before it fails "
        "UNAVAILABLE (each replica lost on its path costs one)",
    )
    # Path silence: a request's path, not a replica (replica_stall_seconds is that).
    path_stall_seconds: float = flag(
        DEFAULT_PATH_STALL_SECONDS,
        aliases=("--stall-seconds",),
        help="the watchdog: a path that makes no progress for this long (no frame: no "
        "verification, no stage's report that it computed the request) counts as lost (the "
        "request is released there, replayed on another, and fails UNAVAILABLE after "
        "--replay-seconds without one); --stall-seconds is its deprecated name",
    )
    replica_stall_seconds: float = flag(
        DEFAULT_REPLICA_STALL_SECONDS,
        parse=positive_seconds,
        help="a replica that answers no health check for this long is stalled: it takes "
        "no new requests, and a request waiting on it is replayed on another path as if "
        "it had died (default %(default)s)",
    )
    health_check_interval: float = flag(
        0.5,
        parse=positive_seconds,
        help="seconds between two health checks of a replica (default %(default)s)",
    )
    no_control_frames: bool = flag(
        False,
        help="send the stages' feeds and prunes and the draft's calls on the gRPC control "
        "streams, not as data-plane frames (by default they ride the data plane where a "
        "stage or the draft takes them: about half the CPU of stream messages for a "
        "stage's, both ends together; for the draft's, up to a tenth of the router's and "
        "the draft's CPU per token)",
    )
    no_relay_prunes: bool = flag(
        False,
        help="send every prune to every stage of a request's path, not to its first stage "
        "only (by default, where every stage of the path relays them, each stage passes "
        "them on to the next on the request's hidden-state frames: no prune frame per "
        'stage and step; see docs/architecture.md, "6. Control plane and data plane")',
    )
    target: str | None = flag(help="target model directory (for its tokenizer)")
    model_id: str = flag("", help="name clients use (default: the stages')")
    startup_timeout: float = flag(
        180.0, help="seconds to wait for the stages and the draft at start"
    )
    router_name: str = flag(
        "",
        help="this router's name on the stages and the draft (default HOST:PORT): a router "
        "restarted under the same name frees its predecessor's requests at once",
    )
    http_port: int | None = flag(
        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health; vLLM's /metrics, /version, /tokenize, /detokenize) on this "
        "port (0: any free port; default: no HTTP API)"
    )
    http_metrics: str = flag(
        DEFAULT_HTTP_METRICS,
        choices=HTTP_METRICS_ACCESS,
        help="/metrics on the HTTP port: behind the API key like the rest of the port (key), "
        "open to anyone (open), or not served there (off); default %(default)s",
    )
    tool_call_parser: str = flag(
        DEFAULT_TOOL_CALL_PARSER,
        choices=TOOL_CALL_PARSERS,
        help="the model's tool-call format, parsed from its output for tool_choice 'auto' "
        "(auto: chosen from the chat template; hermes: Qwen2.5's and Hermes' <tool_call>; "
        "llama3_json: Llama 3.x's JSON calls; qwen2_5_coder: Hermes' and the bare or fenced "
        "JSON calls Qwen2.5-Coder writes; none: 'auto' refused); default %(default)s",
    )
    api_keys: tuple[str, ...] = flag(
        (),
        name="--api-key",
        repeat=True,
        metavar="KEY",
        help="require this key (Authorization: Bearer KEY) on the HTTP API and the gRPC "
        "Generation API; repeatable",
    )
    api_key_files: tuple[str, ...] = flag(
        (),
        name="--api-key-file",
        repeat=True,
        metavar="FILE",
        help="require one of the keys in FILE (one a line, '#' comments); repeatable",
    )
    public_tls_cert: str | None = flag(
        help="serve the public gRPC and HTTP ports over TLS with this certificate (PEM)"
    )
    public_tls_key: str | None = flag(help="the key of --public-tls-cert (PEM)")
    # The public ports' limits (services/router/edge.py, EdgeLimits; None: its default).
    http_max_connections: int | None = flag(
        parse=positive_int,
        group=EDGE,
        help="connections the HTTP port holds at once (and the gRPC port, each); more are "
        "refused 503 (default: 1024, or a quarter of the file-descriptor limit)",
    )
    http_max_connections_per_client: int = flag(
        DEFAULT_HTTP_PER_CLIENT,
        group=EDGE,
        help="connections one client address may hold on the HTTP port (0: no cap; behind "
        "a proxy every client has the proxy's address; default %(default)s)",
    )
    http_header_timeout: float = flag(
        DEFAULT_HTTP_HEADER_TIMEOUT,
        group=EDGE,
        help="seconds a connection has to send a request's headers (from its start, or "
        "from the first byte of a later request) before it is closed (default %(default)s)",
    )
    max_priority: int = flag(
        DEFAULT_MAX_PRIORITY,
        group=EDGE,
        help="the highest request priority a client may ask for unless its API key's line "
        "says max_priority=N (default %(default)s; higher is refused)",
    )
    share_prefix_cache: bool = flag(
        False,
        help="cached prompt prefixes are shared across API keys (requests with the same "
        "cache_salt, or without one); default: per key (or client address) and cache_salt",
    )
    describe_internals: bool = flag(
        False,
        help="without API keys, callers on this host see the replicas' addresses in "
        "Describe (with keys: those marked operator)",
    )
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)

    def __post_init__(self) -> None:
        if bool(self.public_tls_cert) != bool(self.public_tls_key):
            raise ValueError("--public-tls-cert and --public-tls-key go together")


@dataclass(frozen=True, kw_only=True)
class DeploymentConfig:
    """`specpipe up`: router, draft and stages as local processes (`ServicesDeployment`).
    Values the children share are given once here; the launcher turns them into each
    child's `StageConfig`, `DraftConfig` and `RouterConfig`. The fields that are a flag of
    `specpipe up` as they are say so (`flag`); the others are set from its flags by
    specpipe/cli/services.py (models resolved, keys loaded, `--no-...` inverted)."""

    target: str | Path
    draft: str | Path | None = None  # a model, "oracle" (the target) or None / "none"
    stages: int = flag(2, parse=positive_int, help="pipeline stages")
    stage_replicas: int | Sequence[int] = flag(  # of every stage, or per stage
        1,
        parse=positive_int,
        help="replicas of every stage (the router picks one of each per request)",
    )
    layers: str | None = flag(help="per-stage layer ranges: 0:7,7:14,... (default: an even split)")
    transport: str = flag(
        TCP,
        choices=TRANSPORTS,
        help="data plane between the local processes (default tcp: on one host UCX has no "
        "RDMA/NVLink to use, and its polling progress was measured slower on small CPU nodes)",
    )
    router_port: int = flag(  # 0: a free port; the command line's default is the usual one
        0, command_default=DEFAULT_ROUTER_PORT, help="the router's gRPC port (0: any free port)"
    )
    host: str = flag("127.0.0.1", help="address every process listens on")
    dtype: str = "float32"
    threads: int | None = None  # per model process; None: services/cpu_threads.py decides
    draft_threads: int | None = flag(
        parse=positive_int,
        help="torch threads of the draft process (default: as --threads, else every core, "
        "one for a small model; services/cpu_threads.py)",
    )
    split_cores_while_drafting: bool = flag(
        False,
        help="on a CPU host shared with other work: while the draft holds requests it runs "
        "on a share of the cores and the stages on the rest, every core to the stages while "
        "it holds none (default off: on idle cores every process on every core drafts "
        "faster; services/cpu_threads.py)",
    )
    # Where the stages and the draft run (services/placement.py): "cuda" one GPU per
    # service, round-robin over the visible ones; cpu or cuda:N all on that device.
    device: str = flag(
        "cpu",
        exclusive="where",
        help="where the stages and the draft run: cuda (one GPU per service, round-robin "
        "over the visible GPUs; with fewer GPUs than services some share one, as printed at "
        "start), cuda:N (all on GPU N), cpu (default), or auto (cuda if available, else cpu)",
    )
    devices: Sequence[str] = flag(
        (),
        parse=comma_list,
        exclusive="where",
        help="every service's device instead: one per stage process (in pipeline order, a "
        "stage's replicas together), then the draft's, e.g. cuda:0,cuda:1,cuda:1",
    )
    drain_seconds: float = flag(
        DEFAULT_DRAIN_SECONDS,
        help="on Ctrl-C/SIGTERM: how long open requests may finish before the processes stop",
    )
    # None: a temporary directory, removed at stop (flag: a field, not a shared default)
    log_dir: str | Path | None = flag(  # noqa: RUF009
        parse=str, help="keep child logs here (default: a temporary directory)"
    )
    startup_timeout: float = flag(
        180.0, command_default=300.0, help="seconds to wait for every process to serve"
    )
    env: Mapping[str, str] | None = None  # added to the children's environment
    max_cache_gib: float | None = flag(help="KV cache budget per stage and draft")
    step_memory_mib: float | None = flag(
        help="working memory one step may take per stage and draft (default: a share of "
        "the device's free memory)"
    )
    http_port: int | None = None  # the router's HTTP API; None: off, 0: any free port
    http_metrics: str = DEFAULT_HTTP_METRICS  # the router's (RouterConfig)
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER  # the router's (RouterConfig)
    api_keys: Sequence[str] = ()
    scheduling: SchedulingConfig | Mapping[str, object] | None = None
    metrics: bool = False  # every process gets a --metrics-port
    replay_seconds: float = DEFAULT_REPLAY_SECONDS  # the router's
    group: str = ""  # discovery group (model version) of the first children
    lease_seconds: float = flag(
        DEFAULT_LEASE_SECONDS,
        help="free a request's state on the stages and the draft when its router has not "
        "renewed it for this long (default %(default)s)",
    )
    secure: bool = True  # a throwaway CA and certificate; False: --insecure
    public_tls: Any = None  # a security.PublicTls for the router's public ports
    emulate_costs: str | Path | None = None  # every stage (its own curve) and the draft
    batch_wait: float | None = None  # seconds, of every stage and the draft; None: auto
    prefix_cache: bool = True  # False: --no-prefix-cache on every stage and the draft
    control_frames: bool = True  # False: the router's --no-control-frames
    relay_prunes: bool = True  # False: the router's --no-relay-prunes

    def __post_init__(self) -> None:
        # Tests and benchmarks give scheduling as a mapping of field names.
        object.__setattr__(self, "scheduling", SchedulingConfig.of(self.scheduling))
