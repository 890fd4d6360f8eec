"""How much working memory one step of a stage (or the draft) may take, and what a step
costs in it: the one place both are decided (docs/architecture.md, "5. The request
controller and its executors", "Bounded memory per step").

A step's working memory is what it allocates beside the weights and the KV cache: per
row, its projections, MLP and residual (and on the last stage its logits); per padded
attention call of B query groups x Q rows x L keys, the scores, their softmax and the
additive mask (B·Q·L cells), the gathered keys and values (B·L) and the queries and
outputs (B·Q). Without a bound, one long prompt's prefill (its chunks sent at once, a
round taking them all, a mask of every chunk's rows x the whole context) took gigabytes
and the kernel killed the stage (issue 35, F1). With one, a stage splits what it
computes until each piece fits: the rows of a round (`StepBudget.max_rows`), attention
in parts and, where one request's rows x context is too much, in query blocks and key
blocks (`model.paged_attention`).

The budget is a share of the device's free memory when the service starts (the KV cache
takes `DEFAULT_CACHE_FRACTION` of it; this is beside that), or `--step-memory-mib`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.config import ModelConfig

# Share of the device's free memory (after the weights) one step may take, and bounds on
# what that gives (the ceiling keeps a big host from spending its memory on one step).
DEFAULT_STEP_FRACTION = 0.1
MIN_STEP_BYTES = 1 << 20
MAX_STEP_BYTES = 8 << 30
# Without a device to measure (a runtime built in-process, tests): the budget.
DEFAULT_STEP_BYTES = 1 << 30
# Of the budget, the share attention may take at once (the rest: the round's rows).
ATTENTION_SHARE = 0.5
# Query rows of one block where a request's rows x context is split (fewer rows than
# this per block and the per-block overhead dominates; key blocks take over).
MIN_QUERY_BLOCK = 16
# Keys of one key block, at least (a KV block's rows: 16).
MIN_KEY_BLOCK = 16
# Rows x keys of one prefill chunk, at most (a chunk of 128 rows at 8k tokens of
# context): a round takes the decodes ready and prefill chunks up to this much, so a
# long prompt's chunks interleave with the other requests' steps (and each chunk's
# attention is one call where the memory budget allows it).
DEFAULT_PREFILL_CELLS = 1 << 20


@dataclass(frozen=True)
class StepCosts:
    """Bytes of working memory per unit of a step, for one model slice in one dtype."""

    row_bytes: int  # per row: hidden, projections, MLP, rope (and logits, last stage)
    cell_bytes: int  # per (query row, key) of a padded attention call
    key_bytes: int  # per key gathered for one query group (its K and V)
    query_bytes: int  # per padded query row (query, output, their copies)

    @classmethod
    def of(cls, cfg: ModelConfig, dtype: torch.dtype, logits: bool = False) -> StepCosts:
        e = torch.empty((), dtype=dtype).element_size()
        heads, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        row = e * (4 * cfg.hidden_size + 2 * (heads + kv) * d + 3 * cfg.intermediate_size)
        row += 2 * d * e  # rope's cos and sin
        if logits:
            row += 2 * 4 * cfg.vocab_size  # fp32 (at least) logits and their softmax
        # scores, their softmax (and exp/product temporaries), the additive mask, and the
        # boolean visibility it is built from
        cell = e * (3 * heads + 1) + 2
        return cls(row, cell, 2 * kv * d * e, 3 * heads * d * e)

    def attention_bytes(self, groups: int, queries: int, keys: int) -> int:
        """One padded attention call of `groups` x `queries` rows over `keys` keys."""
        return groups * (queries * keys * self.cell_bytes + keys * self.key_bytes
                         + queries * self.query_bytes)  # fmt: skip


@dataclass(frozen=True)
class StepBudget:
    """The working memory one step may take (`bytes`) and its costs per unit."""

    bytes: int
    costs: StepCosts

    def __post_init__(self) -> None:
        if self.bytes < MIN_STEP_BYTES:
            raise ValueError(
                f"a step's memory budget must be at least {MIN_STEP_BYTES >> 20} MiB, "
                f"got {self.bytes} bytes"
            )

    @property
    def attention_bytes(self) -> int:
        """What one attention call (one part, one key block) may take."""
        return int(self.bytes * ATTENTION_SHARE)

    @property
    def prefill_cells(self) -> int:
        """Rows x keys of prefill one round takes (the first chunk always): at most
        `DEFAULT_PREFILL_CELLS`, and what one attention call may hold."""
        return max(1, min(DEFAULT_PREFILL_CELLS, self.attention_bytes // self.costs.cell_bytes))

    @property
    def max_rows(self) -> int:
        """The most rows one step may run (their activations take the rest)."""
        return max(1, (self.bytes - self.attention_bytes) // self.costs.row_bytes)


def step_bytes_for(free_bytes: int, fraction: float = DEFAULT_STEP_FRACTION) -> int:
    """A step's budget on a device with `free_bytes` free (after its weights)."""
    return max(MIN_STEP_BYTES, min(MAX_STEP_BYTES, int(free_bytes * fraction)))
