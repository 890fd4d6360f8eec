"""Prefix-aware routing: which replica probably holds a prompt's prefix in its prefix
cache, and how much that weighs against load (as llm-d's and the Gateway API inference
extension's approximate prefix-cache scorer do for vLLM).

The router does not ask the stages: it remembers, per replica, the block keys of the
prompts it sent there (`common/runtime/prefix_hash.py`, the keys the stages compute
themselves), least recently sent forgotten first, at most as many as the replica has
cache blocks. The stages evict on their own, so this is an estimate; a wrong guess costs
a prefill, never a wrong token (each stage answers at Open what it really holds).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from specpipe.common.runtime.block_pool import BLOCK_SIZE
from specpipe.common.runtime.prefix_hash import block_keys

# A replica holding a longer prefix is preferred while it has at most this many more of
# this router's requests than the least loaded replica of its layers.
PREFIX_LOAD_SLACK = 4
DEFAULT_KEYS = 1 << 16  # keys remembered per replica that reports no block count
MAX_KEYS = 1 << 20


class PrefixIndex:
    """Block keys a replica was sent, least recently sent first (bounded)."""

    def __init__(self) -> None:
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def held(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the replica was sent."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n

    def add(self, keys: Sequence[bytes], limit: int) -> None:
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > limit:
            self._keys.popitem(last=False)


class PromptKeys:
    """A prompt's block keys for each block size asked (replicas may differ)."""

    def __init__(self, prompt: Sequence[int], salt: bytes = b"") -> None:
        """`salt`: the request's cache scope's (its keys are in that namespace only)."""
        self.tokens = list(prompt)[:-1]  # what is committed before the first root
        self.salt = salt
        self._by_size: dict[int, list[bytes]] = {}

    def __bool__(self) -> bool:
        return len(self.tokens) > 0

    def of(self, desc: object) -> list[bytes]:
        size = int(getattr(desc, "cache_block_rows", 0) or BLOCK_SIZE)
        if size not in self._by_size:
            self._by_size[size] = block_keys(self.tokens, size, self.salt)
        return self._by_size[size]


def key_limit(desc: object) -> int:
    blocks = int(getattr(desc, "cache_blocks_used", 0) or 0) + int(
        getattr(desc, "cache_blocks_free", 0) or 0
    )
    return min(blocks or DEFAULT_KEYS, MAX_KEYS)


def prefer_prefix(replicas: Sequence, least_loaded: Callable, prompt: PromptKeys | None):
    """The replica of one layer range to take: the least loaded, unless another holds a
    longer prefix of the prompt and has at most `PREFIX_LOAD_SLACK` more of this router's
    requests (then the one holding the longest, least loaded among equals)."""
    least = least_loaded(replicas)
    if not prompt:
        return least
    held = {id(b): b.prefixes.held(prompt.of(b.desc)) for b in replicas}
    near = [b for b in replicas if b.active <= least.active + PREFIX_LOAD_SLACK]
    best = max(held[id(b)] for b in near)
    if best <= held[id(least)]:
        return least
    return least_loaded([b for b in near if held[id(b)] == best])
