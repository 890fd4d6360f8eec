"""How many connections a public listener holds: at most `total`, and at most
`per_client` from one client (an address; on the router's HTTP port with API keys, an
API key: `http_guard.KeyConnections`), so that no client (nor all of them together) can
use up the process's file descriptors or threads (docs/architecture.md, "9. Security").

`ConnectionCounts` is the bookkeeping only, shared by the router's HTTP port and the
metrics servers; each listener refuses a connection `admit` says no to as cheaply as it
can (closed at once) and calls `release` exactly once for every one admitted.
"""

from __future__ import annotations

import resource
import threading

# A share of the file descriptors a public listener may take: the rest are the process's
# own (gRPC channels to the stages, the data plane, log files, the other listener).
FD_SHARE = 4
MAX_CONNECTIONS = 1024


def default_max_connections(cap: int = MAX_CONNECTIONS) -> int:
    """`cap`, or a quarter of this process's file-descriptor limit when that is lower."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return cap
    return max(16, min(cap, soft // FD_SHARE))


class ConnectionCounts:
    """Open connections, in all and by client (an address or a key; thread-safe)."""

    def __init__(self, total: int, per_client: int = 0) -> None:
        """`per_client` 0: no cap per address (behind a proxy every client has its
        address)."""
        if total < 1 or per_client < 0:
            raise ValueError("a connection cap must be positive (per client: 0 for none)")
        self.total, self.per_client = total, per_client
        self._by_client: dict[str, int] = {}
        self._open = 0
        self._lock = threading.Lock()
        self.refused = 0

    @property
    def open(self) -> int:
        return self._open

    def admit(self, client: str) -> str | None:
        """Count a new connection from `client`; None when admitted, else why not."""
        with self._lock:
            if self._open >= self.total:
                self.refused += 1
                return f"{self._open} connections open, the most this port takes"
            held = self._by_client.get(client, 0)
            if self.per_client and held >= self.per_client:
                self.refused += 1
                return f"{held} connections open from {client}, the most one client may hold"
            self._by_client[client] = held + 1
            self._open += 1
            return None

    def release(self, client: str) -> None:
        with self._lock:
            held = self._by_client.get(client, 0)
            if held <= 1:
                self._by_client.pop(client, None)
            else:
                self._by_client[client] = held - 1
            self._open = max(0, self._open - 1)

    def held_by(self, client: str) -> int:
        with self._lock:
            return self._by_client.get(client, 0)
