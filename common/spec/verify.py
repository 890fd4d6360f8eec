"""The verification walk's parts (docs/architecture.md, "3. The pipeline step"), which
the last stage's verifier (`common/runtime/verifier.py`) runs, in the services and in
the in-process pipeline alike.

Draw the token at the root; while the drawn token is a child of the node drawn at whose
row is present (its logits can be computed in the same step), draw at that child. What
comes out is the path of nodes drawn at and the token drawn at each; the router's
controller accepts it (the last token is a hit on a child not computed yet, or a miss)
and prunes. The draw at every node depends only on its logits and (seed, position)
(`sampling.py`), so where the walk runs does not change a token, nor how many draws are
made together: the last stage walks all requests of a round level by level
(`common/runtime/verifier.py`, `drive`), with `draw_logits` per draw, `draw_tokens` for
all of a level's draws and one `read_tokens` of them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .grammar import Grammar, GrammarState
from .messages import TokenLogprobs
from .options import MAX_LOGPROBS
from .penalties import LogitsRules, TokenCounts
from .sampling import SamplingParams, draw_index


@dataclass(frozen=True)
class VerifySpec:
    """What the last stage needs to draw a request's tokens: its sampling parameters,
    where its output starts (the original prompt's length: the token drawn from the
    logits of the row at sequence position p is output token p + 1 - output_start, the
    position its (seed, position) draw uses), how many top logprobs to report with
    each token (None: no logprobs) and with each prompt token after the first
    (`prompt_logprobs`; None: none), and the grammar the output follows (None: none)
    with the output tokens it has consumed before the first root's draw (the output
    so far: empty at the start, what was emitted before a replay). The logits rules
    (`penalties.py`) are the sampling parameters' and `min_tokens`, which masks
    `stop_token_ids` (the end-of-sequence tokens and the request's) until that many
    output tokens are out; the penalties read the committed tokens (the stage has them
    from its Open: `prefix_token_ids`, then the first root's token)."""

    sampling: SamplingParams
    output_start: int
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: Grammar | None = None
    grammar_consumed: tuple[int, ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.output_start < 1:
            raise ValueError(f"output_start must be >= 1, got {self.output_start}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.grammar is None and self.grammar_consumed:
            raise ValueError("grammar_consumed without a grammar")

    def grammar_state(self) -> GrammarState | None:
        """The grammar after the output so far (None: no grammar)."""
        return None if self.grammar is None else self.grammar.state(self.grammar_consumed)

    def rules(self, committed: Sequence[int]) -> LogitsRules:
        """This request's logits rules after the `committed` tokens (the prompt's first
        `output_start`, then the output's; counted only when a penalty reads them)."""
        counts = None
        if self.sampling.penalizes:
            start = self.output_start
            counts = TokenCounts(committed[:start], committed[start:])
        return LogitsRules(self.sampling, self.min_tokens, self.stop_token_ids, counts)

    def draw_position(self, row_position: int) -> int:
        """The output index drawn from the logits of the row at `row_position`."""
        return row_position + 1 - self.output_start


def child_row(
    row: int, token: int, node_ids: np.ndarray, parent_ids: np.ndarray, tokens: np.ndarray
) -> int | None:
    """The row the walk goes on at after drawing `token` at `row` (None: the walk ends)."""
    child = np.flatnonzero((parent_ids == node_ids[row]) & (tokens == token))
    return int(child[0]) if child.size else None


def rows_logprobs(logits: Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprobs]:
    """Each row's token's log-probability under the raw logits [rows, vocab] (its token
    in `tokens`) and the `top` best (vLLM's default `raw_logprobs`: before temperature,
    top-k and top-p), computed in fp64 (the same figures whatever the logits' dtype and
    device)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    at = torch.as_tensor(list(tokens), dtype=torch.int64, device=logp.device)
    chosen = logp.gather(1, at[:, None])[:, 0].tolist()
    if not top:
        return [TokenLogprobs(c) for c in chosen]
    values, ids = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
    return [
        TokenLogprobs(c, tuple(i), tuple(v))
        for c, i, v in zip(chosen, ids.tolist(), values.tolist(), strict=True)
    ]


def draw_logits(
    logits: Tensor,
    spec: VerifySpec,
    position: int,
    grammar: GrammarState | None = None,
    rules: LogitsRules | None = None,
) -> Tensor:
    """The logits [vocab] the token at output `position` is drawn from: with a
    `grammar` (its state after the output up to this row) the tokens it forbids at
    -inf, then the `rules` (logit bias, min_tokens, penalties). `logits` itself (raw:
    logprobs read them) is left as it is."""
    drawn = logits
    if grammar is not None:
        allowed = grammar.allowed(logits.numel())
        if rules is not None:
            allowed = rules.allowed(allowed, position)
        drawn = logits.masked_fill(~torch.from_numpy(allowed).to(logits.device), -torch.inf)
    if rules is not None:
        drawn = rules.apply(drawn, position, grammar=grammar is not None)
    return drawn


def draw_tokens(draws: Sequence[tuple[Tensor, SamplingParams, int]]) -> Tensor:
    """The tokens of several draws (each: the logits to draw from [vocab], the
    sampling parameters, the output position) as one int64 tensor [draws] on the
    logits' device, nothing read back: the greedy ones in one argmax over their rows
    stacked, the sampled ones each by `draw_index` (their parameters differ)."""
    if not draws:
        return torch.empty(0, dtype=torch.int64)
    greedy = [i for i, (_, params, _) in enumerate(draws) if params.greedy]
    parts: list[Tensor] = []
    order = list(greedy)
    if greedy:
        rows = [draws[i][0] for i in greedy]
        dtype = functools.reduce(torch.promote_types, (r.dtype for r in rows))
        parts.append(torch.stack([r.to(dtype) for r in rows]).argmax(-1))
    sampled = [i for i in range(len(draws)) if not draws[i][1].greedy]
    if sampled:
        parts.append(torch.stack([draw_index(*draws[i]) for i in sampled]))
        order += sampled
    tokens = torch.cat(parts) if len(parts) > 1 else parts[0]
    if order == sorted(order):
        return tokens
    at = torch.empty(len(order), dtype=torch.int64)
    at[torch.tensor(order)] = torch.arange(len(order))
    return tokens.index_select(0, at.to(tokens.device))


def read_tokens(tokens: Tensor) -> list[int]:
    """The drawn tokens on the host: the verification's one read back from the device
    per level of its walks (for every request at once)."""
    return tokens.tolist()


def took(token: int, grammar: GrammarState | None = None, rules: LogitsRules | None = None) -> None:
    """The request's grammar and rules take a drawn token (every draw is committed)."""
    if grammar is not None:
        grammar.advance((token,))
    if rules is not None:
        rules.drawn(token)
