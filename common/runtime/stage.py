"""The stage runtime: one slice of the target model plus the KV caches of its requests.

This object is everything a pipeline stage does; the gRPC service wraps it without adding
logic. It is safe to call from several threads (one model forward at a time).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..model.layers import Segment, StageModel
from ..spec.messages import Activation, Prune
from .errors import AlreadyOpen, BadInput, CacheFull, NotOpen, RequestError
from .kv_cache import TreeKVCache

# What a stage computed for one request of a batch (see `StageRuntime.forward_many`).
StageOutput = Activation | None | RequestError


@dataclass
class _Prepared:
    """One request's rows in a batch, with their reserved cache rows."""

    index: int
    act: Activation
    cache: TreeKVCache
    start: int
    mask: Tensor
    is_root: Tensor | None


def _split(hidden: Tensor, batch: Sequence[_Prepared]) -> list[Tensor]:
    return list(hidden.split([len(b.act) for b in batch]))


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


class StageRuntime:
    def __init__(self, model: StageModel, max_cache_bytes: int | None = None) -> None:
        self.model = model
        cfg = model.cfg
        self._row_bytes = (
            2 * model.layer_range.size * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
        )
        self.max_cache_bytes = max_cache_bytes if max_cache_bytes is not None else 8 << 30
        self._caches: dict[str, TreeKVCache] = {}
        self._last_prune: dict[str, Prune] = {}
        # Last stage, requests opened with root_logits_only: tree rows computed before
        # they became the root, with their final hidden states (logits not yet computed).
        self._held: dict[str, Activation | None] = {}
        # Last stage, requests opened with final_hidden: the caller verifies (verifier.py)
        self._final_hidden: set[str] = set()
        self._lock = threading.Lock()
        self._compute_lock = threading.Lock()

    @property
    def is_first(self) -> bool:
        return self.model.layer_range.is_first

    @property
    def is_last(self) -> bool:
        return self.model.layer_range.is_last

    def cache_bytes_for(self, capacity: int) -> int:
        return capacity * self._row_bytes

    @property
    def cache_bytes_used(self) -> int:
        with self._lock:
            return sum(c.nbytes for c in self._caches.values())

    def info(self) -> StageInfo:
        r = self.model.layer_range
        return StageInfo(
            start=r.start,
            end=r.end,
            num_layers=r.num_layers,
            hidden_size=self.model.cfg.hidden_size,
            vocab_size=self.model.cfg.vocab_size,
            dtype=str(self.model.dtype).removeprefix("torch."),
            device=str(self.model.device),
            weight_bytes=self.model.num_bytes(),
            cache_bytes_used=self.cache_bytes_used,
            cache_bytes_limit=self.max_cache_bytes,
            active_requests=len(self._caches),
        )

    # -- request lifecycle -------------------------------------------------------------
    def open(
        self,
        request_id: str,
        capacity: int,
        root_logits_only: bool = False,
        final_hidden: bool = False,
    ) -> None:
        """Preallocate the request's cache: `capacity` rows (prompt + output + tree).

        `root_logits_only` (last stage; specpipe/pp, where the router verifies one root at
        a time): compute and return logits only for tree rows that are the root, i.e. whose
        parent is committed. Other rows keep their final hidden states until the prune
        that commits their parent makes them the root (`prune` returns their logits), or
        drops them. Without it, every tree row's logits come out (specinfer).

        `final_hidden` (last stage): no logits; the final hidden states of every row come
        out, for the caller to verify (`common/runtime/verifier.py`)."""
        need = self.cache_bytes_for(capacity)
        cfg = self.model.cfg
        with self._lock:
            if request_id in self._caches:
                raise AlreadyOpen(f"request {request_id!r} is already open on this stage")
            used = sum(c.nbytes for c in self._caches.values())
            if used + need > self.max_cache_bytes:
                raise CacheFull(
                    f"KV cache budget exhausted: need {need} bytes, {self.max_cache_bytes - used} free"
                )
            self._caches[request_id] = TreeKVCache(
                self.model.layer_range.size,
                cfg.num_kv_heads,
                cfg.head_dim,
                capacity,
                dtype=self.model.dtype,
                device=self.model.device,
            )
            if root_logits_only and self.is_last:
                self._held[request_id] = None
            if final_hidden and self.is_last:
                self._final_hidden.add(request_id)

    def release(self, request_id: str) -> bool:
        with self._lock:
            self._last_prune.pop(request_id, None)
            self._held.pop(request_id, None)
            self._final_hidden.discard(request_id)
            return self._caches.pop(request_id, None) is not None

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

    @torch.inference_mode()
    def forward_many(self, acts: Sequence[Activation]) -> list[StageOutput]:
        """Node-wise computation of one step: the rows of several requests in one batched
        forward (docs/architecture.md, "3. The pipeline step").

        For each activation, in order: the activation for the next stage (hidden states),
        or, on the last stage, logits for its tree nodes (none for a prefill chunk; only
        the roots', if any, for a `root_logits_only` request); None when nothing is left
        (nodes a prune already applied here has dropped arrived late, and are skipped); or
        the `RequestError` that request failed with, which fails no other request.
        """
        results: list[StageOutput] = [None] * len(acts)
        with self._compute_lock:
            batch: list[_Prepared] = []
            for i, act in enumerate(acts):
                try:
                    prepared = self._prepare(i, act)
                except RequestError as e:
                    results[i] = e
                    continue
                if prepared is not None:
                    batch.append(prepared)
            if not batch:
                return results
            try:
                hidden = self._run(batch)
            except Exception:
                for b in batch:
                    self._rollback(b.cache, b.act, b.start)
                raise
        need_logits: list[tuple[int, Activation]] = []  # rows whose hidden states go on
        for b, rows in zip(batch, _split(hidden, batch), strict=True):
            out: Activation | None = replace(b.act, tokens=None, hidden=rows, logits=None)
            if b.act.request_id not in self._caches:
                # Released while its rows were computed (cancelled, or its router gave
                # up): its output goes nowhere, and the others' must not suffer for it.
                results[b.index] = NotOpen(f"request {b.act.request_id!r} was released")
                continue
            if self.is_last and b.act.request_id not in self._final_hidden:
                if b.act.committed:
                    out.hidden = None  # type: ignore[union-attr]
                else:
                    if b.is_root is not None:
                        out = self._hold_later_rows(out, b.is_root)  # type: ignore[arg-type]
                    if out is not None:
                        need_logits.append((b.index, out))
                        continue
            results[b.index] = out
        if need_logits:  # one LM head GEMM over every request's rows
            outs = [out for _, out in need_logits]
            logits = self.model.logits(torch.cat([o.hidden for o in outs]))  # type: ignore[misc]
            for (index, out), lg in zip(
                need_logits, logits.split([len(o) for o in outs]), strict=True
            ):
                out.hidden, out.logits = None, lg
                results[index] = out
        return results

    def _prepare(self, index: int, act: Activation) -> _Prepared | None:
        """Check one request's rows and reserve their cache rows; None: nothing to run."""
        cache = self._cache(act.request_id)
        if len(act) == 0:
            return None
        last_prune = self._last_prune.get(act.request_id)
        if last_prune is not None:
            act = last_prune.filter(act)
            if act is None:
                return None
        if self.is_first and act.tokens is None:
            raise BadInput("the first stage needs token ids")
        if not self.is_first and act.hidden is None:
            raise BadInput("stages after the first need hidden states")
        is_root = None
        if act.request_id in self._held and not act.committed:
            # Rows whose parent is committed (not a cached or new tree row) are roots.
            tree = torch.cat([cache.tree_ids, act.node_ids])
            is_root = ~torch.isin(act.parent_ids, tree)
        if act.committed:
            start, mask = cache.append_committed(len(act))
        else:
            start, mask = cache.append_nodes(act.node_ids, act.parent_ids)
        return _Prepared(index, act, cache, start, mask, is_root)

    def _run(self, batch: Sequence[_Prepared]) -> Tensor:
        """One forward over the concatenated rows of `batch`."""
        device = self.model.device
        if self.is_first:
            tokens = torch.cat([b.act.tokens for b in batch])  # type: ignore[misc]
            hidden = self.model.embed(tokens.to(device))
        else:
            parts = [b.act.hidden.to(device=device, dtype=self.model.dtype) for b in batch]  # type: ignore[union-attr]
            hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
        positions = torch.cat([b.act.positions for b in batch]).to(device)
        segments, row = [], 0
        for b in batch:
            n = len(b.act)
            segments.append(Segment(slice(row, row + n), b.cache, b.start, b.mask.to(device)))
            row += n
        return self.model.forward_batch(hidden, positions, segments)

    def _hold_later_rows(self, out: Activation, is_root: Tensor) -> Activation | None:
        """`root_logits_only`: keep the root rows (their logits go out now); hold the other
        rows' final hidden states until a prune makes one of them the root."""
        later = (~is_root).nonzero().squeeze(1)
        if later.numel():
            with self._lock:
                if out.request_id not in self._held:  # released meanwhile
                    return None
                held = self._held[out.request_id]
                new = out.select(later)
                self._held[out.request_id] = new if held is None else _concat(held, new)
        roots = is_root.nonzero().squeeze(1)
        return out.select(roots) if roots.numel() else None

    def _logits_of(self, rows: Activation, idx: Tensor) -> Activation | None:
        """`rows` (holding final hidden states) restricted to `idx`, with their logits."""
        if idx.numel() == 0:
            return None
        out = rows.select(idx)
        assert out.hidden is not None
        out.logits, out.hidden = self.model.logits(out.hidden), None
        return out

    @staticmethod
    def _rollback(cache: TreeKVCache, act: Activation, start: int) -> None:
        """Undo the row reservation of a failed forward so the request stays consistent."""
        if act.committed:
            cache.n_committed = start
        else:
            keep = cache.tree_ids[: cache.num_tree_rows - len(act)]
            cache.prune(torch.empty(0, dtype=torch.int64), keep)

    @torch.inference_mode()
    def prune(self, request_id: str, prune: Prune) -> Activation | None:
        """Pruning propagation: commit verified nodes, drop the rest of the pruned tree.

        For a `root_logits_only` request on the last stage, returns the logits of held
        rows this prune made the root (their parent was committed), if any."""
        cache = self._cache(request_id)
        with self._compute_lock:
            cache.prune(prune.commit_ids, prune.keep_ids, prune.horizon)
            self._last_prune[request_id] = prune
            held = self._held.get(request_id)
            if held is None:
                return None
            held = prune.filter(held)
            if held is None:
                self._held[request_id] = None
                return None
            now_root = torch.isin(held.parent_ids, prune.commit_ids)
            later = (~now_root).nonzero().squeeze(1)
            self._held[request_id] = held.select(later) if later.numel() else None
            return self._logits_of(held, now_root.nonzero().squeeze(1))


def _concat(a: Activation, b: Activation) -> Activation:
    """Tree rows of two activations of one request, in order (hidden states only)."""
    assert a.hidden is not None and b.hidden is not None
    return Activation(
        request_id=a.request_id,
        positions=torch.cat([a.positions, b.positions]),
        node_ids=torch.cat([a.node_ids, b.node_ids]),
        parent_ids=torch.cat([a.parent_ids, b.parent_ids]),
        hidden=torch.cat([a.hidden, b.hidden]),
    )
