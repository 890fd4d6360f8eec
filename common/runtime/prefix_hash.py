"""Keys of the prefix cache: one per full block of a token sequence, chained, as in
vLLM's automatic prefix caching (key of block i = hash(key of block i - 1, the block's
token ids)).

A block's K/V depend only on the tokens up to its end (positions count from 0), so equal
keys mean equal K/V on every stage and on the draft: each computes the keys itself from
the token ids the router gives at Open, with this one function, and the router computes
the same keys to remember which replica holds what (prefix-aware routing). The hash is
BLAKE2b (16 bytes), not Python's `hash`: the same in every process and not steerable to
a collision by a client choosing its prompt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

KEY_BYTES = 16
_ROOT = b"specpipe-prefix-v1"


def block_keys(tokens: Sequence[int] | np.ndarray, block_size: int) -> list[bytes]:
    """Keys of the full blocks of `tokens` (a trailing partial block has none)."""
    ids = np.ascontiguousarray(np.asarray(tokens, dtype="<i8"))
    keys: list[bytes] = []
    parent = _ROOT
    for start in range(0, ids.size - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        h.update(ids[start : start + block_size].tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys
