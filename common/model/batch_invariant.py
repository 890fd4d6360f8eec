"""Batch-invariant rows for a half-precision model: a row's bits do not depend on which
other rows share its step, so speculative verification (a tree's rows in one batch)
computes what plain decoding (one row a step) does, to the bit, and every mode's greedy
tokens equal plain decoding's in the served dtype, not only in fp32/fp64 where rounding
noise sits far below any logit gap.

Where a bf16 row's bits depend on its batch on a CPU (found op by op on Qwen2.5-1.5B;
figures: benchmarks/README.md, "Batch-invariant bf16 verification"), and the remedy:

- oneDNN's bf16 GEMM (packed or `F.linear`) picks its kernel by the row count M: every
  call of 2 to 32 rows gives each row the same bits whatever the other rows are, one
  row alone can differ (Qwen2.5-1.5B's down projection, K = 8960), and over 32 rows
  every shape tried with K >= 512 differs. `RowInvariantLinear` calls its linear in chunks of 2 to 32
  rows, a lone row padded to two (`MIN_ROWS`, `MAX_ROWS`; `linear_rows_invariant`
  checks a layer against them).
- SDPA (torch's CPU flash kernel) gives a query row other bits when the call holds
  other query rows (Q > 1: its GEMMs over a query block), when its keys sit in other
  columns (a tree's siblings interleaved with its ancestors) and when the key count's
  tail differs (the vectorized softmax's remainder). `attend_rows` gives each tree row
  a call row of its own (Q = 1) over just its visible keys in position order (the
  committed prefix, then its ancestors, itself last), padded with masked keys to a
  multiple of `KEY_ALIGN`: the layout a lone row of plain decoding has, whatever the
  tree or the batch.
- RMSNorm, RoPE, the activation and the residual adds are per row already.

Not covered: a prefill chunk's rows keep one call over their keys (a per-row layout
would gather keys rows x context times), so a committed row's bits depend on how its
prompt was chunked and batched; plain decoding and speculation prefill alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernel_checks
from .packed_linear import PackedLinear

if TYPE_CHECKING:
    from .layers import StageModel
    from .paged_attention import PagedBatch, StepAttention

# Rows per GEMM call whose bits are the same whatever the call's row count (torch 2.13's
# oneDNN, bf16, measured on AMX cores; `linear_rows_invariant` checks it for a layer).
MIN_ROWS, MAX_ROWS = 2, 32
# Keys per row call padded to a multiple of this: the flash kernel's softmax handles a
# 16-float vector tail apart, so a padded row sums its keys in one order at any length.
KEY_ALIGN = 32
# Gathered keys and values of one row call at most (rows are independent: a step with
# more runs in several calls).
ROW_CALL_BYTES = 64 << 20


def invariance_applies(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a model of `dtype` on `device` is made batch-invariant by default: half
    precision on a CPU (fp32 and fp64 batches differ by noise far below any logit gap;
    other devices' kernels are not measured)."""
    return dtype in (torch.bfloat16, torch.float16) and torch.device(device).type == "cpu"


class StepRows:
    """Which of a model's current step's rows are tree rows, set by `step_attention` for
    every batched step (`note`), so that its decoder layers' linears keep a prefill
    chunk's rows in one call: a step of more than `MAX_ROWS` rows that holds prefill rows
    is computed in one call, and its tree rows again in chunks over that (chunking a
    512-row prefill would read every weight 16 times). One per model, written by each
    step: a model's forwards run one at a time (a stage's compute thread), never two
    concurrently."""

    def __init__(self) -> None:
        self.count = -1  # the step's rows
        self.tree: Tensor | None = None  # its tree rows; None: every row is one

    def note(self, plan: RowAttention | None, count: int) -> None:
        self.count = count
        if plan is None:  # no tree rows
            self.tree = torch.empty(0, dtype=torch.int64)
        else:
            self.tree = None if plan.every_row else plan.rows


