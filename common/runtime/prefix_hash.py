"""Keys of the prefix cache: one per full block of a token sequence, chained, as in
vLLM's automatic prefix caching (key of block i = hash(key of block i - 1, the block's
token ids)).

A block's K/V depend only on the tokens up to its end (positions count from 0), so equal
keys mean equal K/V on every stage and on the draft: each computes the keys itself from
the token ids the router gives at Open, with this one function, and the router computes
the same keys to remember which replica holds what (prefix-aware routing). The hash is
BLAKE2b (16 bytes), not Python's `hash`: the same in every process and not steerable to
a collision by a client choosing its prompt.

A request's `CacheScope` isolates tenants (docs/architecture.md, "5. The request
controller and its executors", prefix caching, isolation between tenants): its
`salt` starts the chain, so only requests of the same salt find each other's blocks (a
client cannot confirm another's prompt by timing), and its `owner` says whom the blocks
count against when the pool evicts. The router derives both from the API key (or client
address) and the request's `cache_salt` with a deployment secret; replicas only see
these hashes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KEY_BYTES = 16
_ROOT = b"specpipe-prefix-v1"
MAX_SCOPE_BYTES = 64  # a salt or an owner longer than this is refused at Open


@dataclass(frozen=True)
class CacheScope:
    """Where a request's blocks live in the prefix cache (empty: unsalted, no owner)."""

    salt: bytes = b""
    owner: bytes = b""

    def __post_init__(self) -> None:
        if len(self.salt) > MAX_SCOPE_BYTES or len(self.owner) > MAX_SCOPE_BYTES:
            raise ValueError(f"a cache scope's salt and owner have at most {MAX_SCOPE_BYTES} bytes")


NO_SCOPE = CacheScope()


def block_keys(
    tokens: Sequence[int] | np.ndarray, block_size: int, salt: bytes = b""
) -> list[bytes]:
    """Keys of the full blocks of `tokens` (a trailing partial block has none), in the
    namespace of `salt` (empty: the unsalted keys)."""
    ids = np.ascontiguousarray(np.asarray(tokens, dtype="<i8"))
    keys: list[bytes] = []
    # (The first block hashes 18 + len(salt) bytes before its ids, later ones 16: no
    # salt makes a first block's input equal a later block's.)
    parent = _ROOT + salt
    for start in range(0, ids.size - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        h.update(ids[start : start + block_size].tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys
