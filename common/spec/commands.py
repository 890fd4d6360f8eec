"""What a request controller asks its executor to do (docs/architecture.md,
"5. The request controller and its executors").

The controller decides; an executor carries the commands out (in one process, stepping
every stage in lockstep, or over gRPC and the data plane) and reports back what happened
as events. Commands are executed in the order they are returned.

Rows and prunes are numpy (`rows`, `ids`): the network executor sends them as they are.
An in-process executor reads them as tensors (`act`, `layer`, `prune`: made on the
first read, then kept), the one place the controller's output becomes torch
(`messages.py`'s docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .messages import Activation, Prune, PruneArrays, RowArrays, TokenLogprobs


@dataclass(frozen=True)
class Feed:
    """Rows (a prefill chunk or a tree layer) into stage 1.

    `seq` numbers the feeds of a request in creation order; `after_prune` is how many
    prunes were broadcast before it was created (a stage computes it only once it has
    applied them); `step` is the pipeline step at which it enters stage 1 in the
    controller's accounting (prefill chunks have negative steps, the first root step 0).
    """

    rows: RowArrays
    seq: int
    after_prune: int
    step: int

    @cached_property
    def act(self) -> Activation:
        """The rows as tensors (in-process executors)."""
        return self.rows.activation()


@dataclass(frozen=True)
class _PruneCommand:
    ids: PruneArrays
    seq: int

    @cached_property
    def prune(self) -> Prune:
        """The prune as tensors (in-process executors)."""
        return self.ids.prune()


@dataclass(frozen=True)
class BroadcastPrune(_PruneCommand):
    """A verification's outcome, for every stage; `seq` counts prunes from 1."""


@dataclass(frozen=True)
class DraftOpen:
    """Open the request on the draft and cache the verified prompt (all but the root)."""

    prompt: list[int]
    capacity: int
    prefill_chunk: int


@dataclass(frozen=True)
class DraftPrune(_PruneCommand):
    """Drop pruned nodes from the draft's cache and commit verified ones. The draft needs
    it before its next computation, not at once: an executor may send it along with the
    next `Propose`."""


@dataclass(frozen=True)
class DraftPrefill:
    """Verified tokens the draft has not computed (specinfer: beyond what it proposed)."""

    tokens: list[int]
    start_position: int
    prefill_chunk: int


@dataclass(frozen=True)
class Propose:
    """Ask the draft for the children of `layer`'s nodes; the answer comes back as
    `Controller.on_candidates(ticket, ...)`. `step` is the pipeline step the layer enters
    stage 1 at (None for specinfer, whose draft works between passes)."""

    rows: RowArrays
    top_k: int
    temperature: float
    ticket: int
    step: int | None = None

    @cached_property
    def layer(self) -> Activation:
        """The layer's rows as tensors (in-process executors)."""
        return self.rows.activation()


@dataclass(frozen=True)
class Emit:
    """Verified tokens, in order: send them to the client (with their logprobs, one per
    token, for a request that asked for them)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class Finish:
    """The request is done: release it everywhere. `error` is set when it failed."""

    reason: str
    error: str = ""


Command = Feed | BroadcastPrune | DraftOpen | DraftPrune | DraftPrefill | Propose | Emit | Finish
