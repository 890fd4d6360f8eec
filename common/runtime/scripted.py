"""A pipeline whose target is a recorded greedy continuation: tree policies in minutes.

Under greedy decoding the last stage only ever draws a token from the logits of a node
whose path is the target's own continuation (the root is verified, and verification
goes down to a child only if the child's token is the one drawn), so a pipeline that
knows that continuation gives exactly the real target's tokens, steps, hits and
misses, without running the target. Its "stages" only hold rows for S steps and apply
prunes; the last one gives every row whose path is the continuation (and every prefill
row) a one-hot row of the next token as its final hidden state (other rows token 0's;
nothing draws from them), which the real verification (`verifier.py`) walks with an
identity LM head (`IdentityHeadStage`).

`benchmarks/bench_layers.py --scripted` and `bench_tree_policy.py` use it to study
widths, rankings and layers per step with the real draft model at a fraction of the
cost (the continuation comes from one plain decoding of the real target; every run is
checked to emit exactly it). `tests/unit/test_scripted.py` checks that its tokens,
steps and per-stage rows equal the real pipeline's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ..spec.messages import Activation, Prune, Verified
from ..spec.verify import VerifySpec
from .pipeline import StepResult, verify_round
from .verifier import RequestVerifier


def identity_head(hidden: Tensor) -> Tensor:
    """The LM head of rows whose final hidden states are already their logits."""
    return hidden


class IdentityHeadStage:
    """The last stage's verification (`RequestVerifier`, one round by `verify_round`) for
    model-free pipelines whose final hidden states are logits [rows, vocab]: they verify
    through the same walk, draws and rules as the real last stage."""

    def __init__(self) -> None:
        self._verifiers: dict[str, RequestVerifier] = {}

    def open(self, request_id: str, verify: VerifySpec, prefix_tokens: Sequence[int]) -> None:
        self._verifiers[request_id] = RequestVerifier(
            request_id, verify, identity_head, prefix_tokens
        )

    def release(self, request_id: str) -> None:
        self._verifiers.pop(request_id, None)

    def prune(self, request_id: str, prune: Prune) -> None:
        self._verifiers[request_id].on_prune(prune)

    def verify(self, outputs: Mapping[str, Activation]) -> dict[str, tuple[Verified, ...]]:
        """Each request's verifications of its last-stage rows (`hidden`: their logits;
        `row_tokens`: their token ids) this step."""
        return verify_round(
            {rid: (self._verifiers[rid], out) for rid, out in outputs.items()}, identity_head
        )


class ScriptedPipeline:
    """The `Pipeline` protocol over a known continuation `sequence` (prompt + output)."""

    def __init__(self, sequence: Sequence[int], num_stages: int, vocab_size: int) -> None:
        self.sequence = list(sequence)
        self._stages, self._vocab = num_stages, vocab_size
        self._flight: dict[str, list[Activation | None]] = {}
        # per request: node id -> whether the node's path is the continuation
        self._on_path: dict[str, dict[int, bool]] = {}
        self._last = IdentityHeadStage()

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
        self, request_id: str, capacity: int, prefix_tokens: Sequence[int], verify: VerifySpec
    ) -> int:
        self._flight[request_id] = [None] * (self._stages - 1)
        self._on_path[request_id] = {}
        self._last.open(request_id, verify, prefix_tokens)
        return 0  # nothing cached: no K/V here

    def release(self, request_id: str) -> None:
        self._flight.pop(request_id, None)
        self._on_path.pop(request_id, None)
        self._last.release(request_id)

    def in_flight(self, request_id: str) -> bool:
        return any(a is not None for a in self._flight[request_id])

    def step_many(
        self, inputs: Mapping[str, tuple[Sequence[Prune], Activation | None]]
    ) -> dict[str, StepResult]:
        rows: dict[str, list[int]] = {}
        computed: dict[str, Activation] = {}
        for rid, (prunes, entering) in inputs.items():
            held, on_path = self._flight[rid], self._on_path[rid]
            for prune in prunes:
                held = [prune.filter(a) for a in held]
                self._last.prune(rid, prune)
                if on_path:  # forget pruned and committed nodes (new ones hang off live ones)
                    ids = torch.tensor(list(on_path))
                    self._on_path[rid] = on_path = {
                        i: on_path[i] for i in ids[prune.alive(ids)].tolist()
                    }
            if entering is not None and not entering.committed:
                self._admit(rid, entering)
            flight = [entering, *held]
            self._flight[rid] = flight[:-1]
            rows[rid] = [len(a) if a is not None else 0 for a in flight]
            if flight[-1] is not None:
                computed[rid] = self._final(rid, flight[-1])
        verified = self._last.verify(computed)
        return {rid: StepResult(rows[rid], verified.get(rid, ())) for rid in inputs}

    def _admit(self, rid: str, act: Activation) -> None:
        on_path = self._on_path[rid]
        seq = self.sequence
        for nid, pid, pos, tok in zip(
            act.node_ids.tolist(), act.parent_ids.tolist(), act.positions.tolist(),
            act.tokens.tolist(), strict=True,
        ):  # fmt: skip
            parent_ok = pid < 0 or on_path.get(pid, False)
            on_path[nid] = parent_ok and pos < len(seq) and seq[pos] == tok

    def _final(self, rid: str, act: Activation) -> Activation:
        """The last stage's output for `act`: one-hot rows of the continuation's next
        token as final hidden states, the rows' token ids carried on."""
        seq = self.sequence
        on_path = self._on_path[rid]
        ids = act.node_ids.tolist() if not act.committed else [-1] * len(act)
        nxt = [
            seq[p + 1] if (act.committed or on_path.get(n, False)) and p + 1 < len(seq) else 0
            for n, p in zip(ids, act.positions.tolist(), strict=True)
        ]
        hidden = torch.zeros(len(act), self._vocab, dtype=torch.float32)
        hidden[torch.arange(len(act)), torch.tensor(nxt, dtype=torch.int64)] = 1.0
        return Activation(
            request_id=act.request_id,
            positions=act.positions,
            committed=act.committed,
            node_ids=act.node_ids,
            parent_ids=act.parent_ids,
            hidden=hidden,
            row_tokens=None if act.committed else act.tokens,
        )
