"""What every backend call of one request carries and how its failure is told: the
client's deadline (each call gets what is left of it, capped), the request's lease claim,
and the gRPC status a failed call becomes for the client (`DriverError`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import grpc

from .backends import Backend

# Codes of a backend call that mean "this replica is gone or lost the request" (a
# restarted stage answers NOT_FOUND): the request is replayed on another path.
REPLAYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.NOT_FOUND,
)
# How close to the client's deadline a call's DEADLINE_EXCEEDED is the client's own.
DEADLINE_SLACK = 0.05


class DriverError(Exception):
    """The request failed; `code` is the gRPC status the client receives; `replayable`:
    another path may serve it."""

    def __init__(self, code: grpc.StatusCode, message: str, replayable: bool = False) -> None:
        super().__init__(message)
        self.code, self.message, self.replayable = code, message, replayable


class LeaseClaim(NamedTuple):
    """The router's name, process epoch and lease token (common/runtime/lease.py), sent
    with every `Open` so that only this router renews the request."""

    owner: str = ""
    epoch: int = 0
    token: bytes = b""


NO_LEASE = LeaseClaim()  # in-process tests: no lease to renew


@dataclass(frozen=True)
class Deadline:
    """The client's deadline (on time.monotonic(); None: none) and the longest any one
    backend call may take: a call that outlives the client only keeps a stage busy."""

    at: float | None = None
    max_call: float = 60.0

    def timeout(self, cap: float | None = None) -> float:
        """The next call's timeout: what is left of the deadline, at most `max_call`
        (and `cap`)."""
        limit = self.max_call if cap is None else min(self.max_call, cap)
        if self.at is None:
            return limit
        return min(limit, max(self.at - time.monotonic(), 0.01))

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at - DEADLINE_SLACK

    def error(self, b: Backend, what: str, e: BaseException) -> DriverError:
        """A backend call's failure; a call cut short by the client's deadline says so."""
        if (
            isinstance(e, grpc.aio.AioRpcError)
            and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            and self.passed()
        ):
            return DriverError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"the deadline passed while {what} on {b.label}"
            )
        return backend_error(b, what, e)


def backend_error(b: Backend, what: str, e: BaseException) -> DriverError:
    """A failed call to a backend, as the status the client should see."""
    if isinstance(e, DriverError):
        return e
    if isinstance(e, grpc.aio.AioRpcError):
        code = e.code()
        replayable = code in REPLAYABLE
        passthrough = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return DriverError(
                grpc.StatusCode.UNAVAILABLE,
                f"{b.label} is unavailable ({what}): {e.details()}",
                replayable,
            )
        if code in passthrough:
            return DriverError(code, f"{b.label}: {e.details()}")
        return DriverError(
            grpc.StatusCode.INTERNAL,
            f"{b.label} failed {what}: {code.name}: {e.details()}",
            replayable,
        )
    return DriverError(grpc.StatusCode.INTERNAL, f"{b.label} failed {what}: {e!r}")
