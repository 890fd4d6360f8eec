"""The KV block pool of one stage (or the draft): fixed-size blocks of K/V rows for all
of the stage's layers, shared by every request it holds.

A request owns a list of blocks (its block table, `kv_cache.TreeKVCache`); a row of a
request lives in one *slot* (block * block_size + offset). K and V are one tensor,
`kv` [layers, slots, 2 * kv_heads, head_dim], a slot's K heads then its V heads (`k` and
`v` are views of the halves), so a step writes the new K and V rows of all its requests
with one `index_copy_` per layer, reads any request's rows with one gather of slots, and a
commit moves rows with one copy: each operation is a launch on an accelerator and
dispatch time on a CPU, whatever its size. As in
vLLM's paged attention, memory is taken as rows arrive, not reserved for what a request
might reach, and given back block by block.

Blocks are handed out and taken back on the host (a free list); the device only sees
slot indices. The storage is allocated once, for the whole budget, as vLLM does: when
the budget is given (a service sizes it at start from the device's free memory and
`--cache-fraction`, or takes `--max-cache-gib`) or, for an in-process runtime left at
the default, at its first use; it never grows, so no step copies it or takes 1.5x its
memory, and its tensors keep their addresses (what a captured CUDA graph needs). It is
zeros (a padded gather reads slots it masks out, and garbage there could be NaN: 0 * NaN
is NaN after the softmax); on the CPU the zeros are calloc'd, so the pages of a budget
the stage never touches are never committed (a test's or a CPU stage's default budget
costs address space, not memory).

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

import math
import threading
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

from .errors import CacheFull

BLOCK_SIZE = 16  # rows per block (vLLM's default on GPUs)


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
        allocate: bool = True,
    ) -> None:
        """`allocate`: the storage now (False: at `set_budget` or at the first use)."""
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.row_shape = (num_kv_heads, head_dim)
        self.num_layers, self.dtype, self.device = num_layers, dtype, torch.device(device)
        self.block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize
        self.max_blocks = max_bytes // self.block_bytes
        self._storage_blocks = 0  # blocks the storage tensors hold (allocated once)
        self._stored = 0  # blocks handed out at least once (ids below); the rest untouched
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
        self._set_storage(self._zeros(0), None)
        # room for a step's gathered K/V rows, flat (`gather_buffer`)
        self._gather = torch.empty(0, dtype=dtype, device=self.device)
        if allocate:
            self.allocate_storage()

    def _zeros(self, blocks: int) -> Tensor:
        return self._storage(blocks)[0]

    def _set_storage(self, kv: Tensor, host: np.ndarray | None) -> None:
        """`kv` the storage, and `k`, `v` its halves (views)."""
        heads = self.row_shape[0]
        self.kv, self._host = kv, host  # K/V of a CPU storage as integers (`copy_rows`)
        self.k, self.v = kv[:, :, :heads], kv[:, :, heads:]

    def _storage(self, blocks: int) -> tuple[Tensor, np.ndarray | None]:
        """A zero K/V storage of `blocks` blocks and, on a CPU, the same memory as a
        numpy array of integers of the dtype's size (a row copy moves the same bytes
        whatever the dtype, and numpy has no bfloat16)."""
        heads, d = self.row_shape
        shape = (self.num_layers, blocks * self.block_size, 2 * heads, d)
        if self.device.type != "cpu" or not blocks:
            return torch.zeros(shape, dtype=self.dtype, device=self.device), None
        # calloc (numpy's zeros): a large block is fresh zero pages, committed when written
        raw = np.zeros(math.prod(shape) * self.dtype.itemsize, np.uint8)
        as_int = np.dtype(f"i{self.dtype.itemsize}")
        return torch.from_numpy(raw).view(self.dtype).view(shape), raw.view(as_int).reshape(shape)

    @property
    def allocated(self) -> bool:
        return self._storage_blocks > 0 or self.max_blocks == 0

    def allocate_storage(self) -> None:
        """Allocate the storage for the whole budget, now (nothing is held: an earlier
        storage and what the prefix cache kept in it are given back first)."""
        with self._lock:
            if self.used_blocks:
                raise RuntimeError("the KV storage cannot be replaced while blocks are held")
            self.clear_prefix_cache()
            self._set_storage(self._zeros(0), None)  # the old storage goes before the new
            self._set_storage(*self._storage(self.max_blocks))
            self._storage_blocks, self._stored, self._free, self._refs = self.max_blocks, 0, [], []

    # -- accounting --------------------------------------------------------------------
    def set_budget(self, max_bytes: int) -> None:
        """A new budget. With no block held, the storage is allocated anew for it (a
        service sizes its pool at start); otherwise blocks already held stay held, and
        the budget is capped at the storage (the pool shrinks as they are freed, and never
        grows while in use)."""
        blocks = max_bytes // self.block_bytes
        with self._lock:
            if self.used_blocks:
                self.max_blocks = min(blocks, self._storage_blocks)
                return
            self.max_blocks = blocks
            if blocks != self._storage_blocks:
                self.allocate_storage()

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
        if not self.allocated:  # an in-process runtime at its default budget: once
            self.allocate_storage()
        short = n - len(self._free)
        if short > 0 and self._stored < self._storage_blocks:
            self._issue(min(short, self._storage_blocks - self._stored))
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

    def _issue(self, blocks: int) -> None:
        """Hand `blocks` never used blocks to the free list (storage, not memory: no copy)."""
        end = self._stored + blocks
        # Lowest ids on top of the stack: a request's blocks tend to be adjacent.
        self._free = list(range(end - 1, self._stored - 1, -1)) + self._free
        self._refs += [0] * blocks
        self._stored = end

    def gather_buffer(self, rows: int) -> Tensor:
        """Room for `rows` gathered K/V rows [rows, 2 * kv_heads, head_dim], kept between
        steps: a step's attention gathers every request's keys into it, layer after layer,
        instead of allocating (and, on a CPU, page-faulting) fresh tensors per layer."""
        heads, d = self.row_shape
        need = rows * 2 * heads * d
        if self._gather.numel() < need:
            size = max(need, 2 * self._gather.numel())
            self._gather = torch.empty(size, dtype=self.dtype, device=self.device)
        return self._gather[:need].view(rows, 2 * heads, d)

    def slots(self, blocks: list[int], start: int, stop: int) -> np.ndarray:
        """Slots of rows [start, stop) of a block table (only the blocks they fall in are
        read: a step's few rows of a long table cost as few rows of a short one)."""
        bs = self.block_size
        if stop - start <= 8:  # a commit's few rows: a list, not five array operations
            few = [blocks[i // bs] * bs + i % bs for i in range(start, stop)]
            return np.array(few, dtype=np.int64)
        first = start // bs
        rows = np.arange(start - first * bs, stop - first * bs)
        table = np.asarray(blocks[first : -(-stop // bs)], dtype=np.int64)
        return table[rows // bs] * bs + rows % bs

    def copy_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        """K/V of slots `src` into slots `dst`, every layer (a commit moves a few rows),
        queued on the device without waiting for it (a CPU storage: copied at once, by
        numpy on the same memory)."""
        if src.size == 0:
            return
        if self._host is not None:  # a CPU storage: one array operation on its memory
            kv = self._host
            kv[:, dst] = kv[:, src]
            return
        # one host-to-device copy of both index lists; nothing is read back
        s, d = torch.from_numpy(np.stack([src, dst])).to(self.device, non_blocking=True)
        self.kv.index_copy_(1, d, self.kv.index_select(1, s))
