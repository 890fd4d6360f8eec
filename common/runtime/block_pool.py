"""The KV block pool of one stage (or the draft): fixed-size blocks of K/V rows for all
of the stage's layers, shared by every request it holds.

A request owns a list of blocks (its block table, `kv_cache.TreeKVCache`); a row of a
request lives in one *slot* (block * block_size + offset). K and V are one tensor each,
[layers, slots, kv_heads, head_dim], so a step writes the new rows of all its requests
with one `index_copy_` per layer and reads any request's rows by gathering slots. As in
vLLM's paged attention, memory is taken as rows arrive, not reserved for what a request
might reach, and given back block by block.

Blocks are handed out and taken back on the host (a free list); the device only sees
slot indices. The storage grows geometrically up to the budget as blocks are first used
(a CPU stage does not hold a budget of zeros it never touches); a block's id never
changes, so growing copies the tensor once and leaves every table valid.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .errors import CacheFull

BLOCK_SIZE = 16  # rows per block (vLLM's default on GPUs)
_MIN_STORAGE_BLOCKS = 16


class BlockPool:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_bytes: int,
        block_size: int = BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.row_shape = (num_kv_heads, head_dim)
        self.num_layers, self.dtype, self.device = num_layers, dtype, torch.device(device)
        self.block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize
        self.max_blocks = max_bytes // self.block_bytes
        self._stored = 0  # blocks the storage tensors hold
        self._free: list[int] = []  # stored blocks nobody holds
        self.k = self._zeros(0)
        self.v = self._zeros(0)
        self._gather = torch.empty(2, 0, *self.row_shape, dtype=dtype, device=self.device)

    def _zeros(self, blocks: int) -> Tensor:
        # Zeros, not empty: a padded gather reads slots it masks out, and garbage there
        # could be NaN (0 * NaN is NaN after the softmax).
        shape = (self.num_layers, blocks * self.block_size, *self.row_shape)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # -- accounting --------------------------------------------------------------------
    def set_budget(self, max_bytes: int) -> None:
        """A new budget; blocks already held stay held (the pool shrinks as they are freed)."""
        self.max_blocks = max_bytes // self.block_bytes

    @property
    def used_blocks(self) -> int:
        return self._stored - len(self._free)

    @property
    def free_blocks(self) -> int:
        return max(0, self.max_blocks - self.used_blocks)

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_bytes

    def blocks_for(self, rows: int) -> int:
        return -(-rows // self.block_size)

    # -- blocks ------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """`n` free blocks; CacheFull (nothing taken) when the budget has fewer."""
        if n <= 0:
            return []
        if n > self.free_blocks:
            raise CacheFull(
                f"KV cache pool exhausted: {n} more blocks of {self.block_size} rows needed, "
                f"{self.free_blocks} of {self.max_blocks} free"
            )
        if n > len(self._free):
            self._grow(self._stored + n - len(self._free))
        taken, self._free = self._free[-n:], self._free[:-n]
        return taken[::-1]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def reserve(self, blocks: int) -> None:
        """Store room for `blocks` blocks now (at most the budget), so no step has to grow
        the storage (a device that should hold its whole budget from the start)."""
        blocks = min(blocks, self.max_blocks)
        if blocks > self._stored:
            self._grow(blocks)

    def _grow(self, need: int) -> None:
        blocks = min(max(need, 2 * self._stored, _MIN_STORAGE_BLOCKS), max(need, self.max_blocks))
        k, v = self._zeros(blocks), self._zeros(blocks)
        rows = self._stored * self.block_size
        k[:, :rows], v[:, :rows] = self.k, self.v
        self.k, self.v = k, v
        # Lowest ids on top of the stack: a request's blocks tend to be adjacent.
        self._free = list(range(blocks - 1, self._stored - 1, -1)) + self._free
        self._stored = blocks

    def gather_buffers(self, rows: int) -> tuple[Tensor, Tensor]:
        """Room for `rows` gathered K and V rows, kept between steps: a step's attention
        gathers every request's keys into them, layer after layer, instead of allocating
        (and, on a CPU, page-faulting) two fresh tensors per layer."""
        if self._gather.shape[1] < rows:
            self._gather = torch.empty(
                2,
                max(rows, 2 * self._gather.shape[1]),
                *self.row_shape,
                dtype=self.dtype,
                device=self.device,
            )
        return self._gather[0, :rows], self._gather[1, :rows]

    def slots(self, blocks: list[int], start: int, stop: int) -> np.ndarray:
        """Slots of rows [start, stop) of a block table."""
        rows = np.arange(start, stop)
        table = np.asarray(blocks, dtype=np.int64)
        return table[rows // self.block_size] * self.block_size + rows % self.block_size

    def copy_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        """K/V of slots `src` into slots `dst`, every layer (a commit moves a few rows)."""
        if src.size == 0:
            return
        s = torch.from_numpy(src).to(self.device)
        d = torch.from_numpy(dst).to(self.device)
        self.k.index_copy_(1, d, self.k.index_select(1, s))
        self.v.index_copy_(1, d, self.v.index_select(1, s))
