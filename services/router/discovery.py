"""Where the router finds its stage and draft replicas: one interface, three sources
(docs/architecture.md, "8. Deployment").

A `Discovery` publishes the whole current set of `Endpoint`s whenever it changes; the
router's `Backends` describes every new one before it takes traffic and stops sending new
requests to one that disappears or drains. Sources:

- `StaticDiscovery`: the `--stages` / `--draft` flags, published once.
- `FileDiscovery` (`--discovery file:PATH`): one backend a line, `stage HOST:PORT` or
  `draft HOST:PORT`, optionally followed by a group (the model version it belongs to,
  which pairs drafts with stages); `#` starts a comment. The file is followed for
  changes (polled; a missing file is an empty set).
- `KubernetesDiscovery` (`--discovery kubernetes`): the EndpointSlices of the release's
  stage and draft Services, listed and then watched through the API server with the
  official `kubernetes` client (in-cluster configuration in a pod, else the kubeconfig;
  RBAC get/list/watch on endpointslices). Kubernetes is the membership system: a pod appears when its
  endpoint does, drains when it is terminating, and is gone when its endpoint is.

`order` ranks model versions (newer ones take new requests): the time the source first
listed an endpoint (Kubernetes: its EndpointSlice's creation time; a file: the time the
line first appeared, later lines counting as newer within one read).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import RouterConfig

log = logging.getLogger(__name__)

KINDS = ("stage", "draft")
# Labels the chart puts on every Service (Kubernetes copies them onto the EndpointSlices).
COMPONENT_LABEL = "app.kubernetes.io/component"
VERSION_LABEL = "specpipe.dev/model-version"
DEFAULT_SELECTOR = f"{COMPONENT_LABEL} in (stage,draft)"
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

Publish = Callable[[frozenset["Endpoint"]], None]


class DiscoveryError(ValueError):
    """A discovery source that cannot be used (bad spec or file line)."""


@dataclass(frozen=True)
class Endpoint:
    kind: str  # "stage" or "draft"
    address: str  # HOST:PORT of its gRPC port
    group: str = ""  # the model version it belongs to, when the source knows one
    draining: bool = False  # the source says it is going away (Kubernetes: terminating)
    order: float = 0.0  # when the source first listed it (see the module docstring)

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.address)


class Discovery(ABC):
    """A live set of endpoints."""

    name = "discovery"

    @abstractmethod
    async def run(self, publish: Publish) -> None:
        """Call `publish` with the whole current set now and whenever it changes, until
        cancelled."""

    def describe(self) -> str:
        return self.name

    def initial(self) -> frozenset[Endpoint] | None:
        """The set, when it is known without running the source (a static list)."""
        return None


# -- static ------------------------------------------------------------------------------
class StaticDiscovery(Discovery):
    """A fixed list (`--stages`, `--draft`)."""

    name = "static"

    def __init__(self, stages: Sequence[str], drafts: Sequence[str] = ()) -> None:
        self.endpoints = frozenset(
            [Endpoint("stage", a, order=i) for i, a in enumerate(stages)]
            + [Endpoint("draft", a, order=i) for i, a in enumerate(drafts)]
        )

    async def run(self, publish: Publish) -> None:
        publish(self.endpoints)
        await asyncio.Event().wait()

    def initial(self) -> frozenset[Endpoint]:
        return self.endpoints

    def describe(self) -> str:
        return f"static list of {len(self.endpoints)} backends"


# -- file --------------------------------------------------------------------------------
def parse_backend_lines(text: str) -> list[tuple[str, str, str]]:
    """(kind, address, group) per line of a discovery file; DiscoveryError names the line."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3) or parts[0] not in KINDS:
            raise DiscoveryError(
                f"line {n}: {raw.strip()!r} (expected 'stage|draft HOST:PORT [GROUP]')"
            )
        host, colon, port = parts[1].rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise DiscoveryError(f"line {n}: {parts[1]!r} is not HOST:PORT")
        out.append((parts[0], parts[1], parts[2] if len(parts) == 3 else ""))
    return out


