"""Attention of one step's rows over their paged keys with FlexAttention: the path for
accelerators (docs/architecture.md, "5. The request controller and its executors",
"The stage engine"; its bullet "Attention on accelerators").

The padded path (`paged_attention`) gathers every request's keys into a batch as long as
the longest and hands SDPA an additive mask with `enable_gqa`; on CUDA that combination
has no fused kernel, so the math kernel runs, repeating K/V to every query head, over
padding. Here all requests' keys are gathered once, concatenated without padding (each
key column tagged with its request, as FlexAttention's document masking does), and one
`flex_attention` call per layer attends every new row with the K/V heads kept grouped
and a block mask in place of a dense one: key column j is visible to new row i iff both
belong to the same request and j is within i's committed prefix or is one of i's tree
ancestors. The block mask is built once per step, for every layer.

Chosen by device (`flex_applies`): CUDA takes this path (compiled, where it compiles),
a CPU the padded one, which is faster there (FlexAttention runs eagerly on a CPU, as an
unfused reference, which is what the tests check it with). `SPECPIPE_ATTENTION=flex` or
`=padded` forces either. A step the memory budget splits into parts keeps the padded
parts, which bound their memory.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import Tensor

ENV = "SPECPIPE_ATTENTION"
CHOICES = ("flex", "padded")


def flex_applies(device: torch.device | str) -> bool:
    """Whether a step on `device` attends through FlexAttention: `SPECPIPE_ATTENTION`
    (flex or padded) when set, else on CUDA only."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced and forced not in CHOICES:
        raise ValueError(f"{ENV}={forced!r}: expected one of {', '.join(CHOICES)}")
    if forced:
        return forced == "flex"
    return torch.device(device).type == "cuda"


@dataclass(frozen=True)
class FlexStep:
    """One step's keys for FlexAttention: all requests' key slots concatenated
    (`key_slots` [K]) and the block mask [1, 1, N, K] of which each new row sees."""

    key_slots: Tensor
    block_mask: Any  # torch.nn.attention.flex_attention.BlockMask


def build_flex_step(
    key_slots: Tensor,
    key_request: Tensor,
    key_position: Tensor,
    row_request: Tensor,
    prefix: Tensor,
    ancestors: Tensor,
) -> FlexStep:
    """The step's block mask from its metadata, on the device: key column j (of request
    `key_request[j]`, at position `key_position[j]` of it) is visible to new row i iff
    `key_request[j] == row_request[i]` and `key_position[j] < prefix[i]`, or j is one of
    `ancestors[i]` (global key columns; padding: -1)."""
    from torch.nn.attention.flex_attention import create_block_mask

    depth = ancestors.shape[1]

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        visible = (key_request[kv] == row_request[q]) & (key_position[kv] < prefix[q])
        for a in range(depth):
            visible = visible | (ancestors[q, a] == kv)
        return visible

    n, k = int(row_request.shape[0]), int(key_slots.shape[0])
    mask = create_block_mask(mask_mod, None, None, n, k, device=key_slots.device)
    return FlexStep(key_slots, mask)


def flex_attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, step: FlexStep, heads: int) -> Tensor:
    """Attention output [N, heads, d] of the new rows `q` [N, heads, d] over the layer's
    K/V `k_cache`, `v_cache` [slots, kv_heads, d]."""
    keys = k_cache.index_select(0, step.key_slots).transpose(0, 1)[None]
    values = v_cache.index_select(0, step.key_slots).transpose(0, 1)[None]
    queries = q.transpose(0, 1)[None]
    out = _flex(q.device.type)(queries, keys, values, block_mask=step.block_mask, enable_gqa=True)
    return out[0].transpose(0, 1)


@cache
def _flex(device_type: str) -> Any:
    """`flex_attention`, compiled on CUDA (unless `SPECPIPE_FLEX_COMPILE=0`), eager
    elsewhere (its unfused reference: what a CPU test runs)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda" and os.environ.get("SPECPIPE_FLEX_COMPILE", "1") != "0":
        return torch.compile(flex_attention, dynamic=True)

    def eager(*args: Any, **kwargs: Any) -> Tensor:
        with warnings.catch_warnings():  # "without torch.compile": known, on purpose
            warnings.simplefilter("ignore", UserWarning)
            return flex_attention(*args, **kwargs)

    return eager
