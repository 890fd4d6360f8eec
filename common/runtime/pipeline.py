"""The pipeline the lockstep executor steps: the interface, and the in-process
implementation (the network router drives the services instead: services/router/).

One call to `step` is one pipeline step for one request
(docs/architecture.md, "3. The pipeline step"; phases in the order the network version
runs them): apply the prunes decided since the previous step to every stage's cache and
to the activations in flight, move surviving activations one stage forward with the new tree
layer entering stage 1, then let every stage compute. The last stage verifies the roots it computes
(`verifier.py`, as the stage service does) and its `Verified` messages come back to the
router.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from ..spec.messages import Activation, Candidates, Prune, Verified
from ..spec.verify import VerifySpec
from .stage import StageRuntime
from .verifier import RequestVerifier, row_tokens_of, verify_many


@dataclass
class StepResult:
    nodes_per_stage: list[int]  # rows each stage computed this step (for cost projection)
    verified: tuple[Verified, ...] = ()  # what the last stage verified this step


def verify_round(
    outputs: Mapping[str, tuple[RequestVerifier, Activation]], logits: Callable[[Tensor], Tensor]
) -> dict[str, tuple[Verified, ...]]:
    """What the last stage verified of each request's output this step (`verify_many`:
    one LM head call); a bad output raises its ValueError (an in-process bug)."""
    drawn = verify_many(list(outputs.values()), logits)
    verified = {}
    for rid, found in zip(outputs, drawn, strict=True):
        if isinstance(found, ValueError):
            raise found
        verified[rid] = tuple(found)
    return verified


class Pipeline(Protocol):
    @property
    def num_stages(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    def open(
        self,
        request_id: str,
        capacity: int,
        prefix_tokens: Sequence[int],
        verify: VerifySpec,
    ) -> int:
        """Open the request on every stage; how many leading `prefix_tokens` (what it
        commits before its first root) every stage holds cached (its prefill starts
        there). The last stage verifies it as `verify` says."""
        ...

    def release(self, request_id: str) -> None: ...

    def in_flight(self, request_id: str) -> bool:
        """Whether rows of the request are between stages (a later step computes them)."""
        ...

    def step_many(
        self, inputs: Mapping[str, tuple[Sequence[Prune], Activation | None]]
    ) -> dict[str, StepResult]:
        """One step of every request in `inputs` (prunes to apply, rows entering stage 1)."""
        ...


class Draft(Protocol):
    def open(self, request_id: str, capacity: int, prompt: Sequence[int] = ()) -> int:
        """Open the request; how many leading tokens of `prompt` (all but the first
        root) the draft holds cached (the caller prefills the rest)."""
        ...

    def release(self, request_id: str) -> bool: ...

    def prefill(
        self, request_id: str, tokens: Tensor, start_position: int, chunk_size: int
    ) -> None: ...

    def propose(self, layer: Activation, top_k: int, temperature: float = 0.0) -> Candidates: ...

    def prune(self, request_id: str, prune: Prune) -> None: ...


class LocalPipeline:
    """All stages in this process; activations in flight are held here between steps."""

    def __init__(self, stages: list[StageRuntime]) -> None:
        if not stages or not stages[0].is_first or not stages[-1].is_last:
            raise ValueError("stages must cover the model from embedding to LM head")
        for a, b in itertools.pairwise(stages):
            if a.model.layer_range.end != b.model.layer_range.start:
                raise ValueError("stage layer ranges must be contiguous")
        self.stages = stages
        self._in_flight: dict[str, list[Activation | None]] = {}
        self._verifiers: dict[str, RequestVerifier] = {}

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def vocab_size(self) -> int:
        return self.stages[-1].model.cfg.vocab_size

    @property
    def max_context(self) -> int:
        return self.stages[0].model.cfg.max_position_embeddings

    def open(
        self,
        request_id: str,
        capacity: int,
        prefix_tokens: Sequence[int],
        verify: VerifySpec,
    ) -> int:
        opened: list[StageRuntime] = []
        cached: list[int] = []
        try:
            for s in self.stages:
                cached.append(s.open(request_id, capacity, prefix_tokens=prefix_tokens))
                opened.append(s)
        except Exception:
            for s in opened:
                s.release(request_id)
            raise
        self._in_flight[request_id] = [None] * (len(self.stages) - 1)
        self._verifiers[request_id] = RequestVerifier(
            request_id, verify, self.stages[-1].model.logits, prefix_tokens
        )
        return min(cached)

    def release(self, request_id: str) -> None:
        for s in self.stages:
            s.release(request_id)
        self._in_flight.pop(request_id, None)
        self._verifiers.pop(request_id, None)

    def in_flight(self, request_id: str) -> bool:
        return any(a is not None for a in self._in_flight[request_id])

    def step_many(
        self, inputs: Mapping[str, tuple[Sequence[Prune], Activation | None]]
    ) -> dict[str, StepResult]:
        """One step for several requests: their prunes, then every stage runs the rows of
        all of them in one batched forward (SpecPipe-DB)."""
        flight: dict[str, list[Activation | None]] = {}
        for rid, (prunes, entering) in inputs.items():
            held = self._in_flight[rid]
            verifier = self._verifiers[rid]
            for prune in prunes:
                for s in self.stages:
                    s.prune(rid, prune)
                verifier.on_prune(prune)
                held = [prune.filter(a) for a in held]
            flight[rid] = [entering, *held]  # the input of every stage this step
        outputs: dict[str, list[Activation | None]] = {rid: [] for rid in inputs}
        for k, stage in enumerate(self.stages):
            rids = [rid for rid in inputs if flight[rid][k] is not None]
            results = stage.forward_many([flight[rid][k] for rid in rids])  # type: ignore[misc]
            done = dict(zip(rids, results, strict=True))
            for rid in inputs:
                out = done.get(rid)
                if isinstance(out, Exception):
                    raise out
                if out is not None:
                    out.row_tokens = row_tokens_of(out, flight[rid][k])  # type: ignore[arg-type]
                outputs[rid].append(out)
        verifying = {
            rid: (self._verifiers[rid], out)
            for rid in inputs
            if (out := outputs[rid][-1]) is not None
        }
        verified = verify_round(verifying, self.stages[-1].model.logits)
        result = {}
        for rid in inputs:
            self._in_flight[rid] = outputs[rid][:-1]
            rows = [len(a) if a is not None else 0 for a in flight[rid]]
            result[rid] = StepResult(rows, verified.get(rid, ()))
        return result


__all__ = ["Draft", "LocalPipeline", "Pipeline", "StepResult", "verify_round"]
