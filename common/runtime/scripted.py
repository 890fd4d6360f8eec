"""A pipeline whose target is a recorded greedy continuation: tree policies in minutes.

Under greedy decoding the controller only ever draws a token from the logits of a node
whose path is the target's own continuation (the root is verified, and verification
goes down to a child only if the child's token is the one drawn), so a pipeline that
knows that continuation gives exactly the real target's tokens, steps, hits and
misses, without running the target. Its "stages" only hold rows for S steps and apply
prunes; the last one gives every row whose path is the continuation a one-hot row of
the next token (other rows get token 0's; nothing draws from them).

`benchmarks/bench_layers.py --scripted` and `bench_tree_policy.py` use it to study
widths, rankings and layers per step with the real draft model at a fraction of the
cost (the continuation comes from one plain decoding of the real target; every run is
checked to emit exactly it). `tests/unit/test_scripted.py` checks that its tokens,
steps and per-stage rows equal the real pipeline's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..spec.messages import Activation, Prune
from ..spec.verify import VerifySpec
from .pipeline import StepResult


class ScriptedPipeline:
    """The `Pipeline` protocol over a known continuation `sequence` (prompt + output)."""

    def __init__(self, sequence: Sequence[int], num_stages: int, vocab_size: int) -> None:
        self.sequence = list(sequence)
        self._stages, self._vocab = num_stages, vocab_size
        self._flight: dict[str, list[Activation | None]] = {}
        # per request: node id -> whether the node's path is the continuation
        self._on_path: dict[str, dict[int, bool]] = {}

    @property
    def num_stages(self) -> int:
        return self._stages

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_context(self) -> int:
        return len(self.sequence) + 1

    def open(
        self,
        request_id: str,
        capacity: int,
        prefix_tokens: Sequence[int] = (),
        verify: VerifySpec | None = None,
    ) -> int:
        """`verify` is ignored: this pipeline returns logits (the controller walks them)."""
        self._flight[request_id] = [None] * (self._stages - 1)
        self._on_path[request_id] = {}
        return 0  # nothing cached: no K/V here

    def release(self, request_id: str) -> None:
        self._flight.pop(request_id, None)
        self._on_path.pop(request_id, None)

    def in_flight(self, request_id: str) -> bool:
        return any(a is not None for a in self._flight[request_id])

    def step_many(
        self, inputs: Mapping[str, tuple[Sequence[Prune], Activation | None]]
    ) -> dict[str, StepResult]:
        out = {}
        for rid, (prunes, entering) in inputs.items():
            held, on_path = self._flight[rid], self._on_path[rid]
            for prune in prunes:
                held = [prune.filter(a) for a in held]
                if on_path:  # forget pruned and committed nodes (new ones hang off live ones)
                    ids = torch.tensor(list(on_path))
                    self._on_path[rid] = on_path = {
                        i: on_path[i] for i in ids[prune.alive(ids)].tolist()
                    }
            if entering is not None and not entering.committed:
                self._admit(rid, entering)
            flight = [entering, *held]
            self._flight[rid] = flight[:-1]
            last = flight[-1]
            rows = [len(a) if a is not None else 0 for a in flight]
            if last is not None and not last.committed:
                last = self._logits(rid, last)
            elif last is not None:
                last = None  # a prefill chunk: nothing comes back
            out[rid] = StepResult(last=last, nodes_per_stage=rows)
        return out

    def _admit(self, rid: str, act: Activation) -> None:
        on_path = self._on_path[rid]
        seq = self.sequence
        for nid, pid, pos, tok in zip(
            act.node_ids.tolist(), act.parent_ids.tolist(), act.positions.tolist(),
            act.tokens.tolist(), strict=True,
        ):  # fmt: skip
            parent_ok = pid < 0 or on_path.get(pid, False)
            on_path[nid] = parent_ok and pos < len(seq) and seq[pos] == tok

    def _logits(self, rid: str, act: Activation) -> Activation:
        on_path = self._on_path[rid]
        seq = self.sequence
        nxt = [
            seq[p + 1] if on_path.get(n, False) and p + 1 < len(seq) else 0
            for n, p in zip(act.node_ids.tolist(), act.positions.tolist(), strict=True)
        ]
        logits = torch.zeros(len(act), self._vocab, dtype=torch.float32)
        logits[torch.arange(len(act)), torch.tensor(nxt)] = 1.0
        return Activation(
            request_id=act.request_id,
            positions=act.positions,
            node_ids=act.node_ids,
            parent_ids=act.parent_ids,
            logits=logits,
        )
