"""The in-process executor: every stage (and the draft) stepped in lockstep.

One executor of the request controller (docs/architecture.md, "5. The request controller
and its executors"): it carries out the controller's commands on a `Pipeline` and a
`Draft` in this process and steps the pipeline one step at a time, so the step counts are
real, and it records which rows every stage computed at every step (the trace that cost
projections and benchmarks use). Tests use it as the reference the services must match.
"""

from __future__ import annotations

import itertools
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence

import torch

from ..spec.commands import (
    BroadcastPrune,
    Command,
    DraftOpen,
    DraftPrefill,
    DraftPrune,
    Emit,
    Feed,
    Finish,
    Propose,
)
from ..spec.controller import Controller, make_controller
from ..spec.messages import Prune
from ..spec.options import DecodeOptions, Mode, check_context, check_prompt_ids
from ..spec.stats import DecodeStats
from .pipeline import Draft, Pipeline

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
        self.pipeline, self.opts = pipeline, opts
        self.request_id = request_id or f"req-{next(_request_counter)}"
        self.controller: Controller = make_controller(
            self.mode, self.request_id, prompt_ids, opts, pipeline.num_stages
        )
        if self.controller.uses_draft and draft is None:
            raise ValueError(f"mode {self.mode} needs a draft")
        self.draft = draft if self.controller.uses_draft else None

    @property
    def stats(self) -> DecodeStats:
        return self.controller.stats

    @property
    def output(self) -> list[int]:
        return self.controller.tokens

    def run(self) -> list[int]:
        for _ in self:
            pass
        return self.output

    def __iter__(self) -> Iterator[int]:
        ctrl = self.controller
        self.pipeline.open(self.request_id, ctrl.capacity)
        try:
            yield from self._execute()
        finally:
            self.pipeline.release(self.request_id)
            if self.draft is not None:
                self.draft.release(self.request_id)

    # -- the executor ----------------------------------------------------------------------
    def _execute(self) -> Iterator[int]:
        ctrl = self.controller
        # The accounting's steps are the real ones unless the controller counts another
        # pipeline depth (autoregressive: one stage, whatever pipeline runs it).
        exact = ctrl.num_stages == self.pipeline.num_stages
        cmds: deque[Command] = deque(ctrl.start())
        feeds: deque[Feed] = deque()
        prunes: list[Prune] = []
        draft_rows: dict[int, int] = defaultdict(int)
        step: int | None = None
        while True:
            while cmds:
                cmd = cmds.popleft()
                if isinstance(cmd, Emit):
                    yield from cmd.tokens
                elif isinstance(cmd, Finish):
                    if cmd.error:
                        raise RuntimeError(f"request {self.request_id} failed: {cmd.error}")
                    return
                elif isinstance(cmd, Feed):
                    feeds.append(cmd)
                elif isinstance(cmd, BroadcastPrune):
                    prunes.append(cmd.prune)
                elif isinstance(cmd, Propose):
                    if cmd.step is not None:
                        draft_rows[cmd.step] += len(cmd.layer)
                    cmds.extend(ctrl.on_candidates(cmd.ticket, self._propose(cmd)))
                else:
                    self._draft_command(cmd)
            if step is None:
                step = feeds[0].step if feeds else 0
            entering = None
            if feeds and feeds[0].step <= step:
                feed = feeds.popleft()
                if exact and feed.step != step:
                    raise RuntimeError(
                        f"step accounting: feed {feed.seq} entered at step {step}, "
                        f"the controller counted {feed.step}"
                    )
                entering = feed.act
            elif not feeds and not self.pipeline.in_flight(self.request_id):
                raise RuntimeError("pipeline desynchronized: nothing to compute, nothing emitted")
            result = self.pipeline.step(self.request_id, prunes, entering)
            prunes = []
            self.stats.trace.append([*result.nodes_per_stage, draft_rows.pop(step, 0)])
            step += 1
            last = result.last
            if last is not None and last.logits is not None:
                cmds.extend(ctrl.on_logits(last))
                if not any(isinstance(c, Emit) for c in cmds):
                    raise RuntimeError(
                        "pipeline desynchronized: the last stage did not compute the root"
                    )

    def _propose(self, cmd: Propose):
        assert self.draft is not None
        return self.draft.propose(cmd.layer, cmd.top_k, cmd.temperature)

    def _draft_command(self, cmd: Command) -> None:
        draft, rid = self.draft, self.request_id
        assert draft is not None
        if isinstance(cmd, DraftOpen):
            draft.open(rid, cmd.capacity)
            if len(cmd.prompt) > 1:
                prompt = torch.tensor(cmd.prompt[:-1], dtype=torch.int64)
                draft.prefill(rid, prompt, 0, cmd.prefill_chunk)
        elif isinstance(cmd, DraftPrune):
            draft.prune(rid, cmd.prune)
        elif isinstance(cmd, DraftPrefill):
            tokens = torch.tensor(cmd.tokens, dtype=torch.int64)
            draft.prefill(rid, tokens, cmd.start_position, cmd.prefill_chunk)
        else:
            raise TypeError(f"unknown command {cmd!r}")
