"""One request's KV cache on one stage: a committed prefix followed by token-tree rows,
stored in blocks of the stage's `BlockPool`.

Rows ``[0, n_committed)`` are verified tokens, in order, in the request's committed
blocks (its block table: row i is in block ``blocks[i // block_size]``). Tree rows belong
to nodes this stage has computed, identified by the router's stable node ids; each has a
slot of its own in the request's tree blocks, and the cache keeps the ancestor mask among
them, so a new node's ancestors are its parent's plus itself (docs/architecture.md,
"2. Token tree"). Pruning edits these tables: dropped nodes give their slots back (and a
tree block nobody uses goes back to the pool); a committed node's K/V row is copied once
to the end of the committed prefix, the only K/V a prune moves.

Prefix caching (`block_pool`): a request opened with the token ids it will commit before
its first root (`attach_prefix`) starts with the cached blocks of their longest cached
prefix as its first committed rows, shared with other requests, and registers its own
full blocks of those tokens once computed (`register_full_blocks`), for the next. Shared
or registered blocks are never written: committed rows are only appended past them, and
rewriting from inside one (`append_committed` at an earlier position) copies it first.
Tree rows never enter the prefix cache.

Everything here runs on the host, on numpy arrays derived from the messages; the device
only receives slot indices (`StageRuntime` packs them for a step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..spec.tree import member
from .block_pool import BlockPool
from .errors import BadInput, CacheFull
from .prefix_hash import NO_SCOPE, CacheScope, block_keys

_EMPTY = np.empty(0, dtype=np.int64)


@dataclass(slots=True, eq=False)  # made per request and step: not frozen (5 us to 1)
class NewRows:
    """Where a step's new rows of one request go and what each attends to.

    `slots`: their slots. The request's keys, in the order the attention sees them, are
    its committed rows then its tree rows (`TreeKVCache.key_slots`); new row i attends to
    keys [0, prefix[i]) and to the key columns `ancestors[i]` [n, depth], padded with -1
    (tree rows: the node's ancestors and itself; committed rows: none, their prefix is
    causal). `keys`: how many of the request's keys they see at most (the cache's rows
    once they are in, known where they are made; None: read from the arrays)."""

    slots: np.ndarray
    prefix: np.ndarray
    ancestors: np.ndarray
    keys: int | None = None


class TreeKVCache:
    def __init__(self, pool: BlockPool, capacity: int) -> None:
        self.pool, self.capacity = pool, capacity
        self.blocks: list[int] = []  # committed rows' block table
        self.n_committed = 0
        self.tree_ids = _EMPTY  # node id of each tree row, in the order rows were added
        self.tree_slots = _EMPTY
        self.tree_mask = np.zeros((0, 0), dtype=bool)  # [i, j]: tree row j is i or an ancestor
        self.tree_blocks: list[int] = []
        self._free_tree_slots: list[int] = []
        self._committed_ids: set[int] = set()
        # The committed rows' slots computed so far (`key_slots`), extended as rows are
        # appended; forgotten where a block of the table is replaced or given back.
        self._slots = _EMPTY
        # Prefix caching: the token ids the request commits first (given at open), the
        # keys of their full blocks, and how many leading blocks are in the cache.
        self.known_tokens: np.ndarray | None = None
        self._keys: list[bytes] = []
        self._owner = b""  # whom its cached blocks count against (CacheScope.owner)
        self._registered = 0

    @property
    def num_tree_rows(self) -> int:
        return int(self.tree_ids.size)

    @property
    def length(self) -> int:
        return self.n_committed + self.num_tree_rows

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.tree_blocks)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.pool.block_bytes

    def key_slots(self) -> np.ndarray:
        """Slots of every cached row: the committed prefix in order, then the tree rows."""
        known, n = self._slots.size, self.n_committed
        if known > n:
            self._slots = self._slots[:n]
        elif known < n:
            self._slots = np.concatenate([self._slots, self.pool.slots(self.blocks, known, n)])
        return np.concatenate([self._slots, self.tree_slots])

    def _check_room(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise CacheFull(f"KV cache full: {self.length} + {n} rows > capacity {self.capacity}")

    # -- the prefix cache --------------------------------------------------------------
    def attach_prefix(self, tokens: np.ndarray, scope: CacheScope = NO_SCOPE) -> int:
        """A fresh request that will commit `tokens` first: take the pool's cached blocks
        of their longest cached prefix in `scope` as its first committed rows; the
        number of rows (tokens) it holds so. Its own full blocks of `tokens` are
        registered in `scope` as they are computed (`register_full_blocks`)."""
        if self.length or self.blocks:
            raise BadInput("a prefix can only be attached to an empty cache")
        if tokens.size > self.capacity:
            raise BadInput(f"{tokens.size} prefix tokens exceed the capacity {self.capacity}")
        if not self.pool.prefix_caching:
            return 0
        self.known_tokens = tokens
        self._keys = block_keys(tokens, self.pool.block_size, scope.salt)
        self._owner = scope.owner
        self.blocks = self.pool.lookup(self._keys)
        self._registered = len(self.blocks)
        self.n_committed = len(self.blocks) * self.pool.block_size
        return self.n_committed

    def check_tokens(self, start: int, tokens: np.ndarray) -> None:
        """Committed tokens at `start`..: those the request announced at open must be
        these (the first stage and the draft see tokens; their blocks get the keys of the
        announced ones)."""
        known = self.known_tokens
        if known is None or start >= known.size:
            return
        n = min(tokens.size, known.size - start)
        if not np.array_equal(known[start : start + n], tokens[:n]):
            raise BadInput("prefill tokens differ from the prefix the request was opened with")

    def register_full_blocks(self) -> None:
        """Offer the request's full blocks of its announced tokens, computed by now, to
        the prefix cache."""
        full = min(self.n_committed // self.pool.block_size, len(self._keys))
        for i in range(self._registered, full):
            self.pool.register(self.blocks[i], self._keys[i], self._owner)
        self._registered = max(self._registered, full)

    def _truncate_committed(self, n: int) -> None:
        """Keep the first `n` committed rows. A kept block that is shared or cached and
        now only partly kept is copied first (its rows stay valid for its key)."""
        bs = self.pool.block_size
        keep = self.pool.blocks_for(n)
        if n % bs and self.pool.is_cached(self.blocks[keep - 1]):
            old = self.blocks[keep - 1]
            (new,) = self.pool.allocate(1)
            start = (keep - 1) * bs
            self.pool.copy_rows(
                self.pool.slots([old], 0, n - start), self.pool.slots([new], 0, n - start)
            )
            self.blocks[keep - 1] = new
            self.pool.release([old])
        self.pool.release(self.blocks[keep:])
        del self.blocks[keep:]
        self.n_committed = n
        self._slots = _EMPTY
        self._registered = min(self._registered, n // bs)

    # -- growing -----------------------------------------------------------------------
    def append_committed(self, n: int, start: int | None = None) -> NewRows:
        """Rows for `n` verified tokens (a prefill chunk), causal among themselves, at
        position `start` (default: after the committed rows). A start before the end of
        the committed rows rewrites from there: what the prefix cache gave beyond the
        prefix every stage of the path holds (the router starts the prefill there)."""
        if self.num_tree_rows:
            raise BadInput("committed rows can only be appended while no tree rows are cached")
        if start is not None and start < self.n_committed:
            if start < 0:
                raise BadInput(f"committed rows at negative position {start}")
            self._truncate_committed(start)
        self._check_room(n)
        start = self.n_committed
        self.blocks += self.pool.allocate(self.pool.blocks_for(start + n) - len(self.blocks))
        self.n_committed += n
        prefix = np.arange(start + 1, start + n + 1)
        no_tree = np.empty((n, 0), dtype=np.int64)
        slots = self.pool.slots(self.blocks, start, start + n)
        return NewRows(slots, prefix, no_tree, start + n)

    def append_nodes(self, node_ids: np.ndarray, parent_ids: np.ndarray) -> NewRows:
        """Rows for tree nodes (BFS order).

        A parent is a cached tree row, an earlier node of this batch, or a committed token
        (then the node attends to the committed prefix only, which includes its parent).

        A node's ancestors are its parent's plus itself, so in BFS order one pass over the
        nodes finds them all: a few list operations per node and a fixed number of array
        operations per call (a step's feed is a handful of nodes, and an array operation
        costs microseconds however small)."""
        n = int(node_ids.size)
        self._check_room(n)
        t0 = self.num_tree_rows
        all_ids = np.concatenate([self.tree_ids, node_ids])
        ids = all_ids.tolist()
        row_of = {node: row for row, node in enumerate(ids)}
        if len(row_of) < len(ids):
            raise BadInput("duplicate tree node ids")
        columns: list[list[int]] = []  # each new row's ancestor rows (itself last), sorted
        of_cached: dict[int, list[int]] = {}  # a cached parent's, once per parent
        late, orphans = False, []
        for i, parent in enumerate(parent_ids.tolist()):
            row = row_of.get(parent)
            if row is None:
                if parent != -1:
                    orphans.append(parent)
                above: list[int] = []
            elif row >= t0 + i:
                late = True
                above = []
            elif row >= t0:
                above = columns[row - t0]
            else:
                above = of_cached.get(row)  # type: ignore[assignment]
                if above is None:
                    above = of_cached[row] = np.flatnonzero(self.tree_mask[row]).tolist()
            columns.append([*above, t0 + i])
        if late:
            raise BadInput("tree nodes must come after their parent (BFS order)")
        unknown = [p for p in orphans if p not in self._committed_ids]
        if unknown:
            raise BadInput(f"parent node ids {unknown[:4]} are neither cached nor committed")
        slots = self._take_tree_slots(n)

        width = t0 + n
        mask = np.zeros((width, width), dtype=bool)
        mask[:t0, :t0] = self.tree_mask
        depth = max((len(c) for c in columns), default=0)
        # each new row's ancestors as one flat index list and one padded table: one
        # array operation each (a 2-D scatter from lists cost twice as much)
        mask.ravel()[[(t0 + i) * width + col for i, c in enumerate(columns) for col in c]] = True
        nc = self.n_committed  # key columns: the committed rows come first
        ancestors = np.array(
            [[nc + col for col in c] + [-1] * (depth - len(c)) for c in columns], dtype=np.int64
        ).reshape(n, depth)
        self.tree_mask, self.tree_ids = mask, all_ids
        self.tree_slots = np.concatenate([self.tree_slots, slots])
        prefix = np.empty(n, dtype=np.int64)
        prefix.fill(self.n_committed)  # np.full costs a microsecond more
        return NewRows(slots, prefix, ancestors, self.length)

    def _take_tree_slots(self, n: int) -> np.ndarray:
        short = n - len(self._free_tree_slots)
        if short > 0:
            new = self.pool.allocate(self.pool.blocks_for(short))
            self.tree_blocks += new
            bs = self.pool.block_size
            self._free_tree_slots += [
                b * bs + o for b in reversed(new) for o in range(bs - 1, -1, -1)
            ]
        taken = self._free_tree_slots[-n:] if n else []
        del self._free_tree_slots[len(self._free_tree_slots) - n :]
        return np.asarray(taken[::-1], dtype=np.int64)

    def undo_append(self, n: int, committed: bool) -> None:
        """Forget the last `n` rows appended (their forward failed)."""
        if committed:
            self.n_committed -= n
            keep = self.pool.blocks_for(self.n_committed)
            self.pool.release(self.blocks[keep:])
            del self.blocks[keep:]
            self._slots = _EMPTY
        else:
            t = self.num_tree_rows - n
            self._drop_tree_rows(np.arange(t, t + n))

    # -- shrinking ---------------------------------------------------------------------
    def prune(
        self, commit_ids: np.ndarray, keep_ids: np.ndarray, horizon: int | None = None
    ) -> None:
        """Commit verified nodes (in order); of the other tree rows with ids up to `horizon`
        (default: all), keep only `keep_ids`.

        CacheFull when the committed rows need a block and the pool has none; the dropped
        rows are gone then, the commit not done."""
        self.pool.copy_rows(*self.prune_rows(commit_ids, keep_ids, horizon))

    def prune_rows(
        self, commit_ids: np.ndarray, keep_ids: np.ndarray, horizon: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """`prune`'s edit of the tables, without its K/V copy: the committed nodes' rows
        as (source slots, destination slots), for the caller to queue. A step's prunes
        of every request then move their rows in one copy (`StageRuntime.prune_many`):
        a destination is a committed slot and a source a tree slot of the same request,
        and the copy reads every source before it writes, so a block one prune gives
        back and the next takes reads as it was."""
        ids = self.tree_ids
        # the rows of the ids, by a dict: a tree is tens of rows, where each array
        # operation costs a microsecond or two whatever its size
        row_of = {node: row for row, node in enumerate(ids.tolist())}
        commit = commit_ids.tolist()
        missing = [node for node in commit if node not in row_of]
        if missing:
            raise BadInput(f"cannot commit node ids {missing[:4]}: not cached at this stage")
        commit_rows = [row_of[node] for node in commit]
        keep = np.zeros(ids.size, dtype=bool)
        if keep_ids.size:
            keep[[row_of[node] for node in keep_ids.tolist() if node in row_of]] = True
        if horizon is not None:
            keep |= ids > horizon
        if not commit_rows:  # a drop only (an empty tree, or all kept: nothing to do)
            if keep.all():
                return _EMPTY, _EMPTY
            # a node survives only if every tree ancestor survives
            self._keep_tree_rows(keep & (self.tree_mask <= keep).all(axis=1))
            return _EMPTY, _EMPTY
        # A node survives only if every tree ancestor survives or is being committed.
        ok = keep.copy()
        ok[commit_rows] = True
        keep &= (self.tree_mask <= ok).all(axis=1)
        keep[commit_rows] = False
        nc, m = self.n_committed, len(commit_rows)
        need = self.pool.blocks_for(nc + m) - len(self.blocks)
        if need > 0:  # the drop may give back the block the commit needs: drop first
            kept = keep.copy()
            kept[commit_rows] = True
            self._keep_tree_rows(kept)
            self.blocks += self.pool.allocate(need)
            commit_rows = self._rows_of(commit_ids).tolist()  # rows moved up by the drop
            keep = np.ones(self.num_tree_rows, dtype=bool)
            keep[commit_rows] = False
        src = self.tree_slots[commit_rows]
        self.n_committed += m
        self._committed_ids.update(commit)
        self._keep_tree_rows(keep)  # the committed rows' slots go back
        return src, self.pool.slots(self.blocks, nc, nc + m)

    def _drop_tree_rows(self, rows: np.ndarray) -> None:
        """Forget tree rows; their slots are free again, and tree blocks left empty go back."""
        if rows.size == 0:
            return
        live = np.ones(self.num_tree_rows, dtype=bool)
        live[rows] = False
        self._keep_tree_rows(live)

    def _keep_tree_rows(self, live: np.ndarray) -> None:
        """Keep the tree rows `live` marks, forget the others (`_drop_tree_rows`)."""
        kept = int(np.count_nonzero(live))
        if kept == live.size:
            return
        if kept == 0:  # every row: the tree blocks all go back
            blocks, self.tree_blocks, self._free_tree_slots = self.tree_blocks, [], []
            self.tree_ids = self.tree_slots = _EMPTY
            self.tree_mask = np.zeros((0, 0), dtype=bool)
            self.pool.release(blocks)
            return
        freed = self.tree_slots[~live]
        self.tree_ids, self.tree_slots = self.tree_ids[live], self.tree_slots[live]
        self.tree_mask = self.tree_mask[live][:, live]
        bs = self.pool.block_size
        in_use = {slot // bs for slot in self.tree_slots.tolist()}
        if all(b in in_use for b in self.tree_blocks):  # no tree block left empty
            self._free_tree_slots += freed.tolist()
            return
        blocks = np.asarray(self.tree_blocks, dtype=np.int64)
        used = member(blocks, self.tree_slots // bs)
        free = np.concatenate([np.asarray(self._free_tree_slots, dtype=np.int64), freed])
        empty = blocks[~used]
        self._free_tree_slots = free[~member(free // bs, empty)].tolist()
        self.tree_blocks = blocks[used].tolist()
        self.pool.release(empty.tolist())

    def _rows_of(self, node_ids: np.ndarray) -> np.ndarray:
        """The tree rows of `node_ids`, in their order; BadInput if one is not cached."""
        if node_ids.size == 0:
            return _EMPTY
        hits = self.tree_ids[None, :] == node_ids[:, None]
        found = hits.any(axis=1)
        if not found.all():
            missing = node_ids[~found].tolist()
            raise BadInput(f"cannot commit node ids {missing[:4]}: not cached at this stage")
        return hits.argmax(axis=1)

    def release(self) -> None:
        """Give every block back to the pool."""
        self.pool.release(self.blocks + self.tree_blocks)
        self.blocks, self.tree_blocks, self._free_tree_slots = [], [], []
        self._slots = _EMPTY
        self.n_committed = 0
        self.known_tokens, self._keys, self._registered = None, [], 0
        self.tree_ids = self.tree_slots = _EMPTY
        self.tree_mask = np.zeros((0, 0), dtype=bool)
