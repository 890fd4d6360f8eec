"""A stage's prefill chunks as a round sees them (docs/architecture.md, "5. The request
controller and its executors", "Bounded memory per step"): what one costs (rows x keys),
and, where a chunk costs more than a round beside decodes may take, its first rows
computed alone (a `Slice`), their output held until the rest of the chunk is computed,
so the next hop still gets one frame per activation, in order."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specpipe.common.runtime.ordering import Pending, RequestOrder
from specpipe.common.spec.growth import chunk_spans
from specpipe.common.spec.messages import Activation


@dataclass
class Slice(Pending):
    """The first rows of a prefill chunk, computed in a round before the rest."""


def next_is_prefill(order: RequestOrder) -> bool:
    """Whether the activation whose turn is next (arrived or not) is a prefill chunk."""
    item = order.pending.get(order.next_seq)
    return item is not None and item.act.committed and not item.empty


def prefill_cells(act: Activation) -> int:
    """A prefill chunk's rows x keys (its last row sees every key up to its position)."""
    return len(act) * (int(act.positions[-1]) + 1) if len(act) else 0


def rows_within(act: Activation, cells: int) -> int:
    """The most leading rows of chunk `act` whose rows x keys are within `cells` (one at
    least)."""
    start = int(act.positions[0])
    _, stop = chunk_spans(start, start + len(act), len(act), max(cells, 1))[0]
    return stop - start


def split_chunk(act: Activation, rows: int) -> tuple[Activation, Activation]:
    """A prefill chunk as its first `rows` rows and the rest."""

    def part(sl: slice) -> Activation:
        return Activation(
            act.request_id,
            act.positions[sl],
            True,
            tokens=None if act.tokens is None else act.tokens[sl],
            hidden=None if act.hidden is None else act.hidden[sl],
        )

    return part(slice(0, rows)), part(slice(rows, None))


def joined(parts: list[Activation]) -> Activation:
    """The outputs of a chunk's slices and its rest as the chunk's one output."""
    first = parts[0]
    hidden = [p.hidden for p in parts]
    return Activation(
        first.request_id,
        torch.cat([p.positions for p in parts]),
        True,
        hidden=None if any(h is None for h in hidden) else torch.cat(hidden),  # type: ignore[misc]
    )
