"""The flags of `specpipe stage|draft|router|up|certs`.

Each service command's flags are the fields of its configuration (`services/config.py`,
one flag per field, under the field's name): the defaults come from there, and
`StageConfig.from_args` and the others read the parsed flags back. What the commands do
with them is `services.py`. One module, though long: it is every flag of these commands
and its help text, and a flag is looked up by name, in one file."""

from __future__ import annotations

import argparse
import os

from specpipe.common.runtime.alignment import AUTO_CAP, MAX_WAIT
from specpipe.services.config import (
    DEFAULT_HTTP_METRICS,
    DEFAULT_TOOL_CALL_PARSER,
    HTTP_METRICS_ACCESS,
    TOOL_CALL_PARSERS,
    TRANSPORTS,
    DeploymentConfig,
    DraftConfig,
    ModelServiceConfig,
    RouterConfig,
    SchedulingConfig,
    ServiceConfig,
    StageConfig,
)

from .args import (
    DEFAULT_ROUTER_PORT,
    add_device_arg,
    add_dtype_arg,
    auto_or_positive_int,
    non_negative_float,
    positive_int,
)


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _service_args(p: argparse.ArgumentParser, defaults: ServiceConfig, data_plane: bool) -> None:
    p.add_argument("--host", default=defaults.host, help="address to listen on (0.0.0.0: all)")
    p.add_argument("--advertise-host", default=None, help="address others reach this one at")
    p.add_argument("--port", type=int, default=defaults.port, help="gRPC port (0: any free port)")
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
        default=defaults.drain_seconds,
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
    p.add_argument("--log-level", default=os.environ.get("SPECPIPE_LOG_LEVEL", defaults.log_level))
    _secure_args(p, defaults)


def _secure_args(p: argparse.ArgumentParser, defaults: ServiceConfig) -> None:
    g = p.add_argument_group(
        'security (docs/architecture.md, "9. Security"); one of --secure and --insecure is required'
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
        default=defaults.tls_server_name,
        help="the name the deployment's certificates carry (checked instead of hosts)",
    )
    g.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also serve plaintext gRPC health alone on this port (Kubernetes' gRPC probes "
        "speak no TLS)",
    )


def _model_args(p: argparse.ArgumentParser, defaults: ModelServiceConfig, required: bool) -> None:
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
        "--step-memory-mib",
        type=float,
        default=None,
        help="working memory one step may take beside weights and KV cache: attention, "
        "activations (default: a share of the device's free memory once the weights are "
        "loaded); a long prompt's step is split until it fits",
    )
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=defaults.cache_fraction,
        help="without --max-cache-gib: this share of the device's free memory once the "
        "weights are loaded",
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="turn the prefix cache off: no KV cache blocks shared between requests with a "
        "common prompt prefix, every prompt prefilled whole",
    )
    p.add_argument(
        "--lease-seconds",
        type=float,
        default=defaults.lease_seconds,
        help="free a request's state when its router has not renewed it for this long",
    )
    add_device_arg(p)
    _emulate_arg(p)
    _batch_wait_arg(p)


def _batch_wait_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--batch-wait-ms",
        dest="batch_wait",
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
        "modelled time "
        '(docs/architecture.md, "5. The request controller and its executors", '
        '"Emulated devices")',
    )


def add_stage_flags(p: argparse.ArgumentParser) -> None:
    defaults = StageConfig()
    _model_args(p, defaults, required=False)
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
        type=_comma_list,
        default=(),
        help="comma-separated hosts, addresses and CIDR networks a request's next hop and "
        "report address may name, in every mode (default: loopback only)",
    )
    _service_args(p, defaults, data_plane=True)


def add_draft_flags(p: argparse.ArgumentParser) -> None:
    defaults = DraftConfig()
    _model_args(p, defaults, required=True)
    p.add_argument(
        "--measure-costs",
        action="store_true",
        help="measure the draft's cost per row count at start (for the router's auto settings)",
    )
    _service_args(p, defaults, data_plane=False)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def add_router_flags(p: argparse.ArgumentParser) -> None:
    defaults = RouterConfig()
    p.add_argument(
        "--stages",
        type=_comma_list,
        default=(),
        help="comma-separated stage gRPC addresses HOST:PORT (a static list)",
    )
    p.add_argument(
        "--draft",
        dest="drafts",
        type=_comma_list,
        default=(),
        help="draft gRPC address(es) HOST:PORT, comma-separated",
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
        default=defaults.replay_seconds,
        help="when a replica on a request's path is lost: how long to wait for another "
        "path before the request fails UNAVAILABLE",
    )
    p.add_argument(
        "--max-replays",
        type=positive_int,
        default=defaults.max_replays,
        help="how many times one request may be replayed on another path before it fails "
        "UNAVAILABLE (each replica lost on its path costs one)",
    )
    p.add_argument(
        "--stall-seconds",
        type=float,
        default=defaults.stall_seconds,
        help="the watchdog: a path that makes no progress for this long (no frame: no "
        "verification, no stage's report that it computed the request) counts as lost (the "
        "request is released there, replayed on another, and fails UNAVAILABLE after "
        "--replay-seconds without one)",
    )
    p.add_argument(
        "--replica-stall-seconds",
        type=_positive_seconds,
        default=defaults.replica_stall_seconds,
        help="a replica that answers no health check for this long is stalled: it takes "
        "no new requests, and a request waiting on it is replayed on another path as if "
        "it had died (default %(default)s)",
    )
    p.add_argument("--target", default=None, help="target model directory (for its tokenizer)")
    p.add_argument("--model-id", default="", help="name clients use (default: the stages')")
    p.add_argument("--startup-timeout", type=float, default=defaults.startup_timeout)
    p.add_argument(
        "--router-name",
        default="",
        help="this router's name on the stages and the draft (default HOST:PORT): a router "
        "restarted under the same name frees its predecessor's requests at once",
    )
    p.add_argument(
        "--share-prefix-cache",
        action="store_true",
        help="cached prompt prefixes are shared across API keys (requests with the same "
        "cache_salt, or without one); default: per key (or client address) and cache_salt",
    )
    p.add_argument(
        "--describe-internals",
        action="store_true",
        help="without API keys, callers on this host see the replicas' addresses in "
        "Describe (with keys: those marked operator)",
    )
    _service_args(p, defaults, data_plane=True)
    _http_args(p)
    _edge_args(p, defaults)
    _scheduling_args(p, defaults.scheduling)


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
        type=_comma_list,
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
    _batch_wait_arg(p)
    _emulate_arg(p)
    _http_args(p)
    _scheduling_args(p, SchedulingConfig())


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


