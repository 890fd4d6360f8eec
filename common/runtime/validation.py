"""Checks of what a stage or the draft is asked to compute, before it is computed
(docs/architecture.md, "9. Security").

Whatever arrives (a `Feed`, a draft call, a data-plane frame) is checked against the
runtime that would compute it: row counts against each other and against a bound,
positions inside the model's context, token ids inside its vocabulary, a payload that
is 2-D, of the stage's own dtype and width, one row per position and finite. Each check
raises `InvalidInput` (INVALID_ARGUMENT) with a message that names what is wrong; none
computes or allocates more than the input's own size. Counts are checked first, from
lengths alone (`check_counts`), so a message claiming a huge number of rows is refused
before its tensors are built. Values are read last: a stage checks that the hidden
states of a round's inputs are finite on its compute thread, all at once (`nonfinite`),
since reading a device tensor waits for the device, behind whatever forward runs there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from ..model.layers import StageModel
from ..spec.messages import Activation
from ..spec.options import MAX_PREFILL_CHUNK, MAX_SPECINFER_DEPTH, MAX_WIDTH
from .errors import InvalidInput

# Cache rows beyond the context a request may ask for: its token tree (SpecInfer's
# largest, which is larger than SpecPipe's layers in flight).
MAX_TREE_ROWS = MAX_SPECINFER_DEPTH * MAX_WIDTH + 2
# Rows of one activation: a prefill chunk or a whole SpecInfer tree.
MAX_ROWS = max(MAX_PREFILL_CHUNK, MAX_TREE_ROWS)
# Items (feeds, prunes) in one batched control call (a router sends more as several).
MAX_CALLS_PER_BATCH = 256

# The rows one activation (a prefill chunk, a tree feed, a draft layer) may carry on a
# stage or the draft: rows beyond the point where a forward's cost per row stops falling
# buy no throughput, only a longer forward that every other request waits for, and
# activation memory. Bounds of the measured point: the floor holds the default prefill
# chunk and every default tree with room; the ceiling is taken when the cost per row
# still falls at the largest row count measured (accelerators).
MIN_STEP_ROWS = 256
MAX_STEP_ROWS = 2048
DEFAULT_STEP_ROWS = 1024  # without a measured cost curve
FLAT_COST_PER_ROW = 1.1  # within 10% of the lowest cost per row measured: flat
STILL_FALLING = 1.5  # the last two counts measured: a cost per row falling this much


class _Curve(Protocol):
    rows: Sequence[int]
    seconds: Sequence[float]


@dataclass(frozen=True)
class Limits:
    """What one runtime accepts."""

    vocab_size: int
    hidden_size: int
    max_positions: int
    dtype: torch.dtype
    max_rows: int = MAX_ROWS

    @classmethod
    def of(cls, model: StageModel) -> Limits:
        cfg = model.cfg
        return cls(cfg.vocab_size, cfg.hidden_size, cfg.max_position_embeddings, model.dtype)

    @property
    def max_capacity(self) -> int:
        """The largest cache a request may open: the whole context plus a token tree."""
        return self.max_positions + MAX_TREE_ROWS

    def row_bytes(self, width: int, dtype: torch.dtype | None = None) -> int:
        return width * (dtype or self.dtype).itemsize


def step_row_cap(curve: _Curve | None) -> int:
    """The most rows one activation may carry on a runtime with this measured cost curve
    (`perf.cost_model.CostCurve`; None: not measured): the fewest rows whose cost per row
    is within `FLAT_COST_PER_ROW` of the lowest measured, in [MIN_STEP_ROWS,
    MAX_STEP_ROWS]; MAX_STEP_ROWS when it still falls steeply (`STILL_FALLING`) at the
    largest count measured."""
    pairs = zip(curve.rows, curve.seconds, strict=True) if curve is not None else ()
    points = sorted((int(n), float(sec) / n) for n, sec in pairs if n > 0)
    if len(points) < 2:
        return DEFAULT_STEP_ROWS
    lowest = min(per_row for _, per_row in points)
    flat = min(n for n, per_row in points if per_row <= FLAT_COST_PER_ROW * lowest)
    (_, before), (last, at_last) = points[-2:]
    if flat == last and before >= STILL_FALLING * at_last:
        return MAX_STEP_ROWS
    return max(MIN_STEP_ROWS, min(MAX_STEP_ROWS, flat))


def check_counts(
    rows: int,
    node_ids: int,
    parent_ids: int,
    committed: bool,
    tokens: int | None = None,
    max_rows: int = MAX_ROWS,
) -> None:
    """Row counts of a message, before its tensors exist: at most `max_rows` rows; tree
    rows have one node id and one parent id each, committed rows none; one token per row."""
    if rows > max_rows:
        raise InvalidInput(
            f"{rows} rows in one activation; this service takes at most {max_rows} rows "
            "per step (a prefill chunk or a token tree)"
        )
    if committed and (node_ids or parent_ids):
        raise InvalidInput("committed rows (a prefill chunk) carry no node or parent ids")
    if not committed and (node_ids != rows or parent_ids != rows):
        raise InvalidInput(
            f"{rows} tree rows need one node id and one parent id each, "
            f"got {node_ids} node ids and {parent_ids} parent ids"
        )
    if tokens is not None and tokens != rows:
        raise InvalidInput(f"{tokens} token ids for {rows} rows")


def check_rows(act: Activation, limits: Limits) -> None:
    """Counts, positions inside [0, max_positions), node ids >= 0, parents >= -1."""
    n = len(act)
    check_counts(
        n,
        int(act.node_ids.numel()),
        int(act.parent_ids.numel()),
        act.committed,
        None,
        limits.max_rows,
    )
    if n == 0:
        return
    lo, hi = int(act.positions.min()), int(act.positions.max())
    if lo < 0 or hi >= limits.max_positions:
        raise InvalidInput(
            f"positions [{lo}, {hi}] are outside the model's context [0, {limits.max_positions})"
        )
    if not act.committed:
        if int(act.node_ids.min()) < 0:
            raise InvalidInput("node ids must be >= 0")
        if int(act.parent_ids.min()) < -1:
            raise InvalidInput("parent ids must be >= -1 (-1: the committed prefix)")


def check_token_ids(tokens: Tensor, vocab_size: int, what: str = "token ids") -> None:
    if tokens.numel() and not (int(tokens.min()) >= 0 and int(tokens.max()) < vocab_size):
        raise InvalidInput(f"{what} outside the vocabulary [0, {vocab_size})")


def check_tokens(act: Activation, limits: Limits) -> None:
    """The first stage's (and the draft's) input: one int64 token id per row, in the
    vocabulary."""
    t = act.tokens
    if t is None:
        raise InvalidInput("the first stage needs token ids")
    if t.dtype != torch.int64 or t.ndim != 1 or t.numel() != len(act):
        raise InvalidInput(
            f"token ids must be int64 [{len(act)}], got {str(t.dtype).removeprefix('torch.')} "
            f"{list(t.shape)}"
        )
    check_token_ids(t, limits.vocab_size)


def check_payload(
    x: Tensor,
    rows: int,
    width: int,
    dtypes: tuple[torch.dtype, ...],
    what: str,
    finite: bool = True,
) -> None:
    """A 2-D [rows, width] tensor of one of `dtypes`, every value finite (without
    `finite`, the values are left to `nonfinite` on the compute thread: a stage's
    event loop must not read a device tensor's values)."""
    if x.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise InvalidInput(f"{what} must be {names}, got {str(x.dtype).removeprefix('torch.')}")
    if x.ndim != 2 or x.shape[0] != rows or x.shape[1] != width:
        raise InvalidInput(f"{what} must be [{rows}, {width}], got {list(x.shape)}")
    if finite and nonfinite([x])[0]:
        raise InvalidInput(nonfinite_message(what))


def nonfinite_message(what: str) -> str:
    return f"{what} contain NaN or infinite values"


# A float whose exponent bits are all set is a NaN or an infinity: how `host_finite`
# reads the dtypes numpy has none of (bfloat16), and float16 without a conversion.
_EXPONENT_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def host_finite(x: Tensor) -> bool | None:
    """Whether a host tensor holds no NaN and no infinity, read through numpy: a few
    microseconds where torch's `isfinite(x).all()` takes 6 for [4, 64] and 560 for
    [160, 1536] float32 on one thread. None where it cannot tell so (a device tensor,
    another dtype): then torch's reduction."""
    if x.device.type != "cpu":
        return None
    if x.dtype in (torch.float32, torch.float64):
        return bool(np.isfinite(x.detach().numpy()).all())
    mask = _EXPONENT_BITS.get(x.dtype)
    if mask is None:
        return None
    return not bool(((x.detach().view(torch.int16).numpy() & mask) == mask).any())


def nonfinite(tensors: Sequence[Tensor]) -> list[bool]:
    """Which of `tensors` hold a NaN or an infinity: host tensors read through numpy
    (`host_finite`), the others with one reduction each on their device and one read
    per device for all of them, so a stage checks a whole round's inputs with one wait
    for the device, on its compute thread (on the event loop the read would wait behind
    the forward running on the device)."""
    out = [False] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, x in enumerate(tensors):
        if not x.numel():
            continue
        host = host_finite(x)
        if host is not None:
            out[i] = not host
        else:
            by_device.setdefault(x.device, []).append(i)
    for idx in by_device.values():
        flags = torch.stack([~torch.isfinite(tensors[i]).all() for i in idx])
        for i, bad in zip(idx, flags.tolist(), strict=True):  # the one read of the device
            out[i] = bad
    return out


def check_hidden(act: Activation, limits: Limits, finite: bool = True) -> None:
    """Input of a later stage: hidden states [rows, hidden_size] of the stage's dtype
    (finite: see `check_payload`)."""
    if act.hidden is None:
        raise InvalidInput("stages after the first need hidden states")
    h, width = act.hidden, limits.hidden_size
    check_payload(h, len(act), width, (limits.dtype,), "hidden states", finite)


def check_input(act: Activation, limits: Limits, first: bool, finite: bool = True) -> None:
    """Everything about an activation a stage (first: token ids; else hidden states)
    is about to compute; without `finite`, all but the values of hidden states, which
    the stage then checks on its compute thread (`nonfinite`)."""
    check_rows(act, limits)
    if first:
        check_tokens(act, limits)
    else:
        check_hidden(act, limits, finite)


def check_capacity(capacity: int, limits: Limits) -> None:
    if not 0 < capacity <= limits.max_capacity:
        raise InvalidInput(
            f"capacity {capacity} is outside [1, {limits.max_capacity}] "
            f"(the context of {limits.max_positions} plus a tree of {MAX_TREE_ROWS})"
        )


def check_span(start: int, count: int, limits: Limits) -> None:
    """Positions [start, start + count) of verified tokens inside the context."""
    if start < 0 or start + count > limits.max_positions:
        raise InvalidInput(
            f"positions [{start}, {start + count}) are outside the model's context "
            f"[0, {limits.max_positions})"
        )
