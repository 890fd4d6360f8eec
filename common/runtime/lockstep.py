"""The in-process executor: every stage (and the draft) stepped in lockstep.

One executor of the request controller (docs/architecture.md, "5. The request controller
and its executors"): it carries out the controllers' commands on a `Pipeline` and a
`Draft` in this process and steps the pipeline one step at a time for every active
request together (SpecPipe-DB: each stage runs all requests' rows in one batched
forward). Requests join and leave at step boundaries. Step counts are real, and it
records which rows every stage computed at every step, per request and in total, and
the rows of each draft forward (the traces that cost projections and benchmarks use). Tests use it as the reference the
services must match; `LockstepGeneration` is one request on an engine of its own.
"""

from __future__ import annotations

import itertools
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

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
from ..spec.messages import Activation, Prune, after_prunes
from ..spec.options import (
    DecodeOptions,
    Mode,
    check_context,
    check_logit_bias,
    check_prompt_ids,
)
from ..spec.stats import DecodeStats
from .pipeline import Draft, Pipeline

_request_counter = itertools.count()


@dataclass
class Run:
    """One request on the engine: its controller and the commands in flight."""

    controller: Controller
    cmds: deque[Command] = field(default_factory=deque)
    feeds: deque[Feed] = field(default_factory=deque)
    prunes: list[Prune] = field(default_factory=list)
    draft_rows: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    step: int | None = None  # this request's next step in its own accounting
    emitted: list[int] = field(default_factory=list)  # tokens not yet taken by the caller
    done: bool = False

    @property
    def request_id(self) -> str:
        return self.controller.request_id

    @property
    def stats(self) -> DecodeStats:
        return self.controller.stats

    @property
    def tokens(self) -> list[int]:
        return self.controller.tokens


def new_controller(
    pipeline: Pipeline,
    prompt_ids: Sequence[int],
    mode: Mode | str,
    opts: DecodeOptions,
    request_id: str | None = None,
) -> Controller:
    """The controller of a request on `pipeline`, its prompt checked first."""
    check_prompt_ids(prompt_ids, pipeline.vocab_size)
    check_logit_bias(opts.sampling, pipeline.vocab_size)
    check_context(len(prompt_ids), opts.max_new_tokens, pipeline.max_context)
    rid = request_id or f"req-{next(_request_counter)}"
    return make_controller(mode, rid, prompt_ids, opts, pipeline.num_stages)


