"""What the router checks of a request against its stages' budgets before it opens it
(docs/architecture.md, "5. The request controller and its executors", "Bounded memory
per step"): a prompt whose KV blocks no replica of some layer range can ever hold is
refused up front (it would otherwise fail mid-prefill, after its chunks took every
stage's time), and prefill chunks are sized to the stages' prefill budget (rows x keys),
the least any stage published.
"""

from __future__ import annotations

from collections.abc import Iterable

from specpipe.common.runtime.block_pool import BLOCK_SIZE


def prefill_cells_of(descs: Iterable[object]) -> int | None:
    """The rows x keys one prefill chunk may cost on every stage (None: none said)."""
    cells = [int(getattr(d, "prefill_cells", 0) or 0) for d in descs]
    cells = [c for c in cells if c > 0]
    return min(cells) if cells else None


def check_cache_fits(rows: int, descs: Iterable[object]) -> None:
    """ValueError (a clear message) when a request of `rows` cached rows (its prompt and
    one more block for its output and tree) needs more KV blocks than the largest
    replica of some layer range holds in all (used and free)."""
    largest: dict[tuple[int, int], tuple[int, int]] = {}  # layers -> (blocks, block rows)
    for d in descs:
        block = int(getattr(d, "cache_block_rows", 0) or BLOCK_SIZE)
        total = int(getattr(d, "cache_blocks_used", 0)) + int(getattr(d, "cache_blocks_free", 0))
        if total <= 0:
            continue  # not said (an older stage)
        key = (int(getattr(d, "layer_start", 0)), int(getattr(d, "layer_end", 0)))
        if key not in largest or total * block > largest[key][0] * largest[key][1]:
            largest[key] = (total, block)
    for (start, end), (total, block) in sorted(largest.items()):
        need = -(-rows // block) + 1
        if need > total:
            raise ValueError(
                f"the prompt needs {need} KV cache blocks of {block} tokens on the stage of "
                f"layers {start}-{end}, and the largest holds {total} in all: this "
                f"deployment cannot serve a prompt of {rows} tokens (at most "
                f"{(total - 1) * block})"
            )
