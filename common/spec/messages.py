"""The small typed objects that move through the pipeline.

`Activation` is the data plane: what one stage hands the next for one request in one
step. `Verified` is what the last stage sends the router: the tokens it drew along the
tree (docs/architecture.md, "3. The pipeline step"). `Prune` is the
control plane: the verification outcome every stage and the draft apply to their caches
and to activations still in flight. `Candidates` are what the draft proposes as children
of tree nodes.

Where arrays become tensors (issue 34 point 3): the router never makes one. Its
controller keeps numpy arrays (`tree.py`) and hands its rows and prunes out as numpy
(`RowArrays`, `PruneArrays`), which the network executor sends as they are; only an
in-process executor, whose stages and draft compute on tensors, reads them as torch
(`RowArrays.activation`, `PruneArrays.prune`, through the commands' `act`, `layer` and
`prune`: `commands.py`). The other way, `Candidates` are numpy from the network (the
draft's answer as the router reads it) and torch from an in-process draft; the controller
reads either through `growth.pool_of`. A torch call made cold costs several times a numpy
one (session 44: 18-31 us against 4-13 us after the caches were evicted), and the router
meets every step's work cold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

EMPTY_IDS = torch.empty(0, dtype=torch.int64)
NO_IDS = np.empty(0, dtype=np.int64)  # never written: nothing to write in it
_NO_PROBS = torch.empty(0, dtype=torch.float32)
_NO_SOURCES = torch.empty(0, dtype=torch.int8)

# Where a tree node's token came from (bits: a token both sources proposed has both).
SOURCE_DRAFT = 1  # the draft model
SOURCE_NGRAM = 2  # n-gram lookup over the verified text (`ngram.py`)
SOURCE_GRAMMAR = 4  # the one token a grammar allows there (forced: `growth.with_forced_tokens`)
SOURCE_NAMES = {SOURCE_DRAFT: "draft", SOURCE_NGRAM: "ngram", SOURCE_GRAMMAR: "grammar"}


@dataclass
class Activation:
    """Rows of one request entering a stage.

    Either a prefill chunk of verified tokens (`committed=True`, causal among themselves)
    or tree nodes (`committed=False`) identified by stable node ids with parent ids.
    Exactly one of `tokens` (into stage 1) or `hidden` (between stages; out of the last
    stage, the final hidden states it verifies) is set. `row_tokens` (tree rows after
    stage 1) are the rows' token ids, carried along so that the last stage can walk the
    tree it verifies.
    """

    request_id: str
    positions: Tensor
    committed: bool = False
    node_ids: Tensor = field(default_factory=lambda: EMPTY_IDS)
    parent_ids: Tensor = field(default_factory=lambda: EMPTY_IDS)
    tokens: Tensor | None = None
    hidden: Tensor | None = None
    row_tokens: Tensor | None = None

    def __len__(self) -> int:
        return int(self.positions.numel())

    def select(self, rows: Tensor) -> Activation:
        """The same activation restricted to `rows` (tree activations only)."""

        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.index_select(0, rows.to(t.device))

        return Activation(
            request_id=self.request_id,
            positions=self.positions.index_select(0, rows),
            committed=self.committed,
            node_ids=self.node_ids.index_select(0, rows),
            parent_ids=self.parent_ids.index_select(0, rows),
            tokens=pick(self.tokens),
            hidden=pick(self.hidden),
            row_tokens=pick(self.row_tokens),
        )


def _tensor(a: NDArray[np.int64]) -> Tensor:
    """A CPU tensor sharing `a`'s memory (the empty tensor for an empty array)."""
    return torch.from_numpy(a) if a.size else EMPTY_IDS


@dataclass(frozen=True)
class RowArrays:
    """An `Activation`'s rows into stage 1 as numpy arrays (int64): how the controller
    hands a prefill chunk or a tree layer out (see the module's docstring)."""

    request_id: str
    positions: NDArray[np.int64]
    committed: bool = False
    node_ids: NDArray[np.int64] = field(default_factory=lambda: NO_IDS)
    parent_ids: NDArray[np.int64] = field(default_factory=lambda: NO_IDS)
    tokens: NDArray[np.int64] = field(default_factory=lambda: NO_IDS)

    def __len__(self) -> int:
        return len(self.positions)

    def activation(self) -> Activation:
        """The rows as an in-process stage takes them (tensors sharing the arrays)."""
        return Activation(
            request_id=self.request_id,
            positions=_tensor(self.positions),
            committed=self.committed,
            node_ids=_tensor(self.node_ids),
            parent_ids=_tensor(self.parent_ids),
            tokens=_tensor(self.tokens),
        )


