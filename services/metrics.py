"""Prometheus metrics of the three services (`--metrics-port`: `/metrics`), named after
vLLM's with the prefix `specpipe:` (docs/deploy.md, "Metrics and autoscaling"). The
router also serves the series vLLM's dashboards and routers read under vLLM's own names
(`vllm:...{model_name}`, `VllmNames`), beside its own.

One module for the three services' metrics, since they share their server, their
naming and most of their families. Each service has its own registry and serves it from
a small HTTP server in a thread, on
a port of its own: the same for the router, the stages and the draft (which run no ASGI
stack), scrapes answered even while the event loop or the compute thread is busy, and
metrics kept off the client API port (API keys, public exposure). It always answers in
Prometheus' text format (0.0.4): prometheus-client's OpenMetrics output (what Prometheus
asks for first) turns the `:` of sample names into `_` (seen with 0.26), so the names
would not be the ones its own `# TYPE` lines give.

Gauges that describe the present (busy ratio, queued rows, KV cache use, requests
running) are read when scraped, from callables the service gives (`watch`); counters and
histograms are updated where the work happens.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .conn_limits import ConnectionCounts
from .ratelog import RateLimitedLog

log = logging.getLogger(__name__)
PREFIX = "specpipe:"
VLLM_PREFIX = "vllm:"  # the router's series under vLLM's names (VllmNames)
# vLLM's buckets for the request latencies.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FORWARD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                   5.0, 10.0, 30.0)  # fmt: skip
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
WAIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
FAST_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05)
TOKENS_PER_STEP_BUCKETS = (0.05, 0.1, 0.2, 0.25, 0.33, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5,
                           2.0, 3.0, 4.0, 6.0, 8.0)  # fmt: skip
# A step's service overhead and the router's CPU per step: fractions of a stage's step.
OVERHEAD_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 0.01, 0.015, 0.02,
                    0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)  # fmt: skip
MAX_DEPTH_LABEL = 16  # hits deeper than this count under depth "16+"
# The metrics port's own bounds: a scrape is one short request, so a connection may stay
# silent this long between bytes and open this long in all; at most this many are
# served at once (one thread each), and this many from one address (Prometheus scrapes
# a target one request at a time).
METRICS_SOCKET_TIMEOUT = 5.0
METRICS_CONNECTION_SECONDS = 10.0
METRICS_MAX_CONNECTIONS = 32
METRICS_MAX_PER_CLIENT = 8


class BusyMeter:
    """Share of the last `window` seconds a compute thread spent computing."""

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self._spans: deque[tuple[float, float]] = deque()
        self._since: float | None = None  # start of the span in progress
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        start = time.monotonic()
        with self._lock:
            self._since = start
        try:
            yield
        finally:
            end = time.monotonic()
            with self._lock:
                self._since = None
                self._spans.append((start, end))
                self._trim(end)

    def _trim(self, now: float) -> None:
        while self._spans and self._spans[0][1] < now - self.window:
            self._spans.popleft()

    def ratio(self) -> float:
        now = time.monotonic()
        begin = max(now - self.window, self._t0)
        if now <= begin:
            return 0.0
        with self._lock:
            self._trim(now)
            spans = list(self._spans)
            if self._since is not None:
                spans.append((self._since, now))
        busy = sum(max(0.0, min(e, now) - max(s, begin)) for s, e in spans)
        return min(1.0, busy / (now - begin))


class ServiceMetrics:
    """A registry of one service, served on `--metrics-port`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.port = 0
        self._server = None

    def _gauge(self, name: str, doc: str, labels=()) -> Gauge:
        return Gauge(PREFIX + name, doc, labels, registry=self.registry)

    def _counter(self, name: str, doc: str, labels=()) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets, labels=()) -> Histogram:
        return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

    def watch_dataplane(self, transport) -> None:
        """`specpipe:dataplane_{received,sent}_bytes_total`: the data-plane bytes of
        `transport` (frames as framed; None: a service without a data plane, 0)."""
        self.registry.register(_DataplaneCollector(transport))

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0: any free port); returns the port."""
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            timeout = METRICS_SOCKET_TIMEOUT  # a silent connection is closed after this

            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._server = BoundedHTTPServer(
            (host, port),
            Handler,
            METRICS_MAX_CONNECTIONS,
            METRICS_MAX_PER_CLIENT,
            METRICS_CONNECTION_SECONDS,
        )
        thread = threading.Thread(target=self._server.serve_forever, args=(0.5,), daemon=True,
                                  name="metrics")  # fmt: skip
        thread.start()
        self.port = self._server.server_port
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, but at most `max_connections` of them (and
    `per_client` from one address): more are closed at once. A connection open longer
    than `connection_seconds` (a client that sends or reads a byte at a time) is shut
    down by the serving loop, so a thread is never held for longer."""

    daemon_threads = True
    request_queue_size = 64  # the listen backlog: refusals are cheap, let them be seen

    def __init__(
        self,
        address,
        handler,
        max_connections: int = METRICS_MAX_CONNECTIONS,
        per_client: int = METRICS_MAX_PER_CLIENT,
        connection_seconds: float = METRICS_CONNECTION_SECONDS,
    ) -> None:
        self.counts = ConnectionCounts(max_connections, per_client)
        self.connection_seconds = connection_seconds
        self.refusals = RateLimitedLog(log)
        self._opened: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        why = self.counts.admit(client_address[0])
        if why is not None:
            self.refusals.warning("refused", "metrics port: refused a connection (%s)", why)
            self.shutdown_request(request)
            return
        with self._lock:
            self._opened[request] = time.monotonic()
        try:
            super().process_request(request, client_address)  # starts its thread
        except BaseException:
            self._forget(request, client_address)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request, client_address)

    def _forget(self, request, client_address) -> None:
        with self._lock:
            known = self._opened.pop(request, None) is not None
        if known:
            self.counts.release(client_address[0])

    def service_actions(self) -> None:
        """Between polls of the listening socket: end connections open too long (their
        threads then see the end of the stream and finish)."""
        deadline = time.monotonic() - self.connection_seconds
        with self._lock:
            late = [s for s, t in self._opened.items() if t < deadline]
        for s in late:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class _ComputeMetrics(ServiceMetrics):
    """What a stage and the draft share: forwards on one compute thread, queued rows,
    KV cache use, requests."""

    kind = "stage"

    def __init__(self) -> None:
        super().__init__()
        k = self.kind
        self.meter = BusyMeter()
        self.forward_seconds = self._histogram(
            f"{k}_forward_seconds", f"Time of one {k} forward (compute thread)", FORWARD_BUCKETS
        )
        self.rows = self._counter(f"{k}_rows", f"Rows the {k} computed")
        self.batch_requests = self._histogram(
            f"{k}_batch_requests",
            "Requests in one batched forward (rounds with rows; the draft's: its proposals "
            "and prefill chunks)",
            BATCH_BUCKETS,
        )
        self.requests = self._counter(f"{k}_requests", f"Requests opened on the {k}")
        self.busy_ratio = self._gauge(
            f"{k}_busy_ratio", f"Share of the last {self.meter.window:.0f} s the {k} computed"
        )
        self.busy_ratio.set_function(self.meter.ratio)
        self.queued_rows = self._gauge(f"{k}_queued_rows", f"Rows waiting for the {k}'s compute")
        self.kv_cache_usage = self._gauge(
            "kv_cache_usage_perc", "KV cache use: bytes in use / budget (0 without a budget)"
        )
        self.running = self._gauge("num_requests_running", f"Requests open on the {k}")
        # The prefix cache (as vLLM's prefix_cache_queries / _hits): prompt tokens looked
        # up at Open, and of those the ones found cached (whole blocks).
        self.prefix_cache_queries = self._counter(
            "prefix_cache_queries", f"Prompt tokens the {k} looked up in its prefix cache"
        )
        self.prefix_cache_hits = self._counter(
            "prefix_cache_hits", f"Prompt tokens the {k} found in its prefix cache"
        )

    def prefix_cache_queried(self, tokens: int, hits: int) -> None:
        """An Open looked `tokens` prompt tokens up in the prefix cache; `hits` were there."""
        self.prefix_cache_queries.inc(tokens)
        self.prefix_cache_hits.inc(hits)

    def watch(
        self,
        queued_rows: Callable[[], float],
        kv_usage: Callable[[], float],
        running: Callable[[], float],
    ) -> None:
        """Read these when scraped (the service's own state; no copies kept here)."""
        for gauge, fn in (
            (self.queued_rows, queued_rows),
            (self.kv_cache_usage, kv_usage),
            (self.running, running),
        ):
            gauge.set_function(_safe(fn))

    @contextlib.contextmanager
    def forward(self, rows: int) -> Iterator[None]:
        """Around one forward on the compute thread."""
        start = time.perf_counter()
        with self.meter.busy():
            yield
        self.forward_seconds.observe(time.perf_counter() - start)
        self.rows.inc(rows)


