"""Per-request, per-stage KV cache that holds a committed prefix followed by token-tree rows.

Rows ``[0, n_committed)`` are verified tokens, in order. Rows after them belong to tree
nodes this stage has computed, identified by the router's stable node ids; the cache
also keeps the ancestor mask among those rows, so a new node's attention mask is its
parent's row plus its own bit (docs/architecture.md, "2. Token tree"). Commit and prune
are index operations on tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import BadInput, CacheFull


class TreeKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.n_committed = 0
        self.tree_ids = torch.empty(0, dtype=torch.int64)
        self.tree_mask = torch.empty(0, 0, dtype=torch.bool)
        self._committed_ids: set[int] = set()

    @property
    def num_tree_rows(self) -> int:
        return int(self.tree_ids.numel())

    @property
    def length(self) -> int:
        return self.n_committed + self.num_tree_rows

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def _check_room(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise CacheFull(f"KV cache full: {self.length} + {n} rows > capacity {self.capacity}")

    # -- growing -----------------------------------------------------------------------
    def append_committed(self, n: int) -> tuple[int, Tensor]:
        """Reserve `n` rows of verified tokens (a prefill chunk); returns (start row, mask)."""
        if self.num_tree_rows:
            raise BadInput("committed rows can only be appended while no tree rows are cached")
        self._check_room(n)
        start = self.n_committed
        causal = torch.ones(n, n, dtype=torch.bool).tril_()
        mask = torch.cat([torch.ones(n, start, dtype=torch.bool), causal], dim=1)
        self.n_committed += n
        return start, mask

    def append_nodes(self, node_ids: Tensor, parent_ids: Tensor) -> tuple[int, Tensor]:
        """Add tree nodes (BFS order); returns (start row, attention mask [n, length]).

        A parent is a cached tree row, an earlier node of this batch, or a committed token
        (then the node attends to the committed prefix only, which includes its parent).
        """
        n = int(node_ids.numel())
        self._check_room(n)
        t0 = self.num_tree_rows
        all_ids = torch.cat([self.tree_ids, node_ids])
        if torch.unique(all_ids).numel() != all_ids.numel():
            raise BadInput("duplicate tree node ids")
        match = parent_ids[:, None] == all_ids[None, :]
        has_parent = match.any(dim=1)
        pidx = match.to(torch.int8).argmax(dim=1)
        if bool((has_parent & (pidx >= t0 + torch.arange(n))).any()):
            raise BadInput("tree nodes must come after their parent (BFS order)")
        orphans = parent_ids[~has_parent].tolist()
        unknown = [p for p in orphans if p != -1 and p not in self._committed_ids]
        if unknown:
            raise BadInput(f"parent node ids {unknown[:4]} are neither cached nor committed")

        rows = torch.zeros(n, t0 + n, dtype=torch.bool)
        rows[torch.arange(n), t0 + torch.arange(n)] = True
        in_cache = has_parent & (pidx < t0)
        rows[in_cache, :t0] = self.tree_mask[pidx[in_cache]]
        # Parents inside the batch: resolve level by level (one iteration per tree depth).
        pending = has_parent & (pidx >= t0)
        while bool(pending.any()):
            ready = pending.clone()
            ready[pending] = ~pending[pidx[pending] - t0]
            rows[ready] |= rows[pidx[ready] - t0]
            pending &= ~ready

        mask = torch.zeros(t0 + n, t0 + n, dtype=torch.bool)
        mask[:t0, :t0] = self.tree_mask
        mask[t0:] = rows
        self.tree_mask = mask
        self.tree_ids = all_ids
        start = self.length - n
        attn = torch.cat([torch.ones(n, self.n_committed, dtype=torch.bool), rows], dim=1)
        return start, attn

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new rows' K/V [heads, n, d] for a layer; return K/V over all rows up to them."""
        end = start + k.shape[1]
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    # -- shrinking ---------------------------------------------------------------------
    def prune(self, commit_ids: Tensor, keep_ids: Tensor, horizon: int | None = None) -> None:
        """Commit verified nodes (in order); of the other tree rows with ids up to `horizon`
        (default: all), keep only `keep_ids`."""
        commit_rows = self._rows_of(commit_ids)
        committed = torch.isin(self.tree_ids, commit_ids)
        keep = torch.isin(self.tree_ids, keep_ids)
        if horizon is not None:
            keep |= self.tree_ids > horizon
        # A node survives only if every tree ancestor survives or is being committed.
        ok = keep | committed
        keep &= ~committed & ~(self.tree_mask & ~ok[None, :]).any(dim=1)
        keep_rows = keep.nonzero().squeeze(1)
        order = torch.cat([commit_rows, keep_rows])
        nc = self.n_committed
        src = (nc + order).to(self.k.device)  # row bookkeeping is on the CPU, K/V may not be
        dst = slice(nc, nc + order.numel())
        self.k[:, :, dst] = self.k.index_select(2, src)
        self.v[:, :, dst] = self.v.index_select(2, src)
        self.tree_ids = self.tree_ids[keep_rows]
        self.tree_mask = self.tree_mask[keep_rows][:, keep_rows]
        self.n_committed += commit_rows.numel()
        self._committed_ids.update(commit_ids.tolist())

    def _rows_of(self, node_ids: Tensor) -> Tensor:
        if node_ids.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        match = node_ids[:, None] == self.tree_ids[None, :]
        found = match.any(dim=1)
        if not bool(found.all()):
            missing = node_ids[~found].tolist()
            raise BadInput(f"cannot commit node ids {missing[:4]}: not cached at this stage")
        return match.to(torch.int8).argmax(dim=1)