class FileDiscovery(Discovery):
    """One backend a line, followed for changes (polled every `interval` seconds)."""

    name = "file"

    def __init__(self, path: str | Path, interval: float = 0.5) -> None:
        self.path = Path(path)
        self.interval = interval
        self._first_seen: dict[tuple[str, str], float] = {}

    def describe(self) -> str:
        return f"file {self.path}"

    async def run(self, publish: Publish) -> None:
        last_text: str | None = None
        published: frozenset[Endpoint] | None = None
        while True:
            try:
                text = self.path.read_text()
            except FileNotFoundError:
                text = ""
            except OSError as e:
                log.warning("discovery file %s: %s", self.path, e)
                text = last_text if last_text is not None else ""
            if text != last_text:
                last_text = text
                try:
                    endpoints = self._endpoints(parse_backend_lines(text))
                except DiscoveryError as e:
                    log.error("discovery file %s: %s; keeping the previous set", self.path, e)
                else:
                    if endpoints != published:
                        published = endpoints
                        publish(endpoints)
            if published is None:
                published = frozenset()
                publish(published)
            await asyncio.sleep(self.interval)

    def _endpoints(self, lines: list[tuple[str, str, str]]) -> frozenset[Endpoint]:
        now = time.time()
        out = []
        for i, (kind, address, group) in enumerate(lines):
            order = self._first_seen.setdefault((kind, address), now + i * 1e-6)
            out.append(Endpoint(kind, address, group, order=order))
        return frozenset(out)


# -- Kubernetes --------------------------------------------------------------------------
def endpoints_of_slice(slice_obj, port_name: str = "grpc") -> list[Endpoint]:
    """The stage or draft endpoints of one EndpointSlice (a `kubernetes` client model)."""
    meta = slice_obj.metadata
    labels = dict(meta.labels or {})
    kind = labels.get(COMPONENT_LABEL)
    if kind not in KINDS:
        return []
    ports = slice_obj.ports or []
    port = next((p.port for p in ports if p.name == port_name), None)
    if port is None and len(ports) == 1:
        port = ports[0].port
    if port is None:
        return []
    created = meta.creation_timestamp
    order = created.timestamp() if created is not None else 0.0
    group = labels.get(VERSION_LABEL, "")
    out = []
    for ep in slice_obj.endpoints or []:
        cond = ep.conditions
        terminating = bool(cond and cond.terminating)
        serving = cond.serving if cond and cond.serving is not None else True
        if terminating and not serving:
            continue  # going away and no longer serving: its requests are lost anyway
        for ip in (ep.addresses or [])[:1]:
            host = f"[{ip}]" if ":" in ip else ip
            out.append(Endpoint(kind, f"{host}:{port}", group, terminating, order))
    return out