class StageMetrics(_ComputeMetrics):
    kind = "stage"

    def __init__(self) -> None:
        super().__init__()
        # Step alignment (StepAligner): how long rounds waited for requests of the same
        # step (how many share a forward: `batch_requests`).
        self.batch_wait = self._histogram(
            "stage_batch_wait_seconds",
            "How long a round waited for requests of the same step (rounds that waited)",
            WAIT_BUCKETS,
        )
        # Feeds (stage 1) and prunes per call: 1 for Feed and Prune, more for FeedMany
        # and PruneMany (a router's calls of one moment, services/router/batched.py).
        self.feeds_per_call = self._histogram(
            "stage_feeds_per_call", "Feeds in one Feed or FeedMany call (first stage)",
            BATCH_BUCKETS,
        )  # fmt: skip
        self.prunes_per_call = self._histogram(
            "stage_prunes_per_call", "Prune signals in one Prune or PruneMany call",
            BATCH_BUCKETS,
        )  # fmt: skip
        # The services' own time in a step (first stage): from the last stage's output
        # (its verification) to this stage's next input of the same request.
        self.step_overhead = self._histogram(
            "step_overhead_seconds",
            "From a last-stage verification to the same request's next stage-1 input "
            "(first stage; the hosts' clocks)",
            OVERHEAD_BUCKETS,
        )


