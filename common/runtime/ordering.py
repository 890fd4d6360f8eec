"""The order in which a stage runs one request's activations and prunes (no I/O).

The router numbers a request's activations by `seq` (0, 1, ...: the order it created
them in) and its prunes 1, 2, ...; each activation carries `after_prune`, the number of
prunes the router had sent when it created the activation. Activations and prunes reach
a stage on different channels and in any order. The rules:

- prunes are applied in their own order as soon as they arrive;
- activation `seq` is computed only after activation `seq - 1`, and only once the
  prunes it was created after are applied (`after_prune <= applied`);
- an activation that was pruned away upstream (`empty`) still takes its turn: it is not
  computed, it only passes the turn on (the stage forwards an empty frame);
- a prune or an activation that was already received is refused, and so is one
  numbered more than `window` ahead of the request's (it could never be reached, and
  would be held forever);
- what waits is bounded: at most `max_pending` activations and `max_pending_bytes` of
  their tensors per request (the stage sets it from the request's capacity: every row
  the request may ever cache, sent at once); beyond that an activation is refused
  (`Overloaded`, RESOURCE_EXHAUSTED), so one request cannot pile up memory with work
  that is never computed.

`RequestOrder` holds one request's waiting work and says what to do next; the stage
service only awaits what it says, computes and sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..spec.messages import Activation, Prune
from .errors import DuplicatePrune, InvalidInput, Overloaded

# Activations one request may have waiting (a prompt of the whole context in prefill
# chunks of 8 rows or more, sent at once, fits).
MAX_PENDING = 4096


def _nbytes(*tensors) -> int:
    return sum(t.nbytes for t in tensors if t is not None)


def _prune_bytes(prune: Prune) -> int:
    return _nbytes(prune.commit_ids, prune.keep_ids)


@dataclass
class Pending:
    """An activation waiting for its turn."""

    act: Activation
    after_prune: int
    empty: bool = False  # pruned away upstream: only passes the turn on

    @property
    def nbytes(self) -> int:
        """Bytes of the activation's tensors (what waiting holds)."""
        a = self.act
        return _nbytes(a.positions, a.node_ids, a.parent_ids, a.tokens, a.hidden)


@dataclass
class RequestOrder:
    pending: dict[int, Pending] = field(default_factory=dict)  # activations by seq
    prunes: dict[int, Prune] = field(default_factory=dict)  # received, not yet applied
    applied: int = 0  # prunes applied so far
    next_seq: int = 0  # the activation whose turn it is
    # How far ahead of the request's turn an activation or prune may be numbered (the
    # stage sets it from the request's cache capacity: every prefill chunk may be sent at
    # once, and each has at least one row).
    window: int = 1 << 20
    max_pending: int = MAX_PENDING
    max_pending_bytes: int = 1 << 62  # the stage sets it per request
    pending_bytes: int = 0  # of the activations in `pending`
    _sizes: dict[int, int] = field(default_factory=dict)  # their bytes, by seq
    _prune_sizes: dict[int, int] = field(default_factory=dict)  # the prunes', by seq

    def add_activation(self, seq: int, item: Pending) -> None:
        """Accept activation `seq`; InvalidInput if it was received before or is more
        than `window` ahead, Overloaded if it would make the work waiting for an earlier
        turn exceed its bounds (the activation whose turn it is always fits)."""
        if seq < self.next_seq or seq in self.pending:
            raise InvalidInput(f"activation {seq} was already received")
        if seq >= self.next_seq + self.window:
            raise InvalidInput(
                f"activation {seq} is more than {self.window} ahead of the request's "
                f"turn ({self.next_seq})"
            )
        size = item.nbytes
        if seq != self.next_seq:  # the turn's own activation is never refused
            self._check_room(f"activation {seq}", len(self.pending), "activations", size,
                             "wait for their turn")  # fmt: skip
        self.pending[seq] = item
        self._sizes[seq] = size
        self.pending_bytes += size

    def _check_room(self, item: str, waiting: int, kind: str, size: int, why: str) -> None:
        """Overloaded if one more waiting item of `size` bytes passes the bounds (count of
        its kind, bytes of everything that waits)."""
        if waiting >= self.max_pending:
            raise Overloaded(
                f"{item}: {waiting} {kind} of this request {why} already; "
                f"at most {self.max_pending} may"
            )
        if self.pending_bytes + size > self.max_pending_bytes:
            raise Overloaded(
                f"{item} ({size} bytes): {self.pending_bytes} bytes of this request "
                f"{why} already; at most {self.max_pending_bytes} may"
            )

    def add_prune(self, seq: int, prune: Prune) -> None:
        """Accept prune `seq`; DuplicatePrune if it was received before, InvalidInput if
        it is more than `window` ahead of the prunes applied, Overloaded beyond the bounds
        of what waits (prunes count with activations; the prune to apply next fits)."""
        if seq <= self.applied or seq in self.prunes:
            raise DuplicatePrune(f"prune {seq} was already received")
        if seq > self.applied + self.window:
            raise InvalidInput(
                f"prune {seq} is more than {self.window} ahead of the prunes applied ({self.applied})"
            )
        size = _prune_bytes(prune)
        if seq != self.applied + 1:  # the prune to apply next is never refused
            self._check_room(f"prune {seq}", len(self.prunes), "prunes", size,
                             "wait to be applied")  # fmt: skip
        self.prunes[seq] = prune
        self._prune_sizes[seq] = size
        self.pending_bytes += size

    def next_prune(self) -> tuple[int, Prune] | None:
        """The prune to apply now, if it has arrived; report it with `prune_applied`."""
        seq = self.applied + 1
        prune = self.prunes.get(seq)
        return None if prune is None else (seq, prune)

    def prune_applied(self, seq: int) -> None:
        if seq != self.applied + 1 or seq not in self.prunes:
            raise ValueError(f"prune {seq} is not the one to apply (applied {self.applied})")
        self.prunes.pop(seq)
        self.pending_bytes -= self._prune_sizes.pop(seq)
        self.applied = seq

    def next_activation(self) -> tuple[int, Pending] | None:
        """The activation whose turn it is, taken, once it has arrived and the prunes it
        was created after are applied (and no prune waits to be applied first)."""
        item = self.pending.get(self.next_seq)
        if item is None or item.after_prune > self.applied or self.next_prune() is not None:
            return None
        seq = self.next_seq
        del self.pending[seq]
        self.pending_bytes -= self._sizes.pop(seq)
        self.next_seq += 1
        return seq, item

    def turn_ready(self) -> bool:
        """Whether an activation's turn can be taken once the prunes already here are
        applied (what `next_activation` gives after every `next_prune`), without taking it."""
        item = self.pending.get(self.next_seq)
        if item is None:
            return False
        applied = self.applied
        while applied + 1 in self.prunes:
            applied += 1
        return item.after_prune <= applied

    def blocked(self) -> bool:
        """Activations are here but none can run: each waits for something still in
        flight (an earlier activation, or a prune it was created after)."""
        return bool(self.pending) and not self.turn_ready()
