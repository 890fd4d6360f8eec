"""Which inbound data-plane connections a receiver keeps (issue 22, N3).

A connection is *half-open* until its first complete frame arrived (with `--secure`,
until that frame's tags verified): it has cost the peer nothing but a TCP handshake. A
receiver holds at most `max_half_open_per_peer` half-open connections per peer address
and `max_connections` connections in all. A newcomer never waits for a slot: when its
peer already holds its share of half-open connections, that peer's oldest half-open one
is closed; when every slot is taken, the oldest half-open connection of any peer is.
Only when every slot holds an established connection is the newcomer refused. So a peer
that opens connections and sends nothing (or drips a byte now and then) can hold only
its own few slots, and another peer's new connection (the router's, the previous
stage's) still gets in; the frame deadlines (`base.py`) bound how long any of them is
held.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

C = TypeVar("C", bound=Hashable)


class ConnectionSlots(Generic[C]):
    """The inbound connections of one listener, half-open ones by peer in the order they
    opened. Callers close what `open` tells them to and report `established`/`closed`."""

    def __init__(self, max_connections: int, max_half_open_per_peer: int) -> None:
        if max_connections < 1 or max_half_open_per_peer < 1:
            raise ValueError("connection limits must be at least 1")
        self.max_connections = max_connections
        self.max_half_open_per_peer = max_half_open_per_peer
        self._peer: dict[C, str] = {}  # every connection held -> its peer address
        self._half_open: dict[str, dict[C, None]] = {}  # peer -> half-open, oldest first
        self.evicted = self.refused = 0

    def __len__(self) -> int:
        return len(self._peer)

    def __contains__(self, conn: object) -> bool:
        return conn in self._peer

    def half_open(self, peer: str | None = None) -> int:
        if peer is not None:
            return len(self._half_open.get(peer, ()))
        return sum(len(d) for d in self._half_open.values())

    def open(self, conn: C, peer: str) -> list[C] | None:
        """Take `conn` from `peer`: the connections to close to make room for it (they
        are forgotten here already), or None: refuse it (nothing here may go)."""
        victims: list[C] = []
        mine = self._half_open.get(peer, {})
        if len(mine) >= self.max_half_open_per_peer:
            victims.append(next(iter(mine)))
        if len(self._peer) - len(victims) >= self.max_connections:
            oldest = self._oldest_half_open()
            if oldest is None:
                self.refused += 1
                return None
            victims.append(oldest)
        for v in victims:
            self.closed(v)
        self.evicted += len(victims)
        self._peer[conn] = peer
        self._half_open.setdefault(peer, {})[conn] = None
        return victims

    def _oldest_half_open(self) -> C | None:
        """The half-open connection that opened first, over every peer."""
        firsts = [next(iter(d)) for d in self._half_open.values() if d]
        if not firsts:
            return None
        order = {c: i for i, c in enumerate(self._peer)}  # insertion order = opening order
        return min(firsts, key=order.__getitem__)

    def established(self, conn: C) -> None:
        """`conn` delivered its first complete (authentic) frame."""
        peer = self._peer.get(conn)
        if peer is not None:
            self._forget_half_open(conn, peer)

    def closed(self, conn: C) -> None:
        peer = self._peer.pop(conn, None)
        if peer is not None:
            self._forget_half_open(conn, peer)

    def _forget_half_open(self, conn: C, peer: str) -> None:
        mine = self._half_open.get(peer)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self._half_open[peer]

    def all(self) -> list[C]:
        return list(self._peer)
