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

from collections.abc import Sequence
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


def _top_children(out: Activation, top_k: int, temperature: float) -> Candidates:
    assert out.logits is not None
    probs = draft_probs(out.logits, temperature)
    k = min(top_k, probs.shape[-1])
    top = torch.topk(probs, k, dim=-1)
    return Candidates(  # on the CPU, like the router's tree, whatever the model's device
        parent_ids=out.node_ids.repeat_interleave(k),
        tokens=top.indices.reshape(-1).cpu(),
        probs=top.values.reshape(-1).cpu(),
    )


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
        live = [a for a in asks if len(a.layer) and a.top_k > 0]
        outs = iter(self.runtime.forward_many([a.layer for a in live]))
        results: list[Candidates | RequestError] = []
        for ask in asks:
            out = next(outs) if len(ask.layer) and ask.top_k > 0 else None
            if isinstance(out, RequestError):
                results.append(out)
            elif out is None:  # nothing asked, or every node was pruned before it got here
                results.append(Candidates.empty())
            else:
                results.append(_top_children(out, ask.top_k, ask.temperature))
        return results

    def prune(self, request_id: str, prune: Prune) -> None:
        self.runtime.prune(request_id, prune)