def _scheduling_args(p: argparse.ArgumentParser, defaults: SchedulingConfig) -> None:
    p.add_argument(
        "--max-running",
        type=positive_int,
        default=defaults.max_running,
        help="requests decoding at once; more wait, by priority",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=defaults.max_waiting,
        help="requests queued beyond --max-running; more are refused (RESOURCE_EXHAUSTED)",
    )
    p.add_argument(
        "--max-running-per-key",
        type=positive_int,
        default=defaults.max_running_per_key,
        help="requests one API key (or client address, without keys) runs at once; a freed "
        "slot goes to the key running fewest (default: all but an eighth of --max-running, "
        "kept for the others)",
    )
    p.add_argument(
        "--max-waiting-per-key",
        type=int,
        default=defaults.max_waiting_per_key,
        help="requests one API key (or client address) may queue; more are refused "
        "(default %(default)s)",
    )
    p.add_argument(
        "--row-budget",
        default=None,
        type=auto_or_positive_int,
        help="tree rows per pipeline step shared by the running requests (elastic width: "
        "best-effort requests shrink first); N, or 'auto' from the stages' measured costs "
        "(default: every request keeps its width)",
    )
    # Defaults for requests that leave these unset; "auto" (and, with a draft, unset):
    # the router tunes them.
    p.add_argument(
        "--width",
        default=None,
        type=auto_or_positive_int,
        help="tree width of requests that set none: N or 'auto' (chosen from the measured "
        "costs and tokens per step; default: auto with a draft, else the engine's)",
    )
    p.add_argument(
        "--layers-per-step",
        default=None,
        type=auto_or_positive_int,
        help="specpipe tree layers per step of requests that set none: K or 'auto' "
        "(default: auto with a draft)",
    )
    p.add_argument(
        "--token-source",
        default=None,
        choices=["draft", "ngram", "hybrid", "auto"],
        help="what proposes tree tokens for requests that set none (default: auto with a "
        "draft, no draft among the choices)",
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


def _edge_args(p: argparse.ArgumentParser, defaults: RouterConfig) -> None:
    """The public ports' limits (services/router/edge.py; issue 22)."""
    g = p.add_argument_group("public ports' limits")
    g.add_argument(
        "--http-max-connections",
        type=positive_int,
        default=None,
        help="connections the HTTP port holds at once (and the gRPC port, each); more are "
        "refused 503 (default: 1024, or a quarter of the file-descriptor limit)",
    )
    g.add_argument(
        "--http-max-connections-per-client",
        type=int,
        default=defaults.http_max_connections_per_client,
        help="connections one client address may hold on the HTTP port (0: no cap; behind "
        "a proxy every client has the proxy's address; default %(default)s)",
    )
    g.add_argument(
        "--http-header-timeout",
        type=float,
        default=defaults.http_header_timeout,
        help="seconds a connection has to send a request's headers (from its start, or "
        "from the first byte of a later request) before it is closed (default %(default)s)",
    )
    g.add_argument(
        "--max-priority",
        type=int,
        default=defaults.max_priority,
        help="the highest request priority a client may ask for unless its API key's line "
        "says max_priority=N (default %(default)s; higher is refused)",
    )


def _http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health; vLLM's /metrics, /version, /tokenize, /detokenize) on this "
        "port (0: any free port; default: no HTTP API)",
    )
    p.add_argument(
        "--http-metrics",
        choices=HTTP_METRICS_ACCESS,
        default=DEFAULT_HTTP_METRICS,
        help="/metrics on the HTTP port: behind the API key like the rest of the port (key), "
        "open to anyone (open), or not served there (off); default %(default)s",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=DEFAULT_TOOL_CALL_PARSER,
        help="the model's tool-call format, parsed from its output for tool_choice 'auto' "
        "(auto: chosen from the chat template; hermes: Qwen2.5's and Hermes' <tool_call>; "
        "llama3_json: Llama 3.x's JSON calls; none: 'auto' refused); default %(default)s",
    )
    p.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=[],
        metavar="KEY",
        help="require this key (Authorization: Bearer KEY) on the HTTP API and the gRPC "
        "Generation API; repeatable",
    )
    p.add_argument(
        "--api-key-file",
        dest="api_key_files",
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