class RowInvariantLinear(nn.Module):
    """A linear layer called in chunks of `MIN_ROWS` to `MAX_ROWS` rows, so that each
    row's bits do not depend on the others: a single row is padded with a zero row, more
    than `MAX_ROWS` are split into balanced chunks (each at least `MAX_ROWS / 2` rows).
    With `step` (a decoder layer's linears), a step's prefill rows in one call instead."""

    def __init__(self, inner: nn.Module, step: StepRows | None = None) -> None:
        super().__init__()
        self.inner, self.step = inner, step
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: Tensor) -> Tensor:
        n, step = x.shape[0], self.step
        if n <= MAX_ROWS or step is None or step.count != n or step.tree is None:
            return self.alone(x)
        out = self.inner.forward(x)
        if step.tree.numel():
            out.index_copy_(0, step.tree, self.alone(x.index_select(0, step.tree)))
        return out

    def alone(self, x: Tensor) -> Tensor:
        """Every row of `x` with the bits it has alone."""
        inner, n = self.inner, x.shape[0]
        if MIN_ROWS <= n <= MAX_ROWS or n == 0:
            return inner.forward(x)
        if n < MIN_ROWS:
            return inner.forward(F.pad(x, (0, 0, 0, MIN_ROWS - n)))[:n]
        chunks = -(-n // MAX_ROWS)
        return torch.cat([inner.forward(c) for c in x.tensor_split(chunks)])


def make_batch_invariant(model: StageModel) -> int:
    """Make `model`'s rows batch-invariant in place: every linear (plain or packed) called
    through `RowInvariantLinear`, tree rows attending alone (`attend_rows`); returns how
    many linears were wrapped."""
    step = StepRows()
    targets = [
        (parent, name, child)
        for parent in model.modules()
        if not isinstance(parent, RowInvariantLinear)
        for name, child in parent.named_children()
        if type(child) in (nn.Linear, PackedLinear)
    ]
    for parent, name, child in targets:
        # the head computes the rows it is given (a verifier's), whatever the step was
        setattr(parent, name, RowInvariantLinear(child, None if child is model.lm_head else step))
    model.rows_alone = step
    return len(targets)


def _weight(layer: nn.Module) -> Tensor:
    """A linear's weight, plain (`nn.Linear`) or packed (`PackedLinear`'s buffer)."""
    return next(t for t in (*layer.parameters(), *layer.buffers()) if t.is_floating_point())


# (layer kind, in, out, dtype, device, threads) -> whether its kernel keeps rows invariant
_kernels_checked: dict[tuple, bool] = {}


def kernels_row_invariant(model: StageModel) -> bool:
    """Whether every linear shape of `model` keeps a row's bits in calls of `MIN_ROWS` to
    `MAX_ROWS` rows on this machine (`linear_rows_invariant`, once per shape and machine:
    `kernel_checks`):
    `MIN_ROWS`/`MAX_ROWS` were measured on one CPU's oneDNN, and another kernel may not
    keep them."""
    for layer in model.modules():
        if type(layer) not in (nn.Linear, PackedLinear):
            continue
        weight = _weight(layer)
        key = (
            type(layer),
            layer.in_features,
            layer.out_features,
            weight.dtype,
            weight.device,
            torch.get_num_threads(),
        )
        if key not in _kernels_checked:
            _kernels_checked[key] = _check_shape(layer, weight)
        if not _kernels_checked[key]:
            return False
    return True


def _check_shape(layer: nn.Module, weight: Tensor) -> bool:
    """`linear_rows_invariant` for `layer`'s shape, from this machine's record
    (`kernel_checks`) when it holds the answer: per thread count (a kernel may split its
    reduction by threads) and, on a GPU, per card and CUDA build."""
    device = weight.device.type
    if device == "cuda":
        device += f" {torch.cuda.get_device_name(weight.device)} cuda {torch.version.cuda}"
    check = (
        f"rows {MIN_ROWS}-{MAX_ROWS} {type(layer).__name__} {layer.in_features}x"
        f"{layer.out_features} {weight.dtype} {device} threads {torch.get_num_threads()}"
    )
    answer = kernel_checks.recorded(check)
    if answer is None:
        rows = MAX_ROWS + 1 if layer.out_features > 16384 else 3 * MAX_ROWS  # a big head
        answer = linear_rows_invariant(layer, rows)
        kernel_checks.record(check, answer)
    return answer


def linear_rows_invariant(layer: nn.Module, rows: int = 3 * MAX_ROWS) -> bool:
    """Whether `layer` gives a row the same bits in every call of `MIN_ROWS` to `MAX_ROWS`
    rows and (padded) alone, on random rows: what `RowInvariantLinear` relies on. A
    kernel that reduces in another order rounds a few percent of random rows otherwise."""
    if isinstance(layer, RowInvariantLinear):
        layer = layer.inner
    weight = _weight(layer)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, layer.in_features, generator=gen) * 3 * torch.rand(rows, 1, generator=gen)
    x = x.to(weight.dtype).to(weight.device)
    with torch.inference_mode():
        want = torch.cat([layer.forward(c) for c in x.split(MIN_ROWS)])
        for m in sorted({1, 3, MAX_ROWS // 2 + 1, MAX_ROWS}):
            for c, w in zip(x.split(m), want.split(m), strict=True):
                short = MIN_ROWS - len(c)
                got = layer.forward(c) if short <= 0 else layer.forward(F.pad(c, (0, 0, 0, short)))
                if not torch.equal(got[: len(c)], w):
                    return False
    return True


@dataclass(frozen=True)
class RowAttention:
    """A step's tree rows, each attending alone (`attend_rows`), made once per step.

    `rows` [T]: the new rows that do (tree rows; a prefill chunk's rows do not);
    `key_slots` [T * L]: row t's visible keys in position order at t * L, then padding
    (the slot of its first key, masked); `mask` [T, 1, 1, L]: 0 for its keys, -inf for
    the padding; `every_row`: whether they are all of the step's new rows. Where the
    rows fit one call (`ROW_CALL_BYTES`), the buffers every layer gathers into and their
    views in SDPA's layout: `keys`, `values` [T, kv_heads, L, d], `queries` [T, heads,
    1, d]; None: calls of `rows_per_call` rows gather their own."""

    rows: Tensor
    key_slots: Tensor
    mask: Tensor
    every_row: bool
    rows_per_call: int
    buffers: tuple[Tensor, Tensor, Tensor] | None = None  # keys, values, queries
    keys: Tensor | None = None
    values: Tensor | None = None
    queries: Tensor | None = None


def row_attention(batch: PagedBatch, heads: int) -> RowAttention | None:
    """The tree rows of `batch` laid out one per call row (None: it has none), from its
    attention parts' arrays: new row i is at padded position `out_rows[i]` of the parts'
    concatenated query rows; its keys are its group's first `prefix` keys, then the key
    columns in its `ancestors` row (ascending, padded with the part's L).

    Planned on the host, where the arrays were made (on a CPU reading them is free; an
    accelerator's step waits for their copy back, once)."""
    parts = batch.parts
    depth = max(int(p.ancestors.shape[1]) for p in parts)
    bases, prefixes, ancestors, lengths, slots = [], [], [], [], []
    first_key = 0
    for p in parts:
        b, q, length = p.shape
        bases.append(first_key + np.arange(b * q) // q * length)
        prefixes.append(_host(p.prefix))
        anc = _host(p.ancestors)
        ancestors.append(np.pad(anc, ((0, 0), (0, depth - anc.shape[1])), constant_values=length))
        lengths.append(np.full(b * q, length))
        slots.append(_host(p.key_slots))
        first_key += b * length
    at = _host(batch.out_rows)
    anc, length = np.concatenate(ancestors)[at], np.concatenate(lengths)[at, None]
    tree = (anc < length).any(axis=1)
    rows = np.flatnonzero(tree)
    if rows.size == 0:
        return None
    at, anc, length = at[rows], anc[rows], length[rows]
    prefix = np.concatenate(prefixes)[at, None]
    count = prefix + (anc < length).sum(axis=1, keepdims=True)
    width = -(-int(count.max()) // KEY_ALIGN) * KEY_ALIGN
    j = np.arange(width)[None]
    column = np.where(j < prefix, j, np.take_along_axis(anc, np.clip(j - prefix, 0, depth - 1), 1))
    visible = j < count
    column[~visible] = 0
    key_slots = np.concatenate(slots)[np.concatenate(bases)[at, None] + column]
    t, pool = int(rows.size), batch.k
    kv_heads, d = pool.shape[2], pool.shape[3]
    mask = torch.zeros((t, 1, 1, width), dtype=pool.dtype, device=pool.device)
    hidden = torch.from_numpy(~visible).to(pool.device).view(t, 1, 1, width)
    mask.masked_fill_(hidden, float("-inf"))
    plan = RowAttention(
        torch.from_numpy(rows).to(pool.device),
        torch.from_numpy(key_slots.ravel()).to(pool.device),
        mask,
        every_row=bool(tree.all()),
        rows_per_call=max(1, ROW_CALL_BYTES // (2 * width * kv_heads * d * pool.element_size())),
    )
    if t > plan.rows_per_call:
        return plan
    keys, values = (pool.new_empty((t * width, kv_heads, d)) for _ in range(2))
    queries = pool.new_empty((t, heads, d))
    return replace(
        plan,
        buffers=(keys, values, queries),
        keys=keys.view(t, width, kv_heads, d).transpose(1, 2),
        values=values.view(t, width, kv_heads, d).transpose(1, 2),
        queries=queries[:, :, None],
    )


def _host(t: Tensor) -> np.ndarray:
    """A step array as numpy (a CPU tensor's own memory)."""
    return (t if t.device.type == "cpu" else t.cpu()).numpy()


def attend_alone(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: RowAttention) -> Tensor:
    """Attention output [T, heads * d] of the plan's rows of `q` [N, heads, d], each its
    own query over its own keys (`RowAttention`)."""
    t, width = plan.mask.shape[0], plan.mask.shape[-1]
    heads, d = q.shape[1], q.shape[2]
    if plan.buffers is not None:  # one call, into the step's buffers
        keys, values, queries = plan.buffers
        torch.index_select(k_cache, 0, plan.key_slots, out=keys)
        torch.index_select(v_cache, 0, plan.key_slots, out=values)
        torch.index_select(q, 0, plan.rows, out=queries)
        out = F.scaled_dot_product_attention(
            plan.queries, plan.keys, plan.values, attn_mask=plan.mask, enable_gqa=True
        )
        return out.reshape(t, heads * d)
    kv_heads, outs = k_cache.shape[1], []
    for s in range(0, t, plan.rows_per_call):
        e = min(t, s + plan.rows_per_call)
        slots = plan.key_slots[s * width : e * width]
        keys = k_cache.index_select(0, slots).view(e - s, width, kv_heads, d).transpose(1, 2)
        values = v_cache.index_select(0, slots).view(e - s, width, kv_heads, d).transpose(1, 2)
        queries = q.index_select(0, plan.rows[s:e])[:, :, None]
        outs.append(
            F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=plan.mask[s:e], enable_gqa=True
            )
        )
    return torch.cat(outs).reshape(t, heads * d)


def attend_rows(q: Tensor, step: StepAttention, layer: int, attend) -> Tensor:
    """Attention output [N, heads * d] of the step's new rows `q` [N, heads, d] at `layer`
    with its tree rows attending alone (`step.rows`); the other rows through `attend`
    (`paged_attention.attend`), the step's usual path."""
    plan = step.rows
    assert plan is not None
    k, v = step.k[layer], step.v[layer]
    alone = attend_alone(q, k, v, plan)
    if plan.every_row:
        return alone
    out = attend(q, k, v, step.batch, q.shape[1])
    return out.index_copy(0, plan.rows, alone)
