"""What one step's attention needs for every request at once, planned on the host under
the step's memory budget and sent to the device in one copy.

Each request of a step brings new rows (`kv_cache.NewRows`: their slots, how much of the
request's keys each sees as a prefix, and which tree rows are its ancestors) and the
slots of all its keys. The attention runs as padded parts of B query groups x Q query
rows x L keys (`model.paged_attention`); this module lays the requests out in them:

- a request's rows are one query group, unless one call over its rows x keys would pass
  the budget: then they are split into query blocks of as many rows as fit (each seeing
  only the keys its rows need: a prefill chunk's first rows see fewer), and where even
  `MIN_QUERY_BLOCK` rows do not fit, its keys are taken in key blocks too;
- query groups are packed into parts, the longest first, while a part's padded call
  fits the budget: a step that fits at once is one part, in the requests' order, which
  is what almost every step is.

Per part, all int64 in one buffer with the step's `write_slots` [N] and `out_rows` [N]
(the padded position of each new row in the parts' concatenated outputs):
- `key_slots` [B*L]: group b's keys at b*L.. (padding: slot 0, masked);
- `query_rows` [B*Q]: the new row at each padded query position (padding: row 0);
- `prefix` [B*Q] and `ancestors` [B*Q, D]: the mask, which the device expands to
  [B, 1, Q, L] (key j visible iff j < prefix or j is an ancestor; padded query rows
  see key 0, so no softmax row is empty, and padded keys read slot 0 of the pool,
  which holds finite values: the pool starts as zeros).

A step costs one host-to-device copy and the device builds each mask with a fixed number
of operations, whatever the number of requests. On a CPU there is no copy to make: the
arrays are used as they are, and a step of one part gets its mask from numpy
(`host_mask`, the same values), where tensor operations cost several times more at a
step's sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..model.flex_attention import FlexStep, build_flex_step, flex_applies
from ..model.paged_attention import AttentionPart, PagedBatch, tree_mask
from .block_pool import BlockPool
from .kv_cache import NewRows
from .step_budget import MIN_KEY_BLOCK, MIN_QUERY_BLOCK, StepCosts


@dataclass(frozen=True)
class QueryGroup:
    """Rows [start, stop) of request `request`'s new rows, over its first `keys` keys,
    taken `key_block` keys at a time."""

    request: int
    start: int
    stop: int
    keys: int
    key_block: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class PartPlan:
    """The query groups of one padded attention call and its shape (B, Q, L)."""

    groups: tuple[QueryGroup, ...]
    shape: tuple[int, int, int]
    key_block: int

    def bytes(self, costs: StepCosts) -> int:
        """Its working memory at once: one key block's."""
        b, q, _ = self.shape
        return costs.attention_bytes(b, q, self.key_block)


def keys_needed(rows: NewRows) -> np.ndarray:
    """How many of its request's keys each new row sees (its last visible key + 1)."""
    need = rows.prefix.astype(np.int64)
    if rows.ancestors.size:
        need = np.maximum(need, rows.ancestors.max(axis=1) + 1)
    return need


def _keys_of(rows: NewRows) -> int:
    """How many of its request's keys its new rows see (`keys_needed`'s most)."""
    if rows.keys is not None:
        return rows.keys
    most = int(rows.prefix.max())
    return max(most, int(rows.ancestors.max()) + 1) if rows.ancestors.size else most


