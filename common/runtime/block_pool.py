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

*Prefix caching* (vLLM's automatic prefix caching): a full block of committed rows whose
tokens are known is registered under its key (`prefix_hash.block_keys`: the hash of its
token prefix), and a request whose prompt starts with the same tokens takes the same
block (`lookup`) instead of computing it again. Blocks carry reference counts; a block
nobody holds any more that has a key stays cached, in least-recently-released order, and
is evicted (its key forgotten, its rows reused) only when an allocation finds no plain
free block and the storage may not grow. Cached blocks count as free in the budget.

Eviction is fair between owners (tenants, `prefix_hash.CacheScope.owner`): it takes the
least recently released block of the owner holding the most cached blocks (the older
head on a tie), so one tenant's stream of new prefixes evicts its own blocks and cannot
push another's below an equal share of the cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

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
        prefix_caching: bool = True,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.row_shape = (num_kv_heads, head_dim)
        self.num_layers, self.dtype, self.device = num_layers, dtype, torch.device(device)
        self.block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize
        self.max_blocks = max_bytes // self.block_bytes
        self._stored = 0  # blocks the storage tensors hold
        self._free: list[int] = []  # stored blocks nobody holds and no key names
        self._refs: list[int] = []  # per stored block: the tables that hold it
        # The prefix cache: key -> block and back; blocks nobody holds that keep their key,
        # least recently released first (evicted in this order).
        self.prefix_caching = prefix_caching
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._owner_of: dict[int, bytes] = {}  # keyed block -> its owner
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # The evictable blocks by owner, each least recently released first, with the
        # release tick of each (eviction order between owners of equal counts).
        self._evictable_by_owner: dict[bytes, OrderedDict[int, int]] = {}
        self._ticks = 0
        self.evictions = 0  # cached blocks reused for other rows
        # Requests open (lookups) while a forward takes and gives back blocks.
        self._lock = threading.RLock()
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
        """Blocks some request holds (a block shared by several counts once)."""
        return self._stored - len(self._free) - len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        """Blocks nobody holds that keep their prefix key (free, until evicted)."""
        return len(self._evictable)

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
        """`n` blocks of the caller's own (reference count 1); CacheFull (nothing taken)
        when the budget has fewer free. Plain free blocks go first, then new storage,
        then the least recently released cached blocks (evicted)."""
        if n <= 0:
            return []
        with self._lock:
            return self._allocate(n)

    def _allocate(self, n: int) -> list[int]:
        if n > self.free_blocks:
            raise CacheFull(
                f"KV cache pool exhausted: {n} more blocks of {self.block_size} rows needed, "
                f"{self.free_blocks} of {self.max_blocks} free"
            )
        short = n - len(self._free)
        if short > 0 and self._stored < self.max_blocks:
            self._grow(self._stored + min(short, self.max_blocks - self._stored))
        for _ in range(n - len(self._free)):
            self._free.append(self._evict_one())
        taken, self._free = self._free[-n:], self._free[:-n]
        for b in taken:
            self._refs[b] = 1
        return taken[::-1]

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block nobody holds is free again, and
        stays cached if it has a key. Released tail first: a sequence's last blocks are
        evicted before its first (which more requests are likely to share)."""
        with self._lock:
            self._release(list(blocks))

    def _release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] > 0:
                continue
            if self._refs[b] < 0:
                raise AssertionError(f"block {b} released more often than it was taken")
            if b in self._key_of:
                self._evictable[b] = None
                owned = self._evictable_by_owner.setdefault(self._owner_of[b], OrderedDict())
                owned[b] = self._ticks
                self._ticks += 1
            else:
                self._free.append(b)

    def _evict_one(self) -> int:
        """Forget the key of the fairest block to evict (module docstring); its id."""
        owner = max(
            self._evictable_by_owner,
            key=lambda o: (len(self._evictable_by_owner[o]),
                           -next(iter(self._evictable_by_owner[o].values()))),
        )  # fmt: skip
        block, _ = self._evictable_by_owner[owner].popitem(last=False)
        self._unlist(block)
        del self._block_of[self._key_of.pop(block)]
        del self._owner_of[block]
        self.evictions += 1
        return block

    def _unlist(self, block: int) -> None:
        """`block` is no longer evictable (taken again, or evicted)."""
        self._evictable.pop(block, None)
        owner = self._owner_of[block]
        owned = self._evictable_by_owner.get(owner)
        if owned is not None:
            owned.pop(block, None)
            if not owned:
                del self._evictable_by_owner[owner]

    # -- the prefix cache --------------------------------------------------------------
    def lookup(self, keys: Iterable[bytes]) -> list[int]:
        """The cached blocks of the longest run of `keys` from the first, each with a
        reference taken for the caller (they leave the eviction queue)."""
        found: list[int] = []
        if not self.prefix_caching:
            return found
        with self._lock:
            for key in keys:
                b = self._block_of.get(key)
                if b is None:
                    break
                if self._refs[b] == 0:
                    self._unlist(b)
                self._refs[b] += 1
                found.append(b)
        return found

    def register(self, block: int, key: bytes, owner: bytes = b"") -> None:
        """`block` (full, held, its rows computed) now holds the rows of `key`, cached
        on behalf of `owner`. A key already cached keeps its block (another request
        computed it at the same time); this one then stays private and is freed as
        usual."""
        with self._lock:
            if not self.prefix_caching or key in self._block_of or block in self._key_of:
                return
            self._block_of[key] = block
            self._key_of[block] = key
            self._owner_of[block] = owner

    def clear_prefix_cache(self) -> None:
        """Forget every key (cached blocks nobody holds become plain free blocks)."""
        with self._lock:
            self._free.extend(self._evictable)
            self._evictable.clear()
            self._evictable_by_owner.clear()
            self._block_of.clear()
            self._key_of.clear()
            self._owner_of.clear()

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        """Whether `block` has a prefix key or more than one holder: not to be written."""
        return block in self._key_of or self._refs[block] > 1

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
        self._refs += [0] * (blocks - self._stored)
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
