"""Decoding loops of the router/tree manager: specpipe, pp, specinfer and autoregressive.

Each loop drives a `Pipeline` (in-process or remote) and optionally a `Draft`, one
pipeline step at a time, and yields verified tokens as soon as they are known. Every
token is drawn from the target's distribution at its position with a draw that depends
only on (seed, position), so all modes emit the same tokens
(docs/architecture.md, "4. Modes and baselines").
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch

from ..spec.messages import Activation, Candidates, Prune
from ..spec.options import DecodeOptions, Mode, check_context, check_prompt_ids, tree_capacity
from ..spec.stats import DecodeStats
from ..spec.tree_manager import OutputState, SpecInferManager, SpecPipeManager, prefill_chunks
from .pipeline import Draft, Pipeline, StepResult

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
        check_prompt_ids(prompt_ids, pipeline.vocab_size)
        check_context(len(prompt_ids), opts.max_new_tokens, pipeline.max_context)
        if self.mode in (Mode.SPECPIPE, Mode.SPECINFER) and draft is None:
            raise ValueError(f"mode {self.mode} needs a draft")
        self.pipeline, self.opts = pipeline, opts
        self.draft = draft if self.mode in (Mode.SPECPIPE, Mode.SPECINFER) else None
        self.prompt = torch.tensor(list(prompt_ids), dtype=torch.int64)
        self.request_id = request_id or f"req-{next(_request_counter)}"
        width = opts.width if self.draft is not None else 0
        self.stats = DecodeStats(mode=self.mode.value, stages=pipeline.num_stages, width=width)
        self.out = OutputState(opts.max_new_tokens, opts.sampling, opts.stop_token_ids)
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

    @property
    def output(self) -> list[int]:
        return self.out.tokens

    def run(self) -> list[int]:
        for _ in self:
            pass
        return self.output

    # -- loops ---------------------------------------------------------------------------
    def _step(
        self, prune: Prune | None, entering: Activation | None, draft_rows: int = 0
    ) -> StepResult:
        result = self.pipeline.step(self.request_id, prune, entering)
        self.stats.trace.append([*result.nodes_per_stage, draft_rows])
        return result

    def _prefill(self) -> None:
        """Verified prompt tokens (all but the last, which is the first root) through the stages."""
        for chunk in prefill_chunks(self.request_id, self.prompt.tolist(), self.opts.prefill_chunk):
            self._step(None, chunk)
            self.stats.prefill_steps += 1
        if self.draft is not None and self.prompt.numel() > 1:
            self.draft.prefill(self.request_id, self.prompt[:-1], 0, self.opts.prefill_chunk)

    def _emitted(self, tokens: list[int]) -> Iterator[int]:
        self.stats.new_tokens += len(tokens)
        self.stats.emit_steps += [self.stats.decode_steps] * len(tokens)
        self.stats.hits = self.out.hits
        self.stats.finish_reason = self.out.finish_reason
        yield from tokens

    def _specpipe(self) -> Iterator[int]:
        """Lockstep: each step, verify what left the last stage, then feed the next layer.

        Without a draft the tree is only ever its root, which is plain pipeline decoding
        (one token per S steps); with one stage it is plain autoregressive decoding.
        """
        width = self.opts.width if self.draft is not None else 0
        mgr = SpecPipeManager(
            self.request_id, self.prompt.tolist(), self.out, width, self.pipeline.num_stages
        )
        entering: Activation | None = mgr.root_layer()
        prune: Prune | None = None
        while True:
            draft_rows = len(entering) if self.draft is not None and entering is not None else 0
            result = self._step(prune, entering, draft_rows)
            self.stats.decode_steps += 1
            cand = self._propose(entering, prune)
            prune, entering = None, None
            last = result.last
            if last is not None and last.logits is not None:
                if not mgr.is_root(last):
                    raise RuntimeError(
                        "pipeline desynchronized: last stage did not compute the root"
                    )
                verdict = mgr.verify(last.logits[0])
                self.stats.verifications = mgr.verifications
                self.stats.root_children = mgr.root_children
                yield from self._emitted(verdict.tokens)
                if verdict.done:
                    return
                prune, entering = verdict.prune, verdict.restart
            if entering is None:
                entering = mgr.grow(cand)
                self.stats.regrowths = mgr.regrowths

    def _propose(self, layer: Activation | None, prune: Prune | None) -> Candidates:
        """Draft phase of a step: apply last step's prune, expand the layer entering stage 1."""
        if self.draft is None:
            return Candidates.empty()
        if prune is not None:
            self.draft.prune(self.request_id, prune)
        if layer is None or layer.committed:
            return Candidates.empty()
        k = min(self.opts.top_k_children, self.opts.width)
        return self.draft.propose(layer, k, self.opts.sampling.temperature)

    def _specinfer(self) -> Iterator[int]:
        """Per pass: the draft grows a whole tree, the tree crosses all S stages (S steps),
        the longest verified path plus one token is emitted."""
        assert self.draft is not None
        mgr = SpecInferManager(
            self.request_id,
            self.prompt.tolist(),
            self.out,
            self.opts.width,
            self.opts.specinfer_depth,
        )
        k = min(self.opts.top_k_children, self.opts.width)
        prune: Prune | None = None
        while True:
            if mgr.unseen_by_draft:
                start = mgr.root_pos - len(mgr.unseen_by_draft)
                unseen = torch.tensor(mgr.unseen_by_draft)
                self.draft.prefill(self.request_id, unseen, start, self.opts.prefill_chunk)
                mgr.unseen_by_draft = []
            self.stats.draft_layers.append([])
            while (layer := mgr.draft_layer()) is not None:
                self.stats.draft_layers[-1].append(len(layer))
                cand = self.draft.propose(layer, k, self.opts.sampling.temperature)
                if not mgr.grow(cand):
                    break
            whole = mgr.whole_tree()
            result = self._step(prune, whole, draft_rows=len(whole))
            for _ in range(self.pipeline.num_stages - 1):
                result = self._step(None, None)
            self.stats.decode_steps += self.pipeline.num_stages
            if result.last is None:
                raise RuntimeError("pipeline desynchronized: the tree did not leave the last stage")
            verdict = mgr.verify(result.last)
            self.stats.verifications = mgr.verifications
            self.stats.root_children = mgr.root_children
            self.stats.accepted_lengths = mgr.accepted_lengths
            yield from self._emitted(verdict.tokens)
            if verdict.done:
                return
            prune = verdict.prune
            assert verdict.draft_prune is not None
            self.draft.prune(self.request_id, verdict.draft_prune)
