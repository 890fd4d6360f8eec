"""A stand-in for the Kubernetes API server, only as much as the router's EndpointSlice
discovery uses: list (`GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices`) and
watch (`...?watch=true`: a stream of JSON watch events, one a line). No API server can
run here; production uses the same official client against the real one."""

from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"


def endpoint_slice(
    name: str,
    component: str,
    addresses: list[str],
    port: int,
    version: str = "v1",
    terminating: tuple[str, ...] = (),
    created: str = "2025-01-01T00:00:00Z",
) -> dict:
    """An EndpointSlice as the endpointslice controller writes it for a chart Service."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "specpipe",
            "creationTimestamp": created,
            "labels": {
                "app.kubernetes.io/instance": "specpipe",
                "app.kubernetes.io/component": component,
                "specpipe.dev/model-version": version,
                "kubernetes.io/service-name": name.rsplit("-", 1)[0],
            },
        },
        "addressType": "IPv4",
        "ports": [
            {"name": "grpc", "port": port, "protocol": "TCP"},
            {"name": "data", "port": port + 1, "protocol": "TCP"},
        ],
        "endpoints": [
            {
                "addresses": [a],
                "conditions": {
                    "ready": a not in terminating,
                    "serving": True,
                    "terminating": a in terminating,
                },
            }
            for a in addresses
        ],
    }


class FakeApiServer:
    """Serves `slices` (name -> object) at /apis/discovery.k8s.io/v1; `put`/`delete`
    change them and send the watch event to every open watch; `expire()` ends open
    watches with a 410 error event (the client must list again)."""

    def __init__(self, namespace: str = "specpipe") -> None:
        self.namespace = namespace
        self.slices: dict[str, dict] = {}
        self.version = 1
        self.requests: list[dict] = []  # query of every request
        self._watchers: list[queue.Queue] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                fake.requests.append({"path": url.path, **query})
                if url.path != f"{PREFIX}{fake.namespace}/endpointslices":
                    self.send_error(404)
                    return
                if query.get("watch") == "true":
                    self._watch(query)
                else:
                    with fake._lock:
                        body = {
                            "apiVersion": "discovery.k8s.io/v1",
                            "kind": "EndpointSliceList",
                            "metadata": {"resourceVersion": str(fake.version)},
                            "items": list(fake.slices.values()),
                        }
                    data = json.dumps(body).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

            def _watch(self, query: dict) -> None:
                q: queue.Queue = queue.Queue()
                with fake._lock:
                    fake._watchers.append(q)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                deadline = time.monotonic() + float(query.get("timeoutSeconds", 300))
                try:
                    while time.monotonic() < deadline:
                        try:
                            event = q.get(timeout=0.1)
                        except queue.Empty:
                            continue
                        if event is None:
                            break
                        line = json.dumps(event).encode() + b"\n"
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    pass
                finally:
                    with fake._lock:
                        fake._watchers.remove(q)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _send(self, event: dict | None) -> None:
        for q in list(self._watchers):
            q.put(event)

    def put(self, obj: dict) -> None:
        with self._lock:
            self.version += 1
            obj = json.loads(json.dumps(obj))
            obj["metadata"]["resourceVersion"] = str(self.version)
            kind = "MODIFIED" if obj["metadata"]["name"] in self.slices else "ADDED"
            self.slices[obj["metadata"]["name"]] = obj
            self._send({"type": kind, "object": obj})

    def delete(self, name: str) -> None:
        with self._lock:
            self.version += 1
            obj = self.slices.pop(name)
            obj["metadata"]["resourceVersion"] = str(self.version)
            self._send({"type": "DELETED", "object": obj})

    def expire(self) -> None:
        """End every open watch with 410 Gone (a too old resourceVersion)."""
        gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "Expired", "message": "too old resource version", "code": 410}  # fmt: skip
        with self._lock:
            self._send({"type": "ERROR", "object": gone})
            self._send(None)

    def watchers(self) -> int:
        with self._lock:
            return len(self._watchers)

    def api_client(self):
        """An official `kubernetes` ApiClient configured for this server."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return client.ApiClient(cfg)

    def kubeconfig(self, path) -> None:
        """A kubeconfig file pointing at this server (for a router process)."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u",
                                                       "namespace": self.namespace}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
        }))  # fmt: skip

    def __enter__(self) -> FakeApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._send(None)
        self._server.shutdown()
        self._server.server_close()