class DraftMetrics(_ComputeMetrics):
    kind = "draft"

    def __init__(self) -> None:
        super().__init__()
        # How long the calls of a batched forward waited for it, once per forward: its
        # earliest Propose call's wait (a late answer is one that waited behind another
        # forward or a prefill).
        self.queue_seconds = self._histogram(
            "draft_batch_queue_seconds",
            "From the arrival of a batched forward's earliest Propose call to the start of "
            "the forward (its longest wait)",
            WAIT_BUCKETS,
        )


def _safe(fn: Callable[[], float]) -> Callable[[], float]:
    """A gauge callback read from the scrape thread: a structure changing under it (the
    event loop runs on) gives the last value instead of an error."""
    last = [0.0]

    def read() -> float:
        with contextlib.suppress(RuntimeError, AttributeError, ZeroDivisionError):
            last[0] = float(fn())
        return last[0]

    return read


# Why a request finished (`request_success`'s label): an end-of-sequence or stop
# token or string, or max_tokens.
FINISH_REASONS = ("stop", "length")


class RouterMetrics(ServiceMetrics):
    """Requests, tokens, latencies and speculation of the router; its replicas."""

    def __init__(self) -> None:
        super().__init__()
        self.running = self._gauge("num_requests_running", "Requests producing tokens")
        self.waiting = self._gauge(
            "num_requests_waiting",
            "Requests not producing tokens yet: queued for a running slot or opening their "
            "path (new or replayed)",
        )
        self.ttft = self._histogram(
            "time_to_first_token_seconds", "Time to the first token", TTFT_BUCKETS
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds", "Time between tokens, per token", ITL_BUCKETS
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds", "Time from request to its last token", E2E_BUCKETS
        )
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of requests started")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated")
        # Prompt tokens of requests opened on their first path, and those of them the
        # path had in its prefix cache (vLLM's prefix_cache_queries / _hits, in tokens).
        self.prefix_cache_queries = self._counter(
            "prefix_cache_queries",
            "Prompt tokens of requests opened (looked up in the path's cache)",
        )
        self.prefix_cache_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens the request's path had in its prefix cache"
        )
        self.verifications = self._counter(
            "spec_verifications", "Verifications (a root, or a specinfer tree)"
        )
        self.hits = self._counter(
            "spec_hits", "Emitted tokens that were in the tree when verified (speculation hits)"
        )
        self.hits_by_depth = self._counter(
            "spec_hits_by_depth",
            "Hits by the tree depth the draft had proposed the token at",
            ["depth"],
        )
        self.tokens_per_step = self._histogram(
            "spec_tokens_per_step", "Tokens per pipeline step, per request", TOKENS_PER_STEP_BUCKETS
        )
        self.success = self._counter(
            "request_success", "Requests finished, by reason", ["finished_reason"]
        )
        # Served at 0 from the start, as vLLM's: a scraper that reports the change over a
        # run (aiperf) then counts the first request too, not from a series born at 1.
        for reason in FINISH_REASONS:
            self.success.labels(reason)
        self.failures = self._counter("request_failures", "Requests that failed or were cancelled")
        self.replays = self._counter(
            "replays", "Requests re-opened on another path after a replica was lost"
        )
        self.replay_seconds = self._histogram(
            "replay_seconds", "From a lost replica to the request open on another path",
            E2E_BUCKETS,
        )  # fmt: skip
        self.draft_drops = self._counter(
            "draft_drops", "Requests that went on without their draft (lost or none up)"
        )
        self.path_choice = self._histogram(
            "path_choice_seconds", "Time to choose a request's path (router overhead)", FAST_BUCKETS
        )
        # The router's CPU per step: per request-step (one verification handled: the
        # controller's decisions and the calls they give), and the process in all.
        self.step_cpu = self._histogram(
            "router_step_cpu_seconds",
            "CPU seconds the router spent on one request's verification (decisions and calls)",
            OVERHEAD_BUCKETS,
        )
        self.registry.register(_ProcessCpuCollector())
        self.vllm = VllmNames(self)
        self.registry.register(self.vllm)

    def watch(self, engine) -> None:
        """Running/waiting requests and the replicas, read from the router's `engine`
        (a RouterEngine) when scraped."""
        self.watch_dataplane(engine.transport)
        drivers = engine.drivers
        self.running.set_function(
            _safe(lambda: sum(1 for d in list(drivers.values()) if not d.waiting))
        )
        # Every request that waits (the chart autoscales on it): queued for a running
        # slot, or admitted and opening its path (new or replayed).
        waiting = _safe(
            lambda: (
                len(engine.scheduler.waiting) + sum(1 for d in list(drivers.values()) if d.waiting)
            )
        )
        self.waiting.set_function(waiting)
        self.registry.register(_BackendCollector(engine.backends))
        self.vllm.model_name = lambda: engine.model.model_id if engine.model else ""
        self.vllm.waiting = waiting

    # -- events of one request -------------------------------------------------------------
    def started(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def opened(self, driver) -> None:
        """A request's first path is open: its prompt's prefix-cache hits are known."""
        self.prefix_cache_queries.inc(len(driver.controller.prompt))
        self.prefix_cache_hits.inc(driver.cached_tokens)

    def tokens(self, driver, n: int) -> None:
        """`n` tokens were emitted together (just now)."""
        now = time.monotonic()
        times = driver.token_times
        self.generation_tokens.inc(n)
        if len(times) == n:
            self.ttft.observe(now - driver.t_start)
            return
        prev = times[-n - 1]
        for _ in range(n):
            self.itl.observe((now - prev) / n)

    def replayed(self, driver, seconds: float) -> None:
        self.replays.inc()
        self.replay_seconds.observe(seconds)

    def finished(self, driver, failed: bool) -> None:
        st = driver.stats
        self.e2e.observe(time.monotonic() - driver.t_start)
        self.verifications.inc(st.verifications)
        self.hits.inc(st.hits)
        for depth in st.hit_depths:
            label = str(depth) if depth < MAX_DEPTH_LABEL else f"{MAX_DEPTH_LABEL}+"
            self.hits_by_depth.labels(label).inc()
        if st.draft_drops:
            self.draft_drops.inc(st.draft_drops)
        if failed:
            self.failures.inc()
            return
        if st.decode_steps:
            self.tokens_per_step.observe(st.tokens_per_step)
        self.success.labels(driver.finish_reason).inc()


class VllmNames:
    """The router's series under vLLM's names, for dashboards and routers built for vLLM
    (its Grafana dashboard, the Gateway API inference extension, KServe): the same
    values as the `specpipe:` ones they are read from when scraped, with vLLM's label
    `model_name` (the served model's id). `vllm:time_per_output_token_seconds` is vLLM's
    older name of the time between tokens (per token, as `inter_token_latency_seconds`);
    `vllm:num_requests_waiting` counts, as vLLM's and the `specpipe:` one, every request
    not running yet: those queued for a running slot (`--max-running`) and those opening
    their path."""

    def __init__(self, metrics: RouterMetrics) -> None:
        m = metrics
        # (the router's series, its vLLM names)
        self.sources = [
            (m.running, ("num_requests_running",)),
            (m.ttft, ("time_to_first_token_seconds",)),
            (m.itl, ("inter_token_latency_seconds", "time_per_output_token_seconds")),
            (m.e2e, ("e2e_request_latency_seconds",)),
            (m.prompt_tokens, ("prompt_tokens",)),
            (m.generation_tokens, ("generation_tokens",)),
            (m.success, ("request_success",)),
            (m.prefix_cache_queries, ("prefix_cache_queries",)),
            (m.prefix_cache_hits, ("prefix_cache_hits",)),
        ]
        self.model_name: Callable[[], str] = lambda: ""
        self.waiting: Callable[[], float] = lambda: 0.0

    def describe(self):
        return []  # nothing to check at registration: the names are not the sources'

    def collect(self):
        labels = {"model_name": self.model_name()}
        for source, aliases in self.sources:
            for family in source.collect():
                for alias in aliases:
                    yield _renamed(family, VLLM_PREFIX + alias, labels)
        waiting = GaugeMetricFamily(
            VLLM_PREFIX + "num_requests_waiting",
            "Requests not running yet: queued for a running slot or opening their path",
            labels=list(labels),
        )
        waiting.add_metric(list(labels.values()), self.waiting())
        yield waiting


def _renamed(family: Metric, name: str, labels: dict[str, str]) -> Metric:
    """`family` under another name, its samples with `labels` added."""
    out = Metric(name, family.documentation, family.type, family.unit)
    for s in family.samples:
        suffix = s.name[len(family.name) :]  # _total, _bucket, _sum, _count, _created
        out.add_sample(name + suffix, {**s.labels, **labels}, s.value, s.timestamp)
    return out


class _DataplaneCollector:
    """specpipe:dataplane_{received,sent}_bytes_total, read from a transport's counts."""

    def __init__(self, transport) -> None:
        self.transport = transport

    def describe(self):
        return list(self.collect())

    def collect(self):
        t = self.transport
        for way, doc in (("received", "received"), ("sent", "sent")):
            yield CounterMetricFamily(
                f"{PREFIX}dataplane_{way}_bytes",
                f"Data-plane bytes {doc} (frames as framed: preamble, header, payload)",
                value=0 if t is None else getattr(t, f"bytes_{way}"),
            )


class _ProcessCpuCollector:
    """specpipe:router_cpu_seconds_total: the process's CPU time (all its threads)."""

    def describe(self):
        return list(self.collect())

    def collect(self):
        yield CounterMetricFamily(
            f"{PREFIX}router_cpu_seconds",
            "CPU seconds the router process used (user and system, every thread)",
            value=time.process_time(),
        )


class _BackendCollector:
    """specpipe:router_backends{kind, state}: replicas the router knows, by state."""

    def __init__(self, backends) -> None:
        self.backends = backends

    def describe(self):
        return []

    def collect(self):
        family = GaugeMetricFamily(
            PREFIX + "router_backends",
            "Replicas the router knows (state: serving, draining, down, refused)",
            labels=["kind", "state"],
        )
        counts: dict[tuple[str, str], int] = {
            (k, s): 0
            for k in ("stage", "draft")
            for s in ("serving", "draining", "down", "refused")
        }
        for b in list(self.backends.by_key.values()):
            if b.refused:
                state = "refused"
            elif b.eligible:
                state = "serving"
            elif b.healthy or b.draining:
                state = "draining"
            else:
                state = "down"
            counts[(b.kind, state)] += 1
        for (kind, state), n in counts.items():
            family.add_metric([kind, state], n)
        yield family
        versions = GaugeMetricFamily(
            PREFIX + "router_model_versions",
            "Complete model versions: 1 for the one new requests go to, 0 for older ones",
            labels=["weight_hash", "model"],
        )
        current = self.backends.model
        for wh, m in list(self.backends.versions.items()):
            versions.add_metric(
                [wh, m.model_id], float(bool(current) and current.weight_hash == wh)
            )
        yield versions
