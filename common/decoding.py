"""Decoding loops of the router/tree manager: specpipe, pp, specinfer and autoregressive.

Each loop drives a `Pipeline` (in-process or remote) and optionally a `Draft`, one
pipeline step at a time, and yields verified tokens as soon as they are known. Every
token is drawn from the target's distribution at its position with a draw that depends
only on (seed, position), so all modes emit the same tokens (DESIGN 2.2).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch import Tensor

from .messages import EMPTY_IDS, Activation, Prune
from .pipeline import Draft, Pipeline, StepResult
from .sampling import SamplingParams, sample_token
from .tree import TokenTree


class Mode(StrEnum):
    SPECPIPE = "specpipe"
    PP = "pp"
    SPECINFER = "specinfer"
    AUTOREGRESSIVE = "autoregressive"


@dataclass(frozen=True)
class DecodeOptions:
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    width: int = 8  # tree nodes kept per layer
    top_k_children: int = 4  # draft candidates per node
    specinfer_depth: int = 8  # layers of a SpecInfer tree
    prefill_chunk: int = 128
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.width < 1 or self.top_k_children < 1 or self.specinfer_depth < 1:
            raise ValueError("width, top_k_children and specinfer_depth must be >= 1")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")


@dataclass
class DecodeStats:
    mode: str
    stages: int
    width: int
    prefill_steps: int = 0
    decode_steps: int = 0
    new_tokens: int = 0
    verifications: int = 0  # root verifications (specpipe/pp) or tree passes (specinfer)
    hits: int = 0  # emitted tokens that were already in the tree when verified
    finish_reason: str = "length"
    root_children: list[int] = field(
        default_factory=list
    )  # children of the root at each verification
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted per specinfer pass
    trace: list[list[int]] = field(
        default_factory=list
    )  # per step: rows per stage, then draft rows

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.decode_steps if self.decode_steps else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.new_tokens if self.new_tokens else 0.0

    def summary(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "stages": self.stages,
            "width": self.width,
            "prefill_steps": self.prefill_steps,
            "decode_steps": self.decode_steps,
            "new_tokens": self.new_tokens,
            "tokens_per_step": round(self.tokens_per_step, 6),
            "hit_rate": round(self.hit_rate, 6),
        }


def tree_capacity(mode: Mode, stages: int, opts: DecodeOptions) -> int:
    """Upper bound on tree rows a stage or the draft caches at once for this mode."""
    if mode == Mode.SPECPIPE:
        return (stages + 2) * opts.width + 2
    if mode == Mode.SPECINFER:
        return opts.specinfer_depth * opts.width + 2
    return 2


_request_counter = itertools.count()


class Generation:
    """One request's decoding; iterate to receive verified token ids as they are emitted."""

    def __init__(
        self,
        pipeline: Pipeline,
        draft: Draft | None,
        prompt_ids: Sequence[int],
        mode: Mode | str,
        opts: DecodeOptions,
        request_id: str | None = None,
    ) -> None:
        self.mode = Mode(mode)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = pipeline.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:4]} are outside the vocabulary [0, {vocab})")
        if self.mode in (Mode.SPECPIPE, Mode.SPECINFER) and draft is None:
            raise ValueError(f"mode {self.mode} needs a draft")
        self.pipeline, self.opts = pipeline, opts
        self.draft = draft if self.mode in (Mode.SPECPIPE, Mode.SPECINFER) else None
        self.prompt = torch.tensor(list(prompt_ids), dtype=torch.int64)
        self.request_id = request_id or f"req-{next(_request_counter)}"
        width = opts.width if self.draft is not None else 0
        self.stats = DecodeStats(mode=self.mode.value, stages=pipeline.num_stages, width=width)
        self.output: list[int] = []
        self.capacity = (
            len(prompt_ids)
            + opts.max_new_tokens
            + tree_capacity(self.mode, pipeline.num_stages, opts)
        )

    # -- public ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        self.pipeline.open(self.request_id, self.capacity)
        try:
            if self.draft is not None:
                self.draft.open(self.request_id, self.capacity)
            self._prefill()
            if self.mode == Mode.SPECINFER:
                yield from self._specinfer()
            else:
                yield from self._specpipe()
        finally:
            self.pipeline.release(self.request_id)
            if self.draft is not None:
                self.draft.release(self.request_id)

    def run(self) -> list[int]:
        for _ in self:
            pass
        return self.output

    # -- shared pieces -----------------------------------------------------------------
    def _step(
        self, prune: Prune | None, entering: Activation | None, draft_rows: int = 0
    ) -> StepResult:
        result = self.pipeline.step(self.request_id, prune, entering)
        self.stats.trace.append([*result.nodes_per_stage, draft_rows])
        return result

    def _prefill(self) -> None:
        """Verified prompt tokens (all but the last, which is the first root) through the stages."""
        body = self.prompt[:-1]
        chunk = self.opts.prefill_chunk
        for s in range(0, body.numel(), chunk):
            part = body[s : s + chunk]
            act = Activation(
                request_id=self.request_id,
                positions=torch.arange(s, s + part.numel()),
                committed=True,
                tokens=part,
            )
            self._step(None, act)
            self.stats.prefill_steps += 1
        if self.draft is not None and body.numel():
            self.draft.prefill(self.request_id, body, 0, chunk)

    def _emit(self, token: int) -> bool:
        """Record a verified token; True when generation must stop."""
        self.output.append(token)
        self.stats.new_tokens += 1
        if token in self.opts.stop_token_ids:
            self.stats.finish_reason = "stop"
            return True
        return len(self.output) >= self.opts.max_new_tokens

    def _sample(self, logits: Tensor) -> int:
        return sample_token(logits, self.opts.sampling, len(self.output))

    def _layer(self, tree: TokenTree, idx: Tensor, root_pos: int) -> Activation:
        parents = tree.parent[idx]
        parent_ids = torch.where(parents >= 0, tree.ids[parents.clamp(min=0)], -1)
        return Activation(
            request_id=self.request_id,
            positions=root_pos + tree.depth[idx],
            node_ids=tree.ids[idx],
            parent_ids=parent_ids,
            tokens=tree.tokens[idx],
        )

    def _propose(
        self, layer: Activation | None, prune: Prune | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Draft phase of a step: apply last step's prune, expand the layer entering stage 1."""
        if self.draft is None:
            return EMPTY_IDS, EMPTY_IDS, torch.empty(0)
        if prune is not None:
            self.draft.prune(self.request_id, prune)
        if layer is None or layer.committed:
            return EMPTY_IDS, EMPTY_IDS, torch.empty(0)
        k = min(self.opts.top_k_children, self.opts.width)
        c = self.draft.propose(layer, k, self.opts.sampling.temperature)
        return c.parent_ids, c.tokens, c.probs

    @staticmethod
    def _grow(
        tree: TokenTree, parent_ids: Tensor, tokens: Tensor, probs: Tensor, width: int
    ) -> Tensor:
        """Append the best `width` candidates whose parents are still in the tree."""
        match = parent_ids[:, None] == tree.ids[None, :]
        alive = match.any(dim=1)
        if not bool(alive.any()):
            return EMPTY_IDS
        parents = match[alive].to(torch.int8).argmax(dim=1)
        return tree.append_layer(parents, tokens[alive], probs[alive], width)

    # -- specpipe / pp / autoregressive ------------------------------------------------
    def _specpipe(self) -> Iterator[int]:
        """One tree layer enters stage 1 per step; the root is verified at the last stage.

        Without a draft the tree is only ever its root, which is plain pipeline decoding
        (one token per S steps); with one stage it is plain autoregressive decoding.
        """
        root_pos = self.prompt.numel() - 1
        tree = TokenTree(int(self.prompt[-1]))
        entering: Activation | None = self._layer(tree, torch.tensor([0]), root_pos)
        prune: Prune | None = None
        while True:
            result = self._step(
                prune, entering, draft_rows=len(entering) if self.draft and entering else 0
            )
            self.stats.decode_steps += 1
            cand = self._propose(entering, prune)
            prune, missed = None, False
            last = result.last
            if last is not None and last.logits is not None:
                if last.node_ids.tolist() != [tree.root_id]:
                    raise RuntimeError(
                        "pipeline desynchronized: last stage did not compute the root"
                    )
                token = self._sample(last.logits[0])
                child = tree.child_with_token(0, token)
                self.stats.verifications += 1
                self.stats.root_children.append(int(tree.children(0).numel()))
                old_root = torch.tensor([tree.root_id])
                if child is not None:
                    self.stats.hits += 1
                    tree.prune_to(child)
                    prune = Prune(commit_ids=old_root, keep_ids=tree.ids.clone())
                else:
                    tree.reset(token)
                    prune = Prune(commit_ids=old_root, keep_ids=EMPTY_IDS)
                    missed = True
                root_pos += 1
                done = self._emit(token)
                yield token
                if done:
                    return
            if missed:
                entering = self._layer(tree, torch.tensor([0]), root_pos)
            else:
                new = self._grow(tree, *cand, self.opts.width)
                entering = self._layer(tree, new, root_pos) if new.numel() else None

    # -- specinfer ---------------------------------------------------------------------
    def _specinfer(self) -> Iterator[int]:
        """The draft grows a whole tree, it crosses all stages in one pass (S steps), the
        longest verified path plus one token is emitted."""
        assert self.draft is not None
        root_pos = self.prompt.numel() - 1
        root_token = int(self.prompt[-1])
        prune: Prune | None = None
        prune_for_draft: Prune | None = None
        next_id = 0
        unseen_by_draft: list[int] = []  # verified tokens the draft still has to cache
        while True:
            tree = TokenTree(root_token, first_id=next_id)
            if prune_for_draft is not None:
                self.draft.prune(self.request_id, prune_for_draft)
            if unseen_by_draft:
                start = root_pos - len(unseen_by_draft)
                self.draft.prefill(
                    self.request_id, torch.tensor(unseen_by_draft), start, self.opts.prefill_chunk
                )
                unseen_by_draft = []
            draft_computed = []
            for _ in range(self.opts.specinfer_depth):
                frontier = tree.frontier()
                layer = self._layer(tree, frontier, root_pos)
                k = min(self.opts.top_k_children, self.opts.width)
                c = self.draft.propose(layer, k, self.opts.sampling.temperature)
                draft_computed.append(layer.node_ids)
                if self._grow(tree, c.parent_ids, c.tokens, c.probs, self.opts.width).numel() == 0:
                    break
            next_id = int(tree.ids.max()) + 1
            whole = self._layer(tree, torch.arange(len(tree)), root_pos)
            result = self._step(prune, whole, draft_rows=len(tree))
            for _ in range(self.pipeline.num_stages - 1):
                result = self._step(None, None)
            self.stats.decode_steps += self.pipeline.num_stages
            last = result.last
            if last is None or last.logits is None or not torch.equal(last.node_ids, tree.ids):
                raise RuntimeError(
                    "pipeline desynchronized: the tree did not come out of the last stage"
                )

            path = [0]
            self.stats.verifications += 1
            self.stats.root_children.append(int(tree.children(0).numel()))
            emitted = 0
            while True:
                token = self._sample(last.logits[path[-1]])
                emitted += 1
                done = self._emit(token)
                yield token
                child = tree.child_with_token(path[-1], token)
                if child is None or done:
                    break
                self.stats.hits += 1
                path.append(child)
            self.stats.accepted_lengths.append(emitted)
            if done:
                return
            path_ids = tree.ids[torch.tensor(path)]
            prune = Prune(commit_ids=path_ids, keep_ids=EMPTY_IDS)
            seen = torch.isin(path_ids, torch.cat(draft_computed))
            prune_for_draft = Prune(commit_ids=path_ids[seen], keep_ids=EMPTY_IDS)
            unseen_by_draft = tree.tokens[torch.tensor(path)][~seen].tolist()
            root_pos += len(path)
            root_token = token