@dataclass(frozen=True)
class TokenLogprobs:
    """A verified token's log-probability and the `top` most likely tokens' at its
    position: log_softmax of the target's raw logits there (before temperature, top-k and
    top-p, as vLLM reports them by default: `logprobs_mode="raw_logprobs"`)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Verified:
    """What one verification at the last stage drew (docs/architecture.md, "3. The
    pipeline step"): the tree nodes it drew at, root first, each the child of the one
    before with the token drawn there (`node_ids[i + 1]` has token `tokens[i]`), and
    the token drawn at each. The last token either is a child whose logits were not
    computed yet (a hit; the next verification starts there) or no child (a miss).
    `position` is the root's position; `logprobs` one per token, for a request that
    asked for them; `prompt_logprobs` (a request's first verification, when it asked for
    them) one per prompt token after the first."""

    request_id: str
    node_ids: tuple[int, ...]
    tokens: tuple[int, ...]
    position: int
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None

    def __post_init__(self) -> None:
        if not self.node_ids or len(self.node_ids) != len(self.tokens):
            raise ValueError(
                f"a verification draws one token per node: {len(self.node_ids)} nodes, "
                f"{len(self.tokens)} tokens"
            )
        if self.logprobs is not None and len(self.logprobs) != len(self.tokens):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.tokens)} tokens")


@dataclass
class Prune:
    """Verification outcome: tree nodes to commit (in sequence order) and tree nodes to keep.

    `horizon` is the largest node id the router had created when it decided this prune
    (the tree version). Nodes with larger ids were created later and are untouched, so a
    prune that reaches a stage late never drops newer nodes; every node up to the horizon
    that is neither committed nor kept is dropped from caches and from activations.
    """

    commit_ids: Tensor
    keep_ids: Tensor
    horizon: int

    def alive(self, node_ids: Tensor) -> Tensor:
        """Which of `node_ids` survive this prune (committed ones do not: they left the tree)."""
        return (node_ids > self.horizon) | torch.isin(node_ids, self.keep_ids)

    def filter(self, act: Activation | None) -> Activation | None:
        """Drop pruned nodes from an in-flight activation; None when nothing survives."""
        if act is None or act.committed:
            return act
        rows = self.alive(act.node_ids).nonzero().squeeze(1)
        if rows.numel() == 0:
            return None
        return act if rows.numel() == len(act) else act.select(rows)


@dataclass(frozen=True)
class PruneArrays:
    """A `Prune` as numpy arrays (int64): how the controller hands one out."""

    commit_ids: NDArray[np.int64]
    keep_ids: NDArray[np.int64]
    horizon: int

    def prune(self) -> Prune:
        """The prune as an in-process stage or draft applies it (tensors sharing the arrays)."""
        return Prune(_tensor(self.commit_ids), _tensor(self.keep_ids), self.horizon)


def after_prunes(prunes: list[Prune], act: Activation | None) -> Activation | None:
    """`act` without the rows `prunes` drop, applied in order; None when nothing survives."""
    for prune in prunes:
        act = prune.filter(act)
    return act


@dataclass
class Candidates:
    """Proposed children: for candidate i, parent node id, token and probability, and
    which source proposed it (`SOURCE_*` bits; unset: the draft model). The arrays are
    numpy or CPU tensors, all of one kind (see the module's docstring)."""

    parent_ids: Tensor | NDArray[np.int64]
    tokens: Tensor | NDArray[np.int64]
    probs: Tensor | NDArray
    source: Tensor | NDArray[np.int8] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def sources(self) -> Tensor | NDArray[np.int8]:
        if self.source is not None:
            return self.source
        drafted = np.full(len(self), SOURCE_DRAFT, dtype=np.int8)
        return drafted if isinstance(self.tokens, np.ndarray) else torch.from_numpy(drafted)

    @classmethod
    def empty(cls) -> Candidates:
        return cls(EMPTY_IDS, EMPTY_IDS, _NO_PROBS, _NO_SOURCES)
