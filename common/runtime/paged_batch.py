"""What one step's attention needs for every request at once, packed on the host and
sent to the device in one copy.

Each request of a step brings new rows (`kv_cache.NewRows`: their slots, how much of the
request's keys each sees as a prefix, and which tree rows are its ancestors) and the
slots of all its keys. The attention runs as one padded batch of B requests x Q query
rows x L keys (`model.layers.PagedBatch`); this module lays the requests out in it:

- `write_slots` [N]: where each new row's K/V go;
- `key_slots` [B*L]: the slots of request b's keys at b*L.. (padding: slot 0, masked);
- `query_rows` [B*Q]: the new row at each padded query position (padding: row 0);
- `out_rows` [N]: the padded position of each new row;
- `prefix` [B*Q] and `ancestors` [B*Q, D]: the mask, which the device expands to
  [B, 1, Q, L] (key j visible iff j < prefix or j is an ancestor; padded query rows
  see key 0, so no softmax row is empty, and padded keys read slot 0 of the pool,
  which holds finite values: the pool starts as zeros).

All are int64 in one buffer, so a step costs one host-to-device copy and the device
builds the mask with a fixed number of operations, whatever the number of requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from ..model.layers import PagedBatch
from .block_pool import BlockPool
from .kv_cache import NewRows


def tree_mask(
    prefix: Tensor, ancestors: Tensor, shape: tuple[int, int, int], dtype: torch.dtype
) -> Tensor:
    """The additive attention mask [B, 1, Q, L] (0: visible, -inf: not) from a prefix
    length per query row and its ancestor columns (padding: column L, dropped).

    Additive in the model's dtype rather than boolean: SDPA turns a boolean mask into this
    at every call, i.e. at every layer (measured: benchmarks/README.md, "The stage engine")."""
    batch, queries, keys = shape
    cols = torch.arange(keys + 1, device=prefix.device)
    visible = cols[None, :] < prefix[:, None]
    visible.scatter_(1, ancestors, True)
    mask = torch.zeros(visible.shape, dtype=dtype, device=prefix.device)
    mask.masked_fill_(~visible, float("-inf"))
    return mask[:, :keys].reshape(batch, 1, queries, keys)


def pack(
    rows: Sequence[NewRows],
    key_slots: Sequence[np.ndarray],
    pool: BlockPool,
) -> PagedBatch:
    """The batch of `rows[b]` (request b's new rows) over keys `key_slots[b]`, against
    the K/V storage of `pool`."""
    device = pool.device
    counts = np.array([r.slots.size for r in rows])
    lengths = np.array([s.size for s in key_slots])
    b, n = len(rows), int(counts.sum())
    q, length = int(counts.max()), int(lengths.max())
    depth = max(1, max(r.ancestors.shape[1] for r in rows))
    starts = np.arange(b) * q  # padded position of each request's first row
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])  # its first row among the N

    keys = np.zeros((b, length), dtype=np.int64)
    query_rows = np.zeros(b * q, dtype=np.int64)
    prefix = np.ones(b * q, dtype=np.int64)
    ancestors = np.full((b * q, depth), length, dtype=np.int64)
    for i, r in enumerate(rows):
        m, s = counts[i], starts[i]
        keys[i, : lengths[i]] = key_slots[i]
        query_rows[s : s + m] = offsets[i] + np.arange(m)
        prefix[s : s + m] = r.prefix
        a = r.ancestors
        ancestors[s : s + m, : a.shape[1]] = np.where(a >= 0, a, length)
    out_rows = np.repeat(starts, counts) + np.arange(n) - np.repeat(offsets, counts)
    write = np.concatenate([r.slots for r in rows])

    parts = [write, keys.ravel(), query_rows, out_rows, prefix, ancestors.ravel()]
    flat = torch.from_numpy(np.concatenate(parts)).to(device, non_blocking=True)
    write_t, keys_t, query_t, out_t, prefix_t, anc_t = flat.split([p.size for p in parts])
    key_buffer, value_buffer = pool.gather_buffers(b * length)
    return PagedBatch(
        k=pool.k,
        v=pool.v,
        key_buffer=key_buffer,
        value_buffer=value_buffer,
        write_slots=write_t,
        key_slots=keys_t,
        query_rows=query_t,
        out_rows=out_t,
        mask=tree_mask(prefix_t, anc_t.view(b * q, depth), (b, q, length), pool.dtype),
        shape=(b, q, length),
    )