class KubernetesDiscovery(Discovery):
    """The EndpointSlices of the release's stage and draft Services, listed, then watched
    (in a thread: the official client is synchronous). A watch that ends or fails is
    resumed from the last resourceVersion, or relisted (410 Gone, errors) after a short
    backoff; the last published set stays in force meanwhile."""

    name = "kubernetes"

    def __init__(
        self,
        namespace: str | None = None,
        selector: str = DEFAULT_SELECTOR,
        api_client=None,
        port_name: str = "grpc",
        watch_seconds: int = 300,
        backoff: float = 1.0,
    ) -> None:
        self.namespace = namespace or _own_namespace()
        self.selector = selector
        self.port_name = port_name
        self.watch_seconds = watch_seconds
        self.backoff = backoff
        self._api_client = api_client
        self._stop = threading.Event()
        self._watch = None

    def describe(self) -> str:
        return f"EndpointSlices in namespace {self.namespace} with labels {self.selector!r}"

    def _api(self):
        from kubernetes import client, config

        if self._api_client is None:
            try:
                config.load_incluster_config()  # in a pod: its service account
            except config.ConfigException:
                config.load_kube_config()  # elsewhere: $KUBECONFIG or ~/.kube/config
            self._api_client = client.ApiClient()
        return client.DiscoveryV1Api(self._api_client)

    async def run(self, publish: Publish) -> None:
        loop = asyncio.get_running_loop()

        def emit(endpoints: frozenset[Endpoint]) -> None:
            loop.call_soon_threadsafe(publish, endpoints)

        self._stop.clear()
        thread = threading.Thread(target=self._follow, args=(emit,), daemon=True,
                                  name="k8s-discovery")  # fmt: skip
        thread.start()
        try:
            await asyncio.Event().wait()
        finally:
            self._stop.set()
            if self._watch is not None:
                self._watch.stop()

    def _follow(self, emit: Callable[[frozenset[Endpoint]], None]) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        api = self._api()
        slices: dict[str, object] = {}
        published: frozenset[Endpoint] | None = None

        def publish_if_changed() -> None:
            nonlocal published
            current = frozenset(
                e for s in slices.values() for e in endpoints_of_slice(s, self.port_name)
            )
            if current != published:
                published = current
                emit(current)

        version: str | None = None
        while not self._stop.is_set():
            try:
                if version is None:
                    listed = api.list_namespaced_endpoint_slice(
                        self.namespace, label_selector=self.selector, _request_timeout=30
                    )
                    slices = {s.metadata.name: s for s in listed.items}
                    version = listed.metadata.resource_version
                    publish_if_changed()
                self._watch = watch.Watch()
                for event in self._watch.stream(
                    api.list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=self.selector,
                    resource_version=version,
                    timeout_seconds=self.watch_seconds,
                    _request_timeout=(10, self.watch_seconds + 30),
                ):
                    if self._stop.is_set():
                        return
                    kind, obj = event["type"], event["object"]
                    if kind == "BOOKMARK":
                        version = self._watch.resource_version or version
                        continue
                    name = obj.metadata.name
                    if kind == "DELETED":
                        slices.pop(name, None)
                    else:
                        slices[name] = obj
                    version = obj.metadata.resource_version or version
                    publish_if_changed()
            except ApiException as e:
                if self._stop.is_set():
                    return
                if e.status == 410:  # the watch's version is too old: list again
                    log.info("EndpointSlice watch expired; listing again")
                else:
                    log.warning("EndpointSlice discovery: %s %s", e.status, e.reason)
                    self._stop.wait(self.backoff)
                version = None
            except Exception as e:  # connection errors of every kind: retry, keep the set
                if self._stop.is_set():
                    return
                log.warning("EndpointSlice discovery failed (%s); retrying", e)
                self._stop.wait(self.backoff)
                version = None


def _own_namespace() -> str:
    with contextlib.suppress(OSError):
        return NAMESPACE_FILE.read_text().strip()
    return "default"


# -- from the command line -----------------------------------------------------------------
def discovery_of(config: RouterConfig) -> Discovery:
    """The replicas' source a router's configuration names (`make_discovery`)."""
    return make_discovery(
        config.discovery,
        config.stages,
        config.drafts,
        config.discovery_namespace,
        config.discovery_selector,
    )


def make_discovery(
    spec: str | None,
    stages: Sequence[str] = (),
    drafts: Sequence[str] = (),
    namespace: str | None = None,
    selector: str | None = None,
) -> Discovery:
    """`--discovery` (None: the static `--stages`/`--draft` lists; `file:PATH`;
    `kubernetes`) as a source; DiscoveryError for a bad spec."""
    if spec is None or spec == "static":
        if not stages:
            raise DiscoveryError("--stages lists no addresses (or use --discovery)")
        return StaticDiscovery(stages, drafts)
    if stages or drafts:
        raise DiscoveryError("--discovery replaces --stages and --draft: give one or the other")
    if spec.startswith("file:") and spec[5:]:
        return FileDiscovery(spec[5:])
    if spec in ("kubernetes", "k8s"):
        return KubernetesDiscovery(namespace, selector or DEFAULT_SELECTOR)
    raise DiscoveryError(f"--discovery {spec!r}: use file:PATH or kubernetes")
