"""The draft: a small causal LM that proposes the children of tree nodes.

It runs on the same engine as a target stage (a `StageRuntime` holding every layer): a
paged KV cache in one block pool, each request's tree rows beside its committed prefix,
so each step it only runs the newest tree layer; the layers of several requests grow in
one batched forward with one attention call per layer (`propose_many`), and prompts share
cached blocks of their common prefixes (`open` says how much of a prompt it holds; the
caller prefills only the rest). The router owns the tree: the draft returns top-k
candidates per node, the router keeps the best `w`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..model.layers import StageModel
from ..spec.messages import Activation, Candidates, Prune
from ..spec.sampling import draft_probs
from .errors import RequestError
from .prefix_hash import NO_SCOPE, CacheScope
from .stage import StageRuntime


@dataclass(frozen=True)
class Proposal:
    """One request's ask: expand `layer`, `top_k` children per node."""

    layer: Activation
    top_k: int
    temperature: float = 0.0


def hand_off(packed: Tensor) -> Tensor:
    """A step's candidates to host memory, for the router's tree (gRPC): the one copy a
    proposal step makes from its device, and its only read of it."""
    return packed.cpu()


Ask = tuple[Activation, int, float]  # a proposal's output rows, top_k, temperature
Group = tuple[list[int], int]  # the asks of one (top_k, temperature), and their k


@torch.inference_mode()
def _top_k_packed(
    asks: Sequence[Ask], head: Callable[[Tensor], Tensor]
) -> tuple[Tensor, list[Group]]:
    """The device's part of `_top_children_many` (no autograd: a tenth less dispatch):
    per group [token ids | probabilities] of its rows, as float64 (which holds token
    ids, < 2**53, and float32 probabilities exactly), all groups in one host copy."""
    groups: dict[tuple[int, float], list[int]] = {}
    for i, (_, top_k, temperature) in enumerate(asks):
        groups.setdefault((top_k, temperature), []).append(i)
    parts: list[Tensor] = []
    layout: list[Group] = []
    for (top_k, temperature), members in groups.items():
        hidden = [asks[i][0].hidden for i in members]
        stacked = hidden[0] if len(hidden) == 1 else torch.cat(hidden)  # type: ignore[arg-type]
        probs = draft_probs(head(stacked), temperature)
        k = min(top_k, probs.shape[-1])
        top = torch.topk(probs, k, dim=-1)
        parts += [top.indices.reshape(-1).double(), top.values.reshape(-1).double()]
        layout.append((members, k))
    return hand_off(torch.cat(parts) if len(parts) > 1 else parts[0]), layout


def _top_children_many(asks: Sequence[Ask], head: Callable[[Tensor], Tensor]) -> list[Candidates]:
    """The top-k children of every node of a step's proposals, `(output, top_k,
    temperature)` each (its rows' final hidden states): one LM head call (`head`), one
    softmax and one top-k per (top_k, temperature) of the step, and one host copy for
    all (`hand_off`)."""
    packed, layout = _top_k_packed(asks, head)
    host = packed.numpy()
    results: list[Candidates | None] = [None] * len(asks)
    at = 0
    for members, k in layout:  # sliced through numpy: a third of torch's time per slice
        n = sum(len(asks[i][0]) for i in members) * k
        tokens, probs = host[at : at + n].astype(np.int64), host[at + n : at + 2 * n]
        probs = probs.astype(np.float32)
        at += 2 * n
        row = 0
        for i in members:
            out = asks[i][0]
            m = len(out) * k
            results[i] = Candidates(  # on the CPU, like the router's tree
                parent_ids=torch.from_numpy(np.repeat(out.node_ids.numpy(), k)),
                tokens=torch.from_numpy(tokens[row : row + m]),
                probs=torch.from_numpy(probs[row : row + m]),
            )
            row += m
    return results  # type: ignore[return-value]


