"""The stage runtime: one slice of the target model plus the KV caches of its requests.

This object is everything a pipeline stage does; the gRPC service wraps it without adding
logic. It is safe to call from several threads (one model forward at a time). It is
one module because a request's lifecycle (open, forward, prune, release) and the batched
step that runs every request's rows share the same caches and locks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..model.flex_attention import flex_applies
from ..model.layers import StageModel
from ..model.paged_attention import PagedBatch
from ..spec.messages import Activation, Prune
from ..spec.tree import member
from .block_pool import BLOCK_SIZE, BlockPool
from .errors import AlreadyOpen, BadInput, CacheFull, NotOpen, RequestError
from .kv_cache import NewRows, TreeKVCache
from .paged_batch import pack, to_device
from .prefill_pace import PrefillPace
from .prefix_hash import NO_SCOPE, CacheScope
from .step_budget import DEFAULT_STEP_BYTES, StepBudget, StepCosts

# What a stage computed for one request of a batch (see `StageRuntime.forward_many`).
StageOutput = Activation | None | RequestError
DEFAULT_CACHE_BYTES = 8 << 30


def host(t: Tensor) -> np.ndarray:
    """A message's host tensor as numpy (ids and positions arrive on the host)."""
    return t.numpy()


@dataclass
class _Prepared:
    """One request's rows in a batch, with the cache rows they were given.

    `keep`: the rows of `act` that run (a prune applied here dropped the others), None
    for all; `node_ids`, `parent_ids`, `positions` are those rows'."""

    index: int
    act: Activation
    cache: TreeKVCache
    rows: NewRows
    keep: np.ndarray | None
    positions: np.ndarray
    node_ids: np.ndarray
    parent_ids: np.ndarray

    def __len__(self) -> int:
        return int(self.positions.size)

    def output(self, **tensors: Tensor | None) -> Activation:
        """The activation of these rows (ids and positions of the rows that ran)."""
        act = self.act
        if self.keep is None:
            return Activation(
                act.request_id,
                act.positions,
                act.committed,
                act.node_ids,
                act.parent_ids,
                **tensors,
            )
        return Activation(
            act.request_id,
            torch.from_numpy(self.positions),
            act.committed,
            torch.from_numpy(self.node_ids),
            torch.from_numpy(self.parent_ids),
            **tensors,
        )


@dataclass
class PreparedStep:
    """A step whose host work is done (`StageRuntime.prepare_step`): its requests' rows
    in the cache, each forward's inputs built; `results` holds the requests that failed
    or have nothing to run."""

    results: list[StageOutput]
    batch: list[_Prepared]
    inputs: list[tuple[Tensor, Tensor, PagedBatch]]