def add_forwards(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """Two requests' draft forwards of one step, batched: the j-th forwards together."""
    n = max(len(a), len(b))
    return [(a[j] if j < len(a) else 0) + (b[j] if j < len(b) else 0) for j in range(n)]


class LockstepEngine:
    def __init__(self, pipeline: Pipeline, draft: Draft | None) -> None:
        self.pipeline, self.draft = pipeline, draft
        self.runs: dict[str, Run] = {}
        self.steps = 0
        # per engine step: rows each stage computed over all requests, then the draft's
        self.trace: list[list[int]] = []
        # per engine step: the rows of each draft forward over all requests (the j-th
        # forwards of all requests are one batched forward)
        self.draft_forwards: list[list[int]] = []

    def add(
        self,
        prompt_ids: Sequence[int],
        mode: Mode | str,
        opts: DecodeOptions,
        request_id: str | None = None,
    ) -> Run:
        """A new request; it joins at the next step."""
        return self.add_controller(
            new_controller(self.pipeline, prompt_ids, mode, opts, request_id)
        )

    def add_controller(self, ctrl: Controller) -> Run:
        if ctrl.uses_draft and self.draft is None:
            raise ValueError(f"mode {ctrl.mode} needs a draft")
        ctrl.cached_prefix = self.pipeline.open(
            ctrl.request_id, ctrl.capacity, ctrl.committed_before_root, verify=ctrl.verify_spec
        )
        run = Run(ctrl, deque(ctrl.start()))
        self.runs[ctrl.request_id] = run
        return run

    def release(self, run: Run) -> None:
        if self.runs.pop(run.request_id, None) is None:
            return
        run.done = True
        self.pipeline.release(run.request_id)
        if self.draft is not None and run.controller.uses_draft:
            self.draft.release(run.request_id)

    # -- one step ----------------------------------------------------------------------
    def step(self) -> None:
        """Carry out every request's commands, then one pipeline step for all of them."""
        for run in list(self.runs.values()):
            self._execute(run)
        active = list(self.runs.values())
        if not active:
            return
        inputs = {run.request_id: (run.prunes, self._entering(run)) for run in active}
        results = self.pipeline.step_many(inputs)
        total = [0] * (self.pipeline.num_stages + 1)
        batched: list[int] = []
        for run in active:
            result = results[run.request_id]
            assert run.step is not None
            forwards = run.draft_rows.pop(run.step, [])
            row = [*result.nodes_per_stage, sum(forwards)]
            run.stats.trace.append(row)
            run.stats.draft_forwards.append(forwards)
            total = [a + b for a, b in zip(total, row, strict=True)]
            batched = add_forwards(batched, forwards)
            run.prunes = []
            run.step += 1
            for verified in result.verified:
                cmds = run.controller.on_verified(verified)
                if not any(isinstance(c, Emit) for c in cmds):
                    raise RuntimeError(
                        "pipeline desynchronized: the last stage did not compute the root"
                    )
                run.cmds.extend(cmds)
        self.trace.append(total)
        self.draft_forwards.append(batched)
        self.steps += 1

    def _execute(self, run: Run) -> None:
        ctrl = run.controller
        while run.cmds and not run.done:
            cmd = run.cmds.popleft()
            if isinstance(cmd, Emit):
                run.emitted.extend(cmd.tokens)
            elif isinstance(cmd, Finish):
                self.release(run)
                if cmd.error:
                    raise RuntimeError(f"request {run.request_id} failed: {cmd.error}")
            elif isinstance(cmd, Feed):
                run.feeds.append(cmd)
            elif isinstance(cmd, BroadcastPrune):
                run.prunes.append(cmd.prune)
            elif isinstance(cmd, Propose):
                if cmd.step is not None:
                    # An ask for a step already computed (the chain of K layers grown
                    # after a verification, between two steps) runs beside the next one.
                    step = cmd.step if run.step is None else max(cmd.step, run.step)
                    run.draft_rows[step].append(len(cmd.layer))
                assert self.draft is not None
                cand = self.draft.propose(cmd.layer, cmd.top_k, cmd.temperature)
                run.cmds.extend(ctrl.on_candidates(cmd.ticket, cand))
            else:
                self._draft_command(run.request_id, cmd)

    def _entering(self, run: Run) -> Activation | None:
        """The rows entering stage 1 this step for `run` (the controller's accounting is
        the real step, unless it counts another pipeline depth: autoregressive)."""
        if run.step is None:
            run.step = run.feeds[0].step if run.feeds else 0
        feeds = run.feeds
        while (
            feeds and feeds[0].step <= run.step and after_prunes(run.prunes, feeds[0].act) is None
        ):
            feeds.popleft()  # a layer fed ahead that a verification dropped whole (eager)
        if feeds and feeds[0].step <= run.step:
            feed = feeds.popleft()
            if run.controller.num_stages == self.pipeline.num_stages and feed.step != run.step:
                raise RuntimeError(
                    f"step accounting: feed {feed.seq} entered at step {run.step}, "
                    f"the controller counted {feed.step}"
                )
            return feed.act
        if not feeds and not self.pipeline.in_flight(run.request_id):
            raise RuntimeError("pipeline desynchronized: nothing to compute, nothing emitted")
        return None

    def _draft_command(self, rid: str, cmd: Command) -> None:
        draft = self.draft
        assert draft is not None
        if isinstance(cmd, DraftOpen):
            cached = draft.open(rid, cmd.capacity, cmd.prompt[:-1])
            if len(cmd.prompt) - 1 > cached:
                prompt = torch.tensor(cmd.prompt[cached:-1], dtype=torch.int64)
                draft.prefill(rid, prompt, cached, cmd.prefill_chunk)
        elif isinstance(cmd, DraftPrune):
            draft.prune(rid, cmd.prune)
        elif isinstance(cmd, DraftPrefill):
            tokens = torch.tensor(cmd.tokens, dtype=torch.int64)
            draft.prefill(rid, tokens, cmd.start_position, cmd.prefill_chunk)
        else:
            raise TypeError(f"unknown command {cmd!r}")


class LockstepGeneration:
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
        self.controller = new_controller(pipeline, prompt_ids, mode, opts, request_id)
        self.mode, self.request_id = self.controller.mode, self.controller.request_id
        if self.controller.uses_draft and draft is None:
            raise ValueError(f"mode {self.mode} needs a draft")
        self.pipeline, self.draft = pipeline, draft if self.controller.uses_draft else None

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
        engine = LockstepEngine(self.pipeline, self.draft)
        run = engine.add_controller(self.controller)
        try:
            while True:
                engine._execute(run)
                yield from run.emitted
                run.emitted.clear()
                if run.done:
                    return
                engine.step()
        finally:
            engine.release(run)