def _computes(work: Proposal | Activation) -> bool:
    """Whether a step's item has rows to run: a proposal that asks for children of some
    node, or a prefill chunk of some token."""
    if isinstance(work, Proposal):
        return bool(len(work.layer)) and work.top_k > 0
    return bool(len(work))


class DraftRuntime:
    def __init__(
        self, model: StageModel, max_cache_bytes: int | None = None, prefix_caching: bool = True
    ) -> None:
        if not (model.layer_range.is_first and model.layer_range.is_last):
            raise ValueError("a draft holds the whole model")
        self.runtime = StageRuntime(model, max_cache_bytes, prefix_caching=prefix_caching)

    @property
    def vocab_size(self) -> int:
        return self.runtime.model.cfg.vocab_size

    def open(
        self,
        request_id: str,
        capacity: int,
        prompt: Sequence[int] | np.ndarray = (),
        cache_scope: CacheScope = NO_SCOPE,
    ) -> int:
        """Open the request; of `prompt` (its first root not included), how many leading
        tokens the prefix cache holds in `cache_scope` (the caller prefills the rest,
        from there)."""
        return self.runtime.open(
            request_id, capacity, prefix_tokens=prompt, cache_scope=cache_scope
        )

    def release(self, request_id: str) -> bool:
        return self.runtime.release(request_id)

    def prefill(
        self, request_id: str, tokens: Tensor, start_position: int, chunk_size: int
    ) -> None:
        """Cache verified tokens (prompt, or ones the draft has not seen) in chunks."""
        for s in range(0, tokens.numel(), chunk_size):
            chunk = tokens[s : s + chunk_size]
            pos = torch.arange(start_position + s, start_position + s + chunk.numel())
            self.runtime.forward(
                Activation(request_id=request_id, positions=pos, committed=True, tokens=chunk)
            )

    def propose(self, layer: Activation, top_k: int, temperature: float = 0.0) -> Candidates:
        """Run the nodes of a tree layer; return their top-k children each."""
        (result,) = self.propose_many([Proposal(layer, top_k, temperature)])
        if isinstance(result, Exception):
            raise result
        return result

    def propose_many(self, asks: Sequence[Proposal]) -> list[Candidates | RequestError]:
        """The next layer of several requests in one batched forward; a request whose
        rows are bad gets its error, the others their candidates."""
        return self.step_many(asks)  # type: ignore[return-value]

    def step_many(
        self, work: Sequence[Proposal | Activation]
    ) -> list[Candidates | RequestError | None]:
        """A step's work in one batched forward: proposals (their candidates) and prefill
        chunks, committed tokens (None once cached), so a prompt that arrives beside
        running requests costs them no forward of its own; a request whose rows are bad
        gets its error, the others their results."""
        acts = [w.layer if isinstance(w, Proposal) else w for w in work]
        live = [i for i, w in enumerate(work) if _computes(w)]
        outs = dict(zip(live, self.runtime.forward_many([acts[i] for i in live]), strict=True))
        results: list[Candidates | RequestError | None] = []
        grown: list[tuple[int, tuple[Activation, int, float]]] = []
        for i, w in enumerate(work):
            out = outs.get(i)
            if isinstance(out, RequestError):
                results.append(out)
            elif not isinstance(w, Proposal):
                results.append(None)  # the chunk is cached
            elif out is None:  # nothing asked, or every node was pruned before it got here
                results.append(Candidates.empty())
            else:
                grown.append((len(results), (out, w.top_k, w.temperature)))
                results.append(Candidates.empty())
        if grown:
            for (i, _), children in zip(
                grown,
                _top_children_many([g for _, g in grown], self.runtime.model.logits),
                strict=True,
            ):
                results[i] = children
        return results

    def prune(self, request_id: str, prune: Prune) -> None:
        self.runtime.prune(request_id, prune)

    def prune_many(self, prunes: Sequence[tuple[str, Prune]]) -> list[RequestError | None]:
        """A step's prunes of several requests in one pass (`StageRuntime.prune_many`):
        per prune None, or the error its request failed with."""
        return self.runtime.prune_many(prunes)