@dataclass(frozen=True)
class StageInfo:
    start: int
    end: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    device: str
    weight_bytes: int
    cache_bytes_used: int
    cache_bytes_limit: int
    active_requests: int
    cache_blocks_used: int = 0
    cache_blocks_free: int = 0
    cache_block_rows: int = BLOCK_SIZE
    # The prefix cache: on or off, blocks nobody holds kept for their prefix, and the
    # prompt tokens asked for at open and found cached since start.
    prefix_caching: bool = True
    cache_blocks_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class StageRuntime:
    def __init__(
        self,
        model: StageModel,
        max_cache_bytes: int | None = None,
        block_size: int = BLOCK_SIZE,
        prefix_caching: bool = True,
        step_bytes: int | None = None,
    ) -> None:
        """`step_bytes`: the working memory one step may take (`step_budget.py`; None:
        `DEFAULT_STEP_BYTES`)."""
        self.model = model
        # read once: a module's device and dtype walk its parameters (microseconds a read,
        # several reads a step)
        self.device, self.dtype = model.device, model.dtype
        self._flex = flex_applies(self.device)  # the attention path, chosen at start
        cfg = model.cfg
        self.step_budget = StepBudget(
            step_bytes if step_bytes is not None else DEFAULT_STEP_BYTES,
            StepCosts.of(cfg, model.dtype, logits=model.layer_range.is_last),
        )
        # prefill beside decodes, learned from the steps (its callers observe them)
        self.prefill_pace = PrefillPace(self.step_budget.prefill_cells)
        self.pool = BlockPool(
            model.layer_range.size,
            cfg.num_kv_heads,
            cfg.head_dim,
            max_cache_bytes if max_cache_bytes is not None else DEFAULT_CACHE_BYTES,
            block_size,
            model.dtype,
            model.device,
            prefix_caching,
            # The default budget (in-process use): allocated at first use, unless a
            # service sets its own first (`max_cache_bytes`, from free memory at start).
            allocate=max_cache_bytes is not None,
        )
        self._max_cache_bytes = self.pool.max_blocks * self.pool.block_bytes
        self._caches: dict[str, TreeKVCache] = {}
        self._last_prune: dict[str, Prune] = {}
        self._lock = threading.Lock()
        self._compute_lock = threading.Lock()
        # Caches of released requests whose blocks go back once no forward runs (a
        # forward may be writing their rows).
        self._to_free: list[TreeKVCache] = []
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache at open
        self.prefix_hits = 0  # of those, tokens found cached

    @property
    def is_first(self) -> bool:
        return self.model.layer_range.is_first

    @property
    def is_last(self) -> bool:
        return self.model.layer_range.is_last

    @property
    def max_cache_bytes(self) -> int:
        return self._max_cache_bytes

    @max_cache_bytes.setter
    def max_cache_bytes(self, value: int) -> None:
        with self._lock:
            self.pool.set_budget(value)
            self._max_cache_bytes = value

    @property
    def step_bytes(self) -> int:
        """The working memory one step may take (`step_budget.py`)."""
        return self.step_budget.bytes

    @step_bytes.setter
    def step_bytes(self, value: int) -> None:
        with self._compute_lock:
            self.step_budget = StepBudget(value, self.step_budget.costs)
            self.prefill_pace.ceiling = self.step_budget.prefill_cells

    @property
    def prefix_caching(self) -> bool:
        return self.pool.prefix_caching

    @prefix_caching.setter
    def prefix_caching(self, on: bool) -> None:
        """On or off (`--no-prefix-cache`); off forgets what is cached."""
        with self._lock:
            self.pool.prefix_caching = on
            if not on:
                self.pool.clear_prefix_cache()

    @property
    def cache_bytes_used(self) -> int:
        with self._lock:
            return self.pool.used_bytes

    def info(self) -> StageInfo:
        r = self.model.layer_range
        with self._lock:
            used, free, active = self.pool.used_blocks, self.pool.free_blocks, len(self._caches)
            cached, queries, hits = self.pool.cached_blocks, self.prefix_queries, self.prefix_hits
        return StageInfo(
            start=r.start,
            end=r.end,
            num_layers=r.num_layers,
            hidden_size=self.model.cfg.hidden_size,
            vocab_size=self.model.cfg.vocab_size,
            dtype=str(self.model.dtype).removeprefix("torch."),
            device=str(self.model.device),
            weight_bytes=self.model.num_bytes(),
            cache_bytes_used=used * self.pool.block_bytes,
            cache_bytes_limit=self.max_cache_bytes,
            active_requests=active,
            cache_blocks_used=used,
            cache_blocks_free=free,
            cache_block_rows=self.pool.block_size,
            prefix_caching=self.pool.prefix_caching,
            cache_blocks_cached=cached,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
        )

    # -- request lifecycle -------------------------------------------------------------
    def open(
        self,
        request_id: str,
        capacity: int,
        prefix_tokens: Sequence[int] | np.ndarray | None = None,
        cache_scope: CacheScope = NO_SCOPE,
    ) -> int:
        """Open the request's cache, which may grow to `capacity` rows (prompt + output +
        tree). Nothing is reserved: blocks are taken as rows arrive, and a request is
        admitted while the pool has a free block (a request that later finds the pool
        empty fails with CacheFull, RESOURCE_EXHAUSTED; docs/architecture.md, "5. The request
        controller and its executors", "The stage engine").

        `prefix_tokens`: the token ids the request commits before its first root (the
        prompt but its last token). Returns how many of them this stage holds cached
        (whole blocks of their longest cached prefix, now the request's first committed
        rows; 0 with prefix caching off): the router starts the request's prefill at the
        least of its path's. Its blocks of these tokens are cached for later requests as
        they are computed. `cache_scope`: the prefix-cache namespace of those blocks
        (prefix_hash.py: requests of other scopes neither find nor evict them first)."""
        with self._lock:
            if request_id in self._caches:
                raise AlreadyOpen(f"request {request_id!r} is already open on this stage")
            if self.pool.free_blocks < 1:
                raise CacheFull(
                    f"KV cache budget exhausted: {self.pool.used_blocks} of "
                    f"{self.pool.max_blocks} blocks in use"
                )
            cache = TreeKVCache(self.pool, capacity)
            cached = 0
            if prefix_tokens is not None:
                tokens = np.asarray(prefix_tokens, dtype=np.int64).reshape(-1)
                cached = cache.attach_prefix(tokens, cache_scope)
                if self.pool.prefix_caching:
                    self.prefix_queries += int(tokens.size)
                    self.prefix_hits += cached
            self._caches[request_id] = cache
            return cached

    def release(self, request_id: str) -> bool:
        with self._lock:
            self._last_prune.pop(request_id, None)
            cache = self._caches.pop(request_id, None)
            if cache is None:
                return False
            self._to_free.append(cache)
        self._free_released()
        return True

    def _free_released(self) -> None:
        """Give released requests' blocks back, unless a forward or prune runs (then it
        does so when it ends)."""
        if not self._compute_lock.acquire(blocking=False):
            return
        try:
            self._free_released_locked()
        finally:
            self._compute_lock.release()

    def _free_released_locked(self) -> None:
        with self._lock:
            caches, self._to_free = self._to_free, []
        for cache in caches:
            cache.release()

    def _cache(self, request_id: str) -> TreeKVCache:
        try:
            return self._caches[request_id]
        except KeyError:
            raise NotOpen(f"request {request_id!r} is not open on this stage") from None

    # -- the step's phases -------------------------------------------------------------
    def forward(self, act: Activation) -> Activation | None:
        """Node-wise computation of one request's rows (see `forward_many`)."""
        (result,) = self.forward_many([act])
        if isinstance(result, Exception):
            raise result
        return result

    def forward_many(self, acts: Sequence[Activation]) -> list[StageOutput]:
        """Node-wise computation of one step: the rows of several requests in one batched
        forward (docs/architecture.md, "3. The pipeline step").

        For each activation, in order: the hidden states of its rows (for the next stage;
        on the last stage, the final ones, which its caller verifies:
        `common/runtime/verifier.py`); None when nothing is left
        (nodes a prune already applied here has dropped arrived late, and are skipped); or
        the `RequestError` that request failed with, which fails no other request.

        Every decision is taken on the host from the messages' ids; the device runs one
        fixed sequence of operations for the whole batch and nothing is read back from it.
        It is `prepare_step` then `run_step`, which a caller that overlaps the next step's
        host work with this step's device work calls apart."""
        return self.run_step(self.prepare_step(acts))

    @torch.inference_mode()
    def prepare_step(self, acts: Sequence[Activation]) -> PreparedStep:
        """A step's host work: each request's rows checked and given cache rows, and the
        forward's inputs (rows, positions, attention metadata) built and on their way to
        the device. The step holds the runtime's compute lock from here until `run_step`
        (or `abandon_step`) on the same thread: no released request's blocks are given
        back in between, since the step writes them."""
        results: list[StageOutput] = [None] * len(acts)
        self._compute_lock.acquire()
        batch: list[_Prepared] = []
        try:
            for i, act in enumerate(acts):
                try:
                    prepared = self._prepare(i, act)
                except RequestError as e:
                    results[i] = e
                    continue
                if prepared is not None:
                    batch.append(prepared)
            step = PreparedStep(results, batch, [self._inputs(run) for run in self._runs(batch)])
        except BaseException:
            self._undo(batch)
            raise
        if not batch:
            self._end_step()
        return step

    @torch.inference_mode()
    def run_step(self, step: PreparedStep) -> list[StageOutput]:
        """A prepared step's forward (on an accelerator: launched, nothing waited for) and
        each request's output, as `forward_many` returns them."""
        batch, results = step.batch, step.results
        if not batch:
            return results
        try:
            parts = [
                self.model.forward_batch(self.model.embed(x) if self.is_first else x, *rest)
                for x, *rest in step.inputs
            ]
            hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
        except BaseException:
            self._undo(batch)
            raise
        try:
            for b in batch:
                if b.act.committed:
                    b.cache.register_full_blocks()  # computed: other requests may share them
            with self._lock:
                released = [b.act.request_id not in self._caches for b in batch]
        finally:
            self._end_step()
        self._outputs(batch, hidden, released, results)
        return results

    def abandon_step(self, step: PreparedStep) -> None:
        """A prepared step that will not run: its cache rows given back."""
        if step.batch:
            self._undo(step.batch)

    def _undo(self, batch: Sequence[_Prepared]) -> None:
        try:
            for b in batch:
                b.cache.undo_append(len(b), b.act.committed)
        finally:
            self._end_step()

    def _end_step(self) -> None:
        try:
            self._free_released_locked()
        finally:
            self._compute_lock.release()
        self._free_released()  # released after the step's check

    @staticmethod
    def _outputs(
        batch: Sequence[_Prepared],
        hidden: Tensor,
        released: Sequence[bool],
        results: list[StageOutput],
    ) -> None:
        """Each request's output rows: its part of the batch's hidden states."""
        for b, rows, gone in zip(
            batch, hidden.split([len(b) for b in batch]), released, strict=True
        ):
            results[b.index] = StageRuntime._gone(b) if gone else b.output(hidden=rows)

    @staticmethod
    def _gone(b: _Prepared) -> NotOpen:
        # Released while its rows were computed (cancelled, or its router gave up): its
        # output goes nowhere, and the others' must not suffer for it.
        return NotOpen(f"request {b.act.request_id!r} was released")

    def _prepare(self, index: int, act: Activation) -> _Prepared | None:
        """Check one request's rows and give them cache rows; None: nothing to run."""
        cache = self._cache(act.request_id)
        if len(act) == 0:
            return None
        if self.is_first and act.tokens is None:
            raise BadInput("the first stage needs token ids")
        if not self.is_first and act.hidden is None:
            raise BadInput("stages after the first need hidden states")
        positions, node_ids, parent_ids = (
            host(act.positions),
            host(act.node_ids),
            host(act.parent_ids),
        )
        keep = None
        last_prune = self._last_prune.get(act.request_id)
        # rows newer than the last prune's horizon (a step's feed, nearly always) all run
        if (
            last_prune is not None
            and not act.committed
            and int(node_ids.min()) <= last_prune.horizon
        ):
            alive = (node_ids > last_prune.horizon) | member(node_ids, host(last_prune.keep_ids))
            if not alive.any():
                return None
            if not alive.all():
                keep = np.flatnonzero(alive)
                positions, node_ids, parent_ids = positions[keep], node_ids[keep], parent_ids[keep]
        if act.committed:
            start = int(positions[0])
            if self.is_first:
                cache.check_tokens(start, host(act.tokens))  # type: ignore[arg-type]
            rows = cache.append_committed(positions.size, start)
        else:
            rows = cache.append_nodes(node_ids, parent_ids)
        return _Prepared(index, act, cache, rows, keep, positions, node_ids, parent_ids)

    def _runs(self, batch: Sequence[_Prepared]) -> list[list[_Prepared]]:
        """`batch` in consecutive runs of at most the budget's rows each (a request's later
        rows may attend to its earlier ones: runs go in order, and each writes its K/V
        before the next reads them); their hidden states are concatenated."""
        limit = self.step_budget.max_rows
        runs: list[list[_Prepared]] = [[]]
        rows = 0
        for b in batch:
            if runs[-1] and rows + len(b) > limit:
                runs.append([])
                rows = 0
            runs[-1].append(b)
            rows += len(b)
        return runs if batch else []

    def _inputs(self, batch: Sequence[_Prepared]) -> tuple[Tensor, Tensor, PagedBatch]:
        """The inputs of one forward over the concatenated rows of `batch` (hidden states,
        or token ids on the first stage; positions, attention in parts of at most the step budget's: `paged_batch.plan`),
        copied to the device without waiting for it."""
        device = self.device
        keep = _input_rows(batch)
        one = len(batch) == 1  # the usual step at one client: nothing to concatenate
        if self.is_first:
            tokens = (
                host(batch[0].act.tokens)
                if one
                else np.concatenate(  # type: ignore[arg-type]
                    [host(b.act.tokens) for b in batch]  # type: ignore[arg-type]
                )
            )
            if keep is not None:
                tokens = tokens[keep]
            hidden = to_device(tokens, device)  # embedded in `run_step`
        else:
            hidden = batch[0].act.hidden if one else torch.cat([b.act.hidden for b in batch])  # type: ignore[misc]
            if keep is not None:
                hidden = hidden.index_select(0, torch.from_numpy(keep).to(hidden.device))  # type: ignore[union-attr]
            if hidden.device != device or hidden.dtype != self.dtype:  # type: ignore[union-attr]
                hidden = hidden.to(device=device, dtype=self.dtype, non_blocking=True)  # type: ignore[union-attr]
        positions = batch[0].positions if one else np.concatenate([b.positions for b in batch])
        positions = to_device(positions, device)
        budget = self.step_budget
        attention = pack(
            [b.rows for b in batch],
            [b.cache.key_slots() for b in batch],
            self.pool,
            budget.costs,
            budget.attention_bytes,
            self._flex,
        )
        return hidden, positions, attention

    @torch.inference_mode()
    def prune(self, request_id: str, prune: Prune) -> None:
        """Pruning propagation: commit verified nodes, drop the rest of the pruned tree."""
        (result,) = self.prune_many([(request_id, prune)])
        if result is not None:
            raise result

    @torch.inference_mode()
    def prune_many(self, prunes: Sequence[tuple[str, Prune]]) -> list[RequestError | None]:
        """A step's prunes of every request (each request's in order), as one pass: one
        hold of the locks, the committed rows of all of them moved in one K/V copy (two
        device operations per step, not per request), released requests' blocks given
        back once. Per prune None, or the `RequestError` that request failed with (its
        dropped rows gone, its commit not done), which fails no other."""
        results: list[RequestError | None] = [None] * len(prunes)
        sources: list[np.ndarray] = []
        targets: list[np.ndarray] = []
        failed: dict[str, RequestError] = {}  # a request's later prunes fail with it
        with self._compute_lock:
            try:
                for i, (request_id, prune) in enumerate(prunes):
                    if request_id in failed:
                        results[i] = failed[request_id]
                        continue
                    commit_ids, keep_ids = host(prune.commit_ids), host(prune.keep_ids)
                    try:
                        with self._lock:
                            cache = self._cache(request_id)  # not freed meanwhile
                        src, dst = cache.prune_rows(commit_ids, keep_ids, prune.horizon)
                    except RequestError as e:
                        results[i] = failed[request_id] = e
                        continue
                    sources.append(src)
                    targets.append(dst)
                    self._last_prune[request_id] = prune
            finally:
                if len(sources) == 1:
                    self.pool.copy_rows(sources[0], targets[0])
                elif sources:
                    self.pool.copy_rows(np.concatenate(sources), np.concatenate(targets))
                self._free_released_locked()
        return results


def _input_rows(batch: Sequence[_Prepared]) -> np.ndarray | None:
    """Rows of the concatenated inputs that run, None for all (a late prune dropped some)."""
    if all(b.keep is None for b in batch):
        return None
    parts, row = [], 0
    for b in batch:
        n = len(b.act)
        parts.append(row + (np.arange(n) if b.keep is None else b.keep))
        row += n
    return np.concatenate(parts)
