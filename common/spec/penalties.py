"""The logits rules before the draw: logit bias, min_tokens and the penalties, with
vLLM's definitions and in vLLM's order (docs/api.md, "Penalties, logit bias and
min_tokens"):

1. the grammar's mask (structured output: forbidden tokens at -inf);
2. `logit_bias`: each listed token's bias added to its logit; `min_tokens`: the stop
   tokens (end-of-sequence and the request's stop token ids) at -inf while fewer than
   `min_tokens` tokens are out (with a grammar, only while it allows another token);
3. `repetition_penalty` over every token of the prompt and of the output (a positive
   logit divided by it, a negative one multiplied), then `frequency_penalty` and
   `presence_penalty` over the output's tokens (logit -= frequency * count + presence).

Temperature, top-k and top-p come after (`sampling.draw_index`); logprobs stay the raw
logits'. The rules depend on the tokens before the one drawn, so they are applied where
every token is drawn (the last stage's verifier, `verify.draw_logits`), with the request's
`TokenCounts`: the committed tokens plus, walking down the tree, the tokens drawn on
the way to the node (each draw is committed, in order, so one state advanced by every
draw is always the one of the node drawn at next).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .growth import candidates_of, pool_of
from .messages import Candidates
from .sampling import SamplingParams
from .tree import TokenTree

# Slots a `TokenCounts` starts with beyond its first tokens (it doubles when full).
_MIN_SLOTS = 64


class TokenCounts:
    """A request's tokens as the penalties read them: one slot per distinct token of the
    prompt and the output (so at most the context's length), with the token's count in
    the output (0: the prompt's only). Kept on the logits' device from the first
    `penalize` on, and advanced there by `add` without reading anything back."""

    def __init__(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        seen = np.unique(np.asarray([*prompt, *output], dtype=np.int64))
        out_ids, out_counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
        counts = np.zeros(seen.size, dtype=np.float64)
        counts[np.searchsorted(seen, out_ids)] = out_counts
        self._slot = {int(t): i for i, t in enumerate(seen.tolist())}
        size = max(_MIN_SLOTS, 2 * seen.size)
        self._ids = torch.zeros(size, dtype=torch.int64)
        self._ids[: seen.size] = torch.from_numpy(seen)
        self._counts = torch.zeros(size, dtype=torch.float64)
        self._counts[: seen.size] = torch.from_numpy(counts)

    def __len__(self) -> int:
        return len(self._slot)

    def add(self, token: int, output: bool = True) -> None:
        """A token of the output (or, `output` False, of the prompt) is known: on the
        device, index writes and no read-back."""
        slot = self._slot.get(token)
        if slot is None:
            slot = self._slot[token] = len(self._slot)
            if slot == self._ids.numel():
                self._ids = torch.cat([self._ids, torch.zeros_like(self._ids)])
                self._counts = torch.cat([self._counts, torch.zeros_like(self._counts)])
            self._ids[slot] = token
        if output:
            self._counts[slot] += 1

    def penalize(self, logits: Tensor, sampling: SamplingParams) -> Tensor:
        """`logits` [vocab] (a float copy the caller owns) with the penalties applied, in
        place: only the slots' tokens change."""
        n = len(self._slot)
        if n == 0:
            return logits
        if self._ids.device != logits.device or self._counts.dtype != logits.dtype:
            self._ids = self._ids.to(logits.device)
            self._counts = self._counts.to(device=logits.device, dtype=logits.dtype)
        ids, counts = self._ids[:n], self._counts[:n]
        values = logits.index_select(0, ids)
        rep = sampling.repetition_penalty
        if rep != 1.0:
            values = torch.where(values > 0, values / rep, values * rep)
        if sampling.frequency_penalty != 0.0:
            values = values - sampling.frequency_penalty * counts
        if sampling.presence_penalty != 0.0:
            values = values - sampling.presence_penalty * (counts > 0).to(values.dtype)
        return logits.index_copy_(0, ids, values)


class LogitsRules:
    """One request's rules at the place its tokens are drawn: its sampling parameters,
    `min_tokens` and the stop tokens it masks until then, and its `TokenCounts` (None:
    no penalty reads the tokens). Per request: the counts (bounded by the context) and
    the bias and stop ids as small tensors on the logits' device."""

    def __init__(
        self,
        sampling: SamplingParams,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        counts: TokenCounts | None = None,
    ) -> None:
        self.sampling, self.min_tokens, self.counts = sampling, min_tokens, counts
        self._stops = np.unique(np.asarray(stop_token_ids, dtype=np.int64))
        self._bias_ids = np.asarray(list(sampling.logit_bias), dtype=np.int64)
        self._bias = np.asarray(list(sampling.logit_bias.values()), dtype=np.float64)
        # (device, dtype, vocab) -> the bias ids and values and the stop ids as tensors
        self._tensors: tuple[tuple, Tensor, Tensor, Tensor] | None = None

    def _on(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The bias ids and values and the stop ids for logits like `x` (made once:
        ids beyond its vocabulary dropped on the host, then one copy to the device)."""
        key = (x.device, x.dtype, x.numel())
        if self._tensors is None or self._tensors[0] != key:
            n = x.numel()
            keep = self._bias_ids < n
            ids = torch.from_numpy(self._bias_ids[keep]).to(x.device)
            bias = torch.from_numpy(self._bias[keep]).to(device=x.device, dtype=x.dtype)
            stops = torch.from_numpy(self._stops[self._stops < n]).to(x.device)
            self._tensors = (key, ids, bias, stops)
        return self._tensors[1:]

    @property
    def active(self) -> bool:
        """Whether any rule changes logits (else the draw takes the logits as they are)."""
        return bool(self._bias_ids.size or self.min_tokens or self.counts is not None)

    def masks_stops(self, position: int) -> bool:
        """Whether the stop tokens are masked at output `position`."""
        return position < self.min_tokens and self._stops.size > 0

    def allowed(self, grammar_allowed: np.ndarray, position: int) -> np.ndarray:
        """The grammar's allowed tokens (bool [vocab]) less the stop tokens while
        min_tokens masks them, unless nothing else is allowed (a complete output: the
        grammar wins, the request ends)."""
        if not self.masks_stops(position):
            return grammar_allowed
        stops = self._stops[self._stops < grammar_allowed.size]
        allowed = grammar_allowed.copy()
        allowed[stops] = False
        return allowed if allowed.any() else grammar_allowed

    def apply(self, logits: Tensor, position: int, grammar: bool = False) -> Tensor:
        """The logits [vocab] the token at output `position` is drawn from (a new
        tensor, at least float32; `logits` is left as it is). `grammar`: the grammar's
        mask is already applied, with the stop tokens (`allowed`)."""
        if not self.active:
            return logits
        x = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
        bias_ids, bias, stops = self._on(x)
        if bias_ids.numel():
            x.index_add_(0, bias_ids, bias)
        if not grammar and self.masks_stops(position):
            x.index_fill_(0, stops, -torch.inf)
        if self.counts is not None:
            x = self.counts.penalize(x, self.sampling)
        return x

    def drawn(self, token: int) -> None:
        """The token drawn at the next output position (the counts take it)."""
        if self.counts is not None:
            self.counts.add(token)


class GrowthRules:
    """The rules as the tree's growth ranks with them (the router's controller): each
    proposed child's draft probability reweighted as its token's logit would be at its
    parent, with the counts of the output and of the path down to the parent (logit
    bias and frequency and presence penalties exactly, as log-probabilities shift like
    logits; the repetition penalty on the log-probability, a proxy for the logit; a stop
    token min_tokens still holds back gets no node). Tokens never depend on it: the
    draws apply the rules themselves, this only decides which nodes the width keeps (a
    draft proposes without the rules, so its best child can be one the target's rules
    turn down). Host-side, bounded by the distinct tokens of prompt and output."""

    def __init__(
        self,
        sampling: SamplingParams,
        prompt: Sequence[int],
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        self.sampling, self.min_tokens = sampling, min_tokens
        self._stops = np.unique(np.asarray(stop_token_ids, dtype=np.int64))
        self._prompt = np.unique(np.asarray(prompt, dtype=np.int64))
        self._output: dict[int, int] = {}
        self._out_len = 0
        bias = sampling.logit_bias
        self._bias_ids = np.asarray(sorted(bias), dtype=np.int64)
        self._bias = np.asarray([bias[t] for t in self._bias_ids.tolist()], dtype=np.float64)

    @classmethod
    def of(
        cls,
        sampling: SamplingParams,
        prompt: Sequence[int],
        min_tokens: int,
        stops: Sequence[int],
    ) -> GrowthRules | None:
        """The request's growth rules (None: no rule changes a logit)."""
        if not (sampling.penalizes or sampling.logit_bias or min_tokens):
            return None
        return cls(sampling, prompt, min_tokens, stops)

    def emitted(self, tokens: Sequence[int]) -> None:
        """Tokens were committed to the output."""
        for t in tokens:
            self._output[int(t)] = self._output.get(int(t), 0) + 1
        self._out_len += len(tokens)

    def apply(self, tree: TokenTree, cand: Candidates) -> Candidates:
        """`cand` with their probabilities `reweighted` (those of parents no longer in
        the tree as they are: no node grows from them)."""
        if len(cand) == 0:
            return cand
        pid, tokens, probs, sources = pool_of(cand)
        at = np.minimum(np.searchsorted(tree.ids, pid), len(tree) - 1)
        present = tree.ids[at] == pid
        probs = np.asarray(probs, dtype=np.float64).copy()
        probs[present] = self.reweighted(tree, at[present], tokens[present], probs[present])
        return candidates_of((pid, tokens, probs, sources))

    def reweighted(
        self, tree: TokenTree, parents: np.ndarray, tokens: np.ndarray, probs: np.ndarray
    ) -> np.ndarray:
        """The candidates' probabilities (children `tokens` of the tree's nodes `parents`,
        indices) under the rules, each parent's candidates keeping their mass."""
        sp = self.sampling
        with np.errstate(divide="ignore"):
            logp = np.log(np.asarray(probs, dtype=np.float64))
        # each candidate's token on the path below the root down to its parent
        on_path = tree.mask[parents][:, 1:] & (tree.tokens[None, 1:] == tokens[:, None])
        counts = on_path.sum(axis=1)
        known = np.fromiter((self._output.get(int(t), 0) for t in tokens), np.int64, tokens.size)
        counts = counts + known
        if self._bias_ids.size:
            at = np.minimum(np.searchsorted(self._bias_ids, tokens), self._bias_ids.size - 1)
            logp = logp + np.where(self._bias_ids[at] == tokens, self._bias[at], 0.0)
        if sp.repetition_penalty != 1.0:
            seen = (counts > 0) | np.isin(tokens, self._prompt)
            logp = np.where(seen, logp * sp.repetition_penalty, logp)
        logp = logp - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)
        if self.min_tokens and self._stops.size:
            early = self._out_len + tree.depth[parents] < self.min_tokens
            logp = np.where(early & np.isin(tokens, self._stops), -np.inf, logp)
        finite = np.isfinite(logp)
        weights = np.exp(logp - (logp[finite].max() if finite.any() else 0.0))
        _, group = np.unique(parents, return_inverse=True)
        before = np.bincount(group, weights=probs)
        after = np.bincount(group, weights=weights)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(after > 0, before / after, 0.0)
        return weights * scale[group]
