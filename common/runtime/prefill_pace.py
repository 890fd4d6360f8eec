"""How much prefill a stage's (or the draft's) step takes beside other requests' decodes,
learned from its own steps (docs/architecture.md, "5. The request controller and its
executors", "Bounded memory per step").

A decode's time between tokens is its steps' time; a step that also runs a prefill
chunk lasts the decodes' time plus the chunk's, and a chunk's cost grows with its rows
x keys (its attention), not its rows alone: 128 rows at 4k tokens of context cost a
tiny CPU stage 60 ms against 5-10 ms for a step of decodes. So beside decodes a step
takes prefill of about what a step of decodes costs (`cells`): a neighbour's step then
takes about twice its quiet time while a long prompt is prefilled. Measured online:
the seconds of steps of decodes alone, and of prefill per rows x keys (steps of
prefill alone, or beside decodes less their measured share). Until both are measured,
and where no decode waits, the memory budget's bound (`StepBudget.prefill_cells`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# Weight of the newest step in the running means.
DECAY = 0.2
# The least prefill a step takes beside decodes (its fixed cost would dominate below).
MIN_PREFILL_CELLS = 1 << 14
# Steps with fewer rows x keys of prefill say little about its cost per cell (their
# fixed cost dominates): not measured.
MIN_MEASURED_CELLS = 1 << 16
# Decodes this recent count as going on: a client's next request (or a request between
# two steps) is not kept waiting behind a step of prefill sized for no one beside it.
RECENT_SECONDS = 2.0


@dataclass
class PrefillPace:
    """Running means of a step's cost; `cells` is the prefill a step takes beside
    decodes, at most `ceiling` (the memory budget's)."""

    ceiling: int
    decode_seconds: float | None = None  # a step of decodes alone
    cell_seconds: float | None = None  # per rows x keys of prefill
    decoded_at: float = float("-inf")  # the last step with decodes (time.monotonic)

    def observe(self, decode_rows: int, cells: int, seconds: float) -> None:
        """One step: its decode rows, its prefill's rows x keys, its seconds."""
        if decode_rows:
            self.decoded_at = time.monotonic()
        if decode_rows and not cells:
            self.decode_seconds = _mean(self.decode_seconds, seconds)
            return
        if cells < MIN_MEASURED_CELLS:
            return
        if decode_rows:
            if self.decode_seconds is None:
                return
            seconds -= self.decode_seconds
        self.cell_seconds = _mean(self.cell_seconds, max(seconds, 0.0) / cells)

    def decoding(self) -> bool:
        """Whether requests decoded here within `RECENT_SECONDS`."""
        return time.monotonic() - self.decoded_at < RECENT_SECONDS

    @property
    def cells(self) -> int:
        """Rows x keys of prefill one step takes beside decodes: what costs as much as a
        step of decodes alone, in [MIN_PREFILL_CELLS, ceiling]."""
        if self.decode_seconds is None or not self.cell_seconds:
            return self.ceiling
        cells = int(self.decode_seconds / self.cell_seconds)
        return max(min(MIN_PREFILL_CELLS, self.ceiling), min(self.ceiling, cells))


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - DECAY) * old + DECAY * new