def query_groups(index: int, rows: NewRows, costs: StepCosts, budget: int) -> list[QueryGroup]:
    """Request `index`'s new rows as query groups that each fit `budget` bytes."""
    need = keys_needed(rows)
    m, length = int(need.size), int(need.max())
    if costs.attention_bytes(1, m, length) <= budget:
        return [QueryGroup(index, 0, m, length, length)]
    fixed = length * costs.key_bytes
    per_row = length * costs.cell_bytes + costs.query_bytes
    q = (budget - fixed) // per_row
    # query blocks over all their keys, or of MIN_QUERY_BLOCK rows over key blocks
    block = int(q) if q >= min(m, MIN_QUERY_BLOCK) else min(m, MIN_QUERY_BLOCK)
    groups = []
    for s in range(0, m, block):
        e = min(m, s + block)
        keys = int(need[s:e].max())
        if costs.attention_bytes(1, e - s, keys) <= budget:
            kb = keys
        else:
            per_key = (e - s) * costs.cell_bytes + costs.key_bytes
            kb = (budget - (e - s) * costs.query_bytes) // per_key
            kb = max(MIN_KEY_BLOCK, kb // MIN_KEY_BLOCK * MIN_KEY_BLOCK)
        groups.append(QueryGroup(index, s, e, keys, min(kb, keys)))
    return groups


def plan(
    rows: Sequence[NewRows], costs: StepCosts | None, budget: int | None = None
) -> list[PartPlan]:
    """The step's attention parts: each padded call within `budget` bytes (None: one
    part of all); every request's rows in one part, in order, when that fits."""
    keys = [_keys_of(r) for r in rows]
    counts = [int(r.slots.size) for r in rows]
    # every request whole in one part when that fits (a part's bytes grow with B, Q and
    # L, so each request's own group fits then too): what `query_groups` would find
    if (
        costs is None
        or budget is None
        or (costs.attention_bytes(len(rows), max(counts), max(keys)) <= budget)
    ):
        whole = zip(counts, keys, strict=True)
        return [_part([QueryGroup(i, 0, m, k, k) for i, (m, k) in enumerate(whole)])]
    groups = [g for i, r in enumerate(rows) for g in query_groups(i, r, costs, budget)]
    whole = _part(groups)
    if whole.key_block == whole.shape[2] and whole.bytes(costs) <= budget:
        return [whole]
    parts: list[PartPlan] = []
    current: list[QueryGroup] = []
    for g in sorted(groups, key=lambda g: -g.keys):
        if g.key_block < g.keys:  # in key blocks: a part of its own
            parts.append(_part([g]))
            continue
        if current and _part([*current, g]).bytes(costs) > budget:
            parts.append(_part(current))
            current = []
        current.append(g)
    if current:
        parts.append(_part(current))
    return parts


def _part(groups: Sequence[QueryGroup]) -> PartPlan:
    q = max(g.rows for g in groups)
    length = max(g.keys for g in groups)
    block = min(g.key_block for g in groups) if len(groups) == 1 else length
    return PartPlan(tuple(groups), (len(groups), q, length), block)


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A host array on `device`, the copy queued without waiting for the device (a
    blocking copy would wait for the step still running there; on a CPU, the array's
    own memory)."""
    t = torch.from_numpy(array)
    if isinstance(device, torch.device) and device.type == "cpu":
        return t
    return t.to(device, non_blocking=True)


def pack(
    rows: Sequence[NewRows],
    key_slots: Sequence[np.ndarray],
    pool: BlockPool,
    costs: StepCosts | None = None,
    budget: int | None = None,
    flex: bool | None = None,
) -> PagedBatch:
    """The batch of `rows[b]` (request b's new rows) over keys `key_slots[b]`, against
    the K/V storage of `pool`, in attention parts of at most `budget` bytes each by
    `costs` (None: one part). `flex`: whether a step of one part attends through
    FlexAttention (None: `flex_applies` to the pool's device; a runtime decides once).

    A step that fits one part (almost every step) is laid out without planning objects,
    in a fixed number of array operations (`_whole_part`)."""
    device = pool.device
    counts = [int(r.slots.size) for r in rows]
    keys = [_keys_of(r) for r in rows]
    depth = max(1, max(r.ancestors.shape[1] for r in rows))
    if costs is None or budget is None:
        budget = None
    b, q, length = len(rows), max(counts), max(keys)
    if budget is None or costs.attention_bytes(b, q, length) <= budget:  # type: ignore[union-attr]
        shapes = [(b, q, length)]
        blocks = [length]
        arrays, out_rows = _whole_part(rows, key_slots, counts, keys, shapes[0], depth)
    else:
        plans = plan(rows, costs, budget)
        shapes = [p.shape for p in plans]
        blocks = [p.key_block for p in plans]
        if len(plans) == 1 and _whole_requests(plans[0], counts):
            arrays, out_rows = _one_part(rows, key_slots, plans[0], depth)
        else:
            arrays, out_rows = _parts(rows, key_slots, counts, plans, depth)
    n = int(out_rows.size)
    write = rows[0].slots if b == 1 else np.concatenate([r.slots for r in rows])
    # an accelerator's step of one part: FlexAttention over the keys unpadded
    one = len(shapes) == 1 and blocks[0] == length
    if flex is None:
        flex = flex_applies(device)
    flex = flex and one
    flex_arrays = flex_metadata(rows, key_slots) if flex else []

    parts = [write, out_rows, *arrays, *flex_arrays]
    if device.type == "cpu":  # nothing to copy: each array as it is
        write_t, out_t, *tensors = [torch.from_numpy(p) for p in parts]
    else:
        flat = to_device(np.concatenate(parts), device)
        write_t, out_t, *tensors = flat.split([p.size for p in parts])
    flex_step = _flex_step(tensors[len(arrays) :], n, depth) if flex else None
    built = []
    for i, (shape, block) in enumerate(zip(shapes, blocks, strict=True)):
        b, q, length = shape
        keys_t, query_t, prefix_t, anc_t = tensors[4 * i : 4 * i + 4]
        anc_t = anc_t.view(b * q, depth)
        mask = None
        if one and not flex and device.type == "cpu":
            mask = host_mask(arrays[2], arrays[3].reshape(b * q, depth), shape, pool.dtype)
        elif one and not flex:
            mask = tree_mask(prefix_t, anc_t, shape, pool.dtype)
        built.append(AttentionPart(keys_t, query_t, prefix_t, anc_t, shape, block, mask))
    gathered = 0
    if not flex:
        gathered = max((s[0] * s[2] for s, k in zip(shapes, blocks, strict=True) if k == s[2]),
                       default=0)  # fmt: skip
    return PagedBatch(
        kv=pool.kv,
        k=pool.k,
        v=pool.v,
        kv_buffer=pool.gather_buffer(gathered),
        write_slots=write_t,
        parts=tuple(built),
        out_rows=out_t,
        flex=flex_step,
    )


def host_mask(
    prefix: np.ndarray, ancestors: np.ndarray, shape: tuple[int, int, int], dtype: torch.dtype
) -> torch.Tensor:
    """`paged_attention.tree_mask` of a step on a CPU, built in numpy: the same additive
    mask [B, 1, Q, L] from the same host arrays (`prefix` [B*Q], `ancestors` [B*Q, D]
    padded with L), in a handful of array operations where the tensor operations cost
    about ten microseconds each at a step's sizes (no device to copy it to)."""
    b, q, length = shape
    visible = np.arange(length + 1) < prefix[:, None]
    visible[np.arange(b * q)[:, None], ancestors] = True
    mask = np.where(visible[:, :length], np.float32(0), np.float32(-np.inf))
    out = torch.from_numpy(mask).view(b, 1, q, length)
    return out if dtype == torch.float32 else out.to(dtype)


def _whole_requests(p: PartPlan, counts: Sequence[int]) -> bool:
    """Whether part `p` holds every request's rows as one query group, in order (what
    almost every step is)."""
    return len(p.groups) == len(counts) and all(
        g.request == i and g.start == 0 and g.stop == c
        for i, (g, c) in enumerate(zip(p.groups, counts, strict=True))
    )


def _one_part(
    rows: Sequence[NewRows], key_slots: Sequence[np.ndarray], p: PartPlan, depth: int
) -> tuple[list[np.ndarray], np.ndarray]:
    """`_whole_part` of a plan of one part of whole requests (`_whole_requests`)."""
    counts = [g.rows for g in p.groups]
    return _whole_part(rows, key_slots, counts, [g.keys for g in p.groups], p.shape, depth)


def _whole_part(
    rows: Sequence[NewRows],
    key_slots: Sequence[np.ndarray],
    counts: Sequence[int],
    keys: Sequence[int],
    shape: tuple[int, int, int],
    depth: int,
) -> tuple[list[np.ndarray], np.ndarray]:
    """The arrays of a step that is one part (`shape`) of whole requests, in order (request
    b: `counts[b]` new rows over its first `keys[b]` keys), and `out_rows`, built as
    whole-array operations over the concatenated new rows: a constant number of them
    whatever the number of requests (`_parts` lays out any plan, a group at a time)."""
    b, q, length = shape
    if b == 1:  # one request: its rows are the part's first query rows
        (r,), n = rows, counts[0]
        at = np.arange(n)  # n == q: no padded query row
        prefix = r.prefix.astype(np.int64, copy=False)
        keys_of = key_slots[0][: keys[0]].astype(np.int64, copy=False)
        ancestors = np.full((q, depth), length, dtype=np.int64)
        a = r.ancestors
        if a.shape[1]:
            ancestors[:n, : a.shape[1]] = np.where(a >= 0, a, length)
        return [keys_of, at, prefix, ancestors.ravel()], at
    counts_a = np.array(counts, dtype=np.int64)
    n = int(counts_a.sum())
    # each new row's padded position: its request's query group, then its place in it
    starts = np.arange(b, dtype=np.int64) * q - (np.cumsum(counts_a) - counts_a)
    at = np.arange(n, dtype=np.int64) + np.repeat(starts, counts_a)
    query_rows = np.zeros(b * q, dtype=np.int64)
    query_rows[at] = np.arange(n)
    prefix = np.ones(b * q, dtype=np.int64)
    prefix[at] = np.concatenate([r.prefix for r in rows])
    ancestors = np.full((b * q, depth), length, dtype=np.int64)
    widths = {r.ancestors.shape[1] for r in rows}
    if widths != {0}:
        a = np.full((n, depth), -1, dtype=np.int64)
        if len(widths) == 1:
            a[:, : widths.pop()] = np.concatenate([r.ancestors for r in rows])
        else:
            first = 0
            for r in rows:
                a[first : first + r.ancestors.shape[0], : r.ancestors.shape[1]] = r.ancestors
                first += r.ancestors.shape[0]
        ancestors[at] = np.where(a >= 0, a, length)
    need = np.array(keys, dtype=np.int64)
    key_table = np.zeros((b, length), dtype=np.int64)
    key_table[np.arange(length) < need[:, None]] = np.concatenate(
        [s[:k] for s, k in zip(key_slots, keys, strict=True)]
    )
    return [key_table.ravel(), query_rows, prefix, ancestors.ravel()], at


def _parts(
    rows: Sequence[NewRows],
    key_slots: Sequence[np.ndarray],
    counts: Sequence[int],
    plans: Sequence[PartPlan],
    depth: int,
) -> tuple[list[np.ndarray], np.ndarray]:
    """The arrays of every part of `plans` and `out_rows`, a query group at a time."""
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])  # each request's first row
    out_rows = np.zeros(int(sum(counts)), dtype=np.int64)
    arrays: list[np.ndarray] = []
    padded = 0  # padded query positions of the parts before
    for p in plans:
        b, q, length = p.shape
        keys = np.zeros((b, length), dtype=np.int64)
        query_rows = np.zeros(b * q, dtype=np.int64)
        prefix = np.ones(b * q, dtype=np.int64)
        ancestors = np.full((b * q, depth), length, dtype=np.int64)
        for i, g in enumerate(p.groups):
            r, at = rows[g.request], i * q
            m = g.rows
            keys[i, : g.keys] = key_slots[g.request][: g.keys]
            first = offsets[g.request] + g.start
            query_rows[at : at + m] = first + np.arange(m)
            out_rows[first : first + m] = padded + at + np.arange(m)
            prefix[at : at + m] = r.prefix[g.start : g.stop]
            a = r.ancestors[g.start : g.stop]
            ancestors[at : at + m, : a.shape[1]] = np.where(a >= 0, a, length)
        arrays += [keys.ravel(), query_rows, prefix, ancestors.ravel()]
        padded += b * q
    return arrays, out_rows


def flex_metadata(rows: Sequence[NewRows], key_slots: Sequence[np.ndarray]) -> list[np.ndarray]:
    """FlexAttention's step metadata, int64: every request's needed keys concatenated
    (their slots, request, position), and per new row its request, prefix and ancestors
    as columns of the concatenated keys (padding: -1), [N, depth] flattened."""
    keys = [int(keys_needed(r).max()) for r in rows]
    first_key = np.concatenate([[0], np.cumsum(keys)[:-1]])
    depth = max(1, max(r.ancestors.shape[1] for r in rows))
    ancestors = []
    for r, first in zip(rows, first_key, strict=True):
        a = np.full((r.slots.size, depth), -1, dtype=np.int64)
        a[:, : r.ancestors.shape[1]] = np.where(r.ancestors >= 0, r.ancestors + first, -1)
        ancestors.append(a.ravel())
    return [
        np.concatenate([s[:k] for s, k in zip(key_slots, keys, strict=True)]).astype(np.int64),
        np.repeat(np.arange(len(rows)), keys),
        np.concatenate([np.arange(k) for k in keys]),
        np.repeat(np.arange(len(rows)), [r.slots.size for r in rows]),
        np.concatenate([r.prefix for r in rows]).astype(np.int64),
        np.concatenate(ancestors),
    ]


def _flex_step(tensors: Sequence[torch.Tensor], n: int, depth: int) -> FlexStep:
    slots, key_request, key_position, row_request, prefix, ancestors = tensors
    return build_flex_step(
        slots, key_request, key_position, row_request, prefix, ancestors.view(n, depth)
    )
