"""The events of one request's driver, one typed union: a data-plane frame from the last
stage (routed from the router's inbox), a draft's answer, a failed call, the end of a
late-draft hold. They reach the driver through one queue, in order, so that its
controller is never touched concurrently."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from specpipe.common.spec.messages import Candidates

from ..transport.codec import Frame
from .backends import Backend


@dataclass(frozen=True)
class Proposal:
    """The draft answered `Propose` `ticket` (on path `attempt`)."""

    attempt: int
    ticket: int
    cand: Candidates


@dataclass(frozen=True)
class Failure:
    """A call of path `attempt` failed, a replica of it went down or stalled, or the path
    went silent (`backend`: which replica, when known; `replayable`: another path may
    serve the request)."""

    attempt: int
    code: grpc.StatusCode
    message: str
    backend: Backend | None = None
    replayable: bool = False


@dataclass(frozen=True)
class HoldExpired:
    """Verifications held for a late draft may wait no longer (`late_draft.py`)."""


Event = Frame | Proposal | Failure | HoldExpired
