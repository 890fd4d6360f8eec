"""Why a request cannot proceed on a stage or the draft, by type.

The runtimes raise these; the services answer each type with one gRPC status
(`services/status.py`), so no caller matches error messages.
"""

from __future__ import annotations


class RequestError(RuntimeError):
    """The request cannot proceed on this stage or draft."""


class CacheFull(RequestError):
    """No room: the KV cache budget is exhausted, or the request's cache is full."""


class NotOpen(RequestError):
    """The request is not open here (never opened, or released)."""


class AlreadyOpen(RequestError):
    """A request with this id is already open here."""


class BadInput(RequestError):
    """Rows this request cannot take: a missing tensor, unknown or duplicate node ids,
    nodes before their parent, committed rows behind tree rows."""


class DuplicatePrune(RequestError):
    """A prune this request has already received (each is sent once, numbered 1, 2, ...)."""


class InvalidInput(RequestError):
    """Input no well-behaved router or stage sends: row counts that disagree, positions
    outside the context, token ids outside the vocabulary, a payload of the wrong shape,
    dtype or with non-finite values, a sequence number far ahead of the request's or seen
    before. Checked before anything is computed or allocated for it
    (`common/runtime/validation.py`)."""


class Overloaded(RequestError):
    """More than a request may hold waiting here: received work that cannot be computed
    yet beyond its bound (`common/runtime/ordering.py`)."""


class NotOwner(RequestError):
    """A lease call that does not come from the process that holds the leases: the
    owner's epoch with another lease token (`common/runtime/lease.py`)."""
