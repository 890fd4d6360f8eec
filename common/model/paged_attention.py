"""Attention of one step's rows of every request over their paged keys, in parts that
each fit the step's memory budget (docs/architecture.md, "5. The request controller and
its executors", "Bounded memory per step").

A step's query rows are laid out as padded parts (`AttentionPart`): B query groups x Q
rows over L keys each (a query group: a request's new rows, or a block of them where
its rows x context is too large for one call). A part runs as one SDPA call with an
additive mask, as a whole step did before; a part whose keys alone are too many for the
budget runs in key blocks, each block's softmax merged into the others' by its
log-sum-exp (the online softmax of FlashAttention), so no call holds more than a block
of scores. The planner (`runtime.paged_batch.pack`) decides the parts; this module only
computes them. A step of one part prebuilds its mask once for every layer (what most
steps are); several parts build theirs per layer, so only one is alive at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .batch_invariant import RowAttention, StepRows, attend_rows, row_attention
from .flex_attention import FlexStep, flex_attend

# AttentionPart, PagedBatch and StepAttention are made for every step, so they are
# dataclasses with slots, read only by convention rather than frozen: a frozen
# dataclass's __init__ sets each field through object.__setattr__, about 5 us an
# instance on a CPU (measured: benchmarks/README.md, "Session 44: the forward"), against
# 1 us; eq=False: compared by identity (their tensors have no truth value anyway).


@dataclass(slots=True, eq=False)  # made per step (see above)
class AttentionPart:
    """B query groups x Q query rows over L keys, in key blocks of `key_block` keys.

    Query position p holds new row `query_rows[p]`; group b's keys are the slots
    `key_slots[b*L:(b+1)*L]` (padding: slot 0, masked); each query row sees key j iff
    j < `prefix[p]` or j is one of `ancestors[p]` (padding: L). `mask`: the additive
    mask [B, 1, Q, L], prebuilt (a step of one part in one block) or None (built per
    layer and block)."""

    key_slots: Tensor
    query_rows: Tensor
    prefix: Tensor
    ancestors: Tensor
    shape: tuple[int, int, int]  # B, Q, L
    key_block: int
    mask: Tensor | None = None

    @property
    def blocked(self) -> bool:
        return self.key_block < self.shape[2]


@dataclass(slots=True, eq=False)  # made per step (see above)
class PagedBatch:
    """One step's rows of every request, for attention over the paged KV cache.

    K/V live in `kv` [layers, slots, 2 * kv_heads, head_dim] (a stage's block pool: a
    slot's K heads, then its V heads; `k`, `v` are views of the halves). The N new rows
    write their K and V to `write_slots` [N] in one operation per layer. Attention runs as
    `parts`, whose padded outputs are concatenated in order; new row i's output is at
    `out_rows[i]`. `kv_buffer` [rows, 2 * kv_heads, head_dim]: room for the largest part's
    gathered K/V rows (reused by every layer; `key_buffer`, `value_buffer`: its memory as
    two K and V buffers, for parts gathered apart). `flex`: where set (`flex_attention`:
    an accelerator's step of one part), attention runs through it instead of `parts`, and
    new row i's output is row i. `runtime.paged_batch.pack` builds one from the requests'
    block tables."""

    kv: Tensor
    k: Tensor
    v: Tensor
    kv_buffer: Tensor
    write_slots: Tensor
    parts: tuple[AttentionPart, ...]
    out_rows: Tensor
    flex: FlexStep | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """The first part's (B, Q, L): the whole step's when it is one part."""
        return self.parts[0].shape

    @property
    def key_buffer(self) -> Tensor:
        """The first half of `kv_buffer`'s memory as [rows, kv_heads, head_dim]."""
        return self._half(0)

    @property
    def value_buffer(self) -> Tensor:
        return self._half(1)

    def _half(self, i: int) -> Tensor:
        rows, heads, d = self.kv_buffer.shape
        n = rows * heads * d // 2
        return self.kv_buffer.view(-1)[i * n : (i + 1) * n].view(rows, heads // 2, d)


def tree_mask(
    prefix: Tensor,
    ancestors: Tensor,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    start: int | None = None,
) -> Tensor:
    """The additive attention mask [B, 1, Q, n] (0: visible, -inf: not) of keys
    [start, start + n) (n = shape's L; `start` None: 0, and the ancestors padded with n),
    from a prefix length per query row and its ancestor columns (those outside the keys
    are dropped).

    Additive in the model's dtype rather than boolean: SDPA turns a boolean mask into this
    at every call, i.e. at every layer (measured: benchmarks/README.md, "The stage engine")."""
    batch, queries, keys = shape
    first = start or 0
    cols = torch.arange(first, first + keys + 1, device=prefix.device)
    visible = torch.lt(cols, prefix.unsqueeze(1))  # [B*Q, keys + 1]
    if start is not None:  # a key block: ancestors outside it go to the dropped column
        at = ancestors - start
        ancestors = torch.where((at >= 0) & (at < keys), at, keys)
    visible.scatter_(1, ancestors, True)
    mask = torch.full(visible.shape, float("-inf"), dtype=dtype, device=prefix.device)
    mask.masked_fill_(visible, 0.0)
    return mask[:, :keys].reshape(batch, 1, queries, keys)


@dataclass(slots=True, eq=False)  # made per step (see above)
class StepAttention:
    """What every layer of one step attends with, made once per step (`step_attention`)
    rather than once per layer: each layer's K/V cache views (`kv`, which the layer's new
    rows are written to; `k`, `v` where a path reads K and V apart: empty for a step of
    one padded part), and for a step of one padded part the gather buffer's views in
    SDPA's layout and a buffer for the queries, so that a layer issues only its K/V write,
    its one gather and its SDPA call. A part without
    padding (`unpadded`: every query group full, so padded position p is new row p and
    output row i is padded row i: one request, or requests of as many rows each) needs
    no buffer: the queries are a view of the layer's own and the output is in order."""

    batch: PagedBatch
    kv: tuple[Tensor, ...]  # layer i's K/V cache [slots, 2 * kv_heads, d]
    k: tuple[Tensor, ...]  # layer i's K cache [slots, kv_heads, d] (a view of kv's)
    v: tuple[Tensor, ...]
    keys: Tensor | None = None  # [B, kv_heads, L, d]: views of the gather buffer
    values: Tensor | None = None
    query_buffer: Tensor | None = None  # [B*Q, heads, d]; None when unpadded
    queries: Tensor | None = None  # [B, heads, Q, d]: a view of query_buffer
    unpadded: bool = False
    rows: RowAttention | None = None  # tree rows attending alone (batch_invariant.py)


def step_attention(
    batch: PagedBatch, heads: int, rows_alone: StepRows | None = None
) -> StepAttention:
    """`batch`'s per-step views (see `StepAttention`); `rows_alone`: its tree rows attend
    one by one, batch-invariant (`batch_invariant.row_attention`), noted there."""
    kv = batch.kv.unbind(0)
    rows = row_attention(batch, heads) if rows_alone else None
    if rows_alone:
        rows_alone.note(rows, batch.out_rows.numel())
    one = batch.flex is None and len(batch.parts) == 1 and not batch.parts[0].blocked
    if rows is not None or not one or batch.parts[0].mask is None:
        return StepAttention(batch, kv, batch.k.unbind(0), batch.v.unbind(0), rows=rows)
    b, nq, length = batch.parts[0].shape
    kv_heads, d = batch.k.shape[2], batch.k.shape[3]
    # K and V gathered together (one index_select a layer), seen as SDPA's two inputs
    keys, values = batch.kv_buffer.view(b, length, 2 * kv_heads, d).split_with_sizes(
        (kv_heads, kv_heads), 2
    )
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    # one part of whole requests in order (`runtime.paged_batch.pack`): with no padded
    # position, its query rows and output rows are both 0..N-1
    if b * nq == batch.write_slots.shape[0]:
        return StepAttention(batch, kv, (), (), keys, values, unpadded=True)
    query_buffer = batch.k.new_empty((b * nq, heads, d))
    return StepAttention(
        batch,
        kv,
        (),
        (),
        keys=keys,
        values=values,
        query_buffer=query_buffer,
        queries=query_buffer.view(b, nq, heads, d).transpose(1, 2),
    )


def attend_layer(q: Tensor, step: StepAttention, layer: int) -> Tensor:
    """Attention output [N, heads * d] of the step's new rows `q` [N, heads, d] at
    `layer` (the new rows' K/V written)."""
    if step.rows is not None:
        return attend_rows(q, step, layer, attend)
    if step.keys is None:
        return attend(q, step.k[layer], step.v[layer], step.batch, q.shape[1])
    part = step.batch.parts[0]
    torch.index_select(step.kv[layer], 0, part.key_slots, out=step.batch.kv_buffer)
    b, nq, _ = part.shape
    if step.unpadded:
        queries = q.view(b, nq, q.shape[1], q.shape[2]).transpose(1, 2)
    else:
        torch.index_select(q, 0, part.query_rows, out=step.query_buffer)
        queries = step.queries
    out = F.scaled_dot_product_attention(
        queries, step.keys, step.values, attn_mask=part.mask, enable_gqa=True
    )  # [B, heads, Q, d]
    out = out.transpose(1, 2).reshape(-1, q.shape[1] * q.shape[2])
    return out if step.unpadded else out.index_select(0, step.batch.out_rows)


def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, batch: PagedBatch, heads: int) -> Tensor:
    """Attention output [N, heads * d] of the step's new rows `q` [N, heads, d] over the
    layer's K/V `k_cache`, `v_cache` [slots, kv_heads, d] (the new rows' written)."""
    d = q.shape[-1]
    if batch.flex is not None:
        return flex_attend(q, k_cache, v_cache, batch.flex, heads).reshape(-1, heads * d)
    if len(batch.parts) == 1 and not batch.parts[0].blocked:
        part = batch.parts[0]
        out = _part(q, k_cache, v_cache, part, heads, batch.key_buffer, batch.value_buffer)
    else:
        outs = []
        for part in batch.parts:
            if part.blocked:
                outs.append(_blocked_part(q, k_cache, v_cache, part, heads))
            else:
                b, _, length = part.shape
                kb, vb = batch.key_buffer[: b * length], batch.value_buffer[: b * length]
                outs.append(_part(q, k_cache, v_cache, part, heads, kb, vb))
        out = torch.cat(outs)
    return out.reshape(-1, heads * d).index_select(0, batch.out_rows)


def _part(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    part: AttentionPart,
    heads: int,
    key_buffer: Tensor,
    value_buffer: Tensor,
) -> Tensor:
    """One padded SDPA call over the part's whole keys: [B*Q, heads, d]."""
    b, nq, length = part.shape
    kv_heads, d = k_cache.shape[1], k_cache.shape[2]
    keys = torch.index_select(k_cache, 0, part.key_slots, out=key_buffer)
    values = torch.index_select(v_cache, 0, part.key_slots, out=value_buffer)
    keys, values = keys.view(b, length, kv_heads, d), values.view(b, length, kv_heads, d)
    queries = q.index_select(0, part.query_rows).view(b, nq, heads, d)
    mask = part.mask
    if mask is None:
        mask = tree_mask(part.prefix, part.ancestors, part.shape, q.dtype)
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        enable_gqa=True,
    )  # [B, heads, Q, d]
    return out.transpose(1, 2).reshape(b * nq, heads, d)


def _blocked_part(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, part: AttentionPart, heads: int
) -> Tensor:
    """The part's attention in key blocks, merged by log-sum-exp: [B*Q, heads, d].

    Per block: scores of every query row against the block's keys, their maximum and
    exponentials; the running output and sum are rescaled to the new maximum. Equal to
    one softmax over all keys (exactly so in exact arithmetic; to rounding in floats)."""
    b, nq, length = part.shape
    kv_heads, d = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    # [B, kv_heads, group * Q, d]: the query heads that share a K/V head, side by side
    queries = q.index_select(0, part.query_rows).view(b, nq, kv_heads, group, d)
    queries = queries.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * nq, d)
    queries = queries * (1.0 / d**0.5)
    slots = part.key_slots.view(b, length)
    top = torch.full((b, kv_heads, group * nq, 1), float("-inf"), dtype=q.dtype, device=q.device)
    total = torch.zeros_like(top)
    acc = torch.zeros((b, kv_heads, group * nq, d), dtype=q.dtype, device=q.device)
    for start in range(0, length, part.key_block):
        n = min(part.key_block, length - start)
        block = slots[:, start : start + n].reshape(-1)
        keys = k_cache.index_select(0, block).view(b, n, kv_heads, d).permute(0, 2, 3, 1)
        values = v_cache.index_select(0, block).view(b, n, kv_heads, d).transpose(1, 2)
        mask = tree_mask(part.prefix, part.ancestors, (b, nq, n), q.dtype, start)
        scores = torch.matmul(queries, keys).view(b, kv_heads, group, nq, n)
        scores = (scores + mask.view(b, 1, 1, nq, n)).view(b, kv_heads, group * nq, n)
        new_top = torch.maximum(top, scores.amax(dim=-1, keepdim=True))
        # rows that have seen no key yet keep 0 (not -inf - -inf)
        shift = torch.where(torch.isinf(new_top), torch.zeros_like(new_top), new_top)
        weights = torch.exp(scores - shift)
        rescale = torch.exp(top - shift)
        total = total * rescale + weights.sum(dim=-1, keepdim=True)
        acc = acc * rescale + torch.matmul(weights, values)
        top = new_top
    out = (acc / total).view(b, kv_heads, group, nq, d)
    return out.permute(0, 3, 1, 2, 4).reshape(b * nq, heads, d)
