"""Which prefix-cache namespace a request's KV blocks join (docs/architecture.md, "5. The
request controller and its executors", prefix caching, isolation between tenants; issue 35, F3: a prompt another client had sent came back 60-100x faster, so
anyone could confirm a guessed system prompt).

A request's `CacheScope` (common/runtime/prefix_hash.py) has a salt, mixed into every
block key, and an owner, whom its cached blocks count against when a replica evicts.
Both are keyed hashes (HMAC-SHA256 with a deployment secret) of the request's tenant (an
API key's id, or the client's address: services/auth.py) and its `cache_salt` option,
so a replica never sees a key, and nobody outside can compute another tenant's salt
from what they know. By default only requests of one tenant with the same `cache_salt`
share blocks; with `--share-prefix-cache` the tenant is left out of the salt (requests
of every tenant with the same `cache_salt` share; no `cache_salt`: everyone shares, the
unsalted keys), while eviction still counts blocks per tenant.

The secret: derived from the deployment's data-plane secret under --secure (every
router replica then computes the same salts, and a tenant's prefixes are found through
any of them); a random one per router process otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from specpipe.common.runtime.prefix_hash import CacheScope

MAX_CACHE_SALT_CHARS = 256
SALT_BYTES = 16
_LABEL = b"specpipe cache scope v1"


class CacheScopes:
    """Derives requests' cache scopes (one per router)."""

    def __init__(self, deployment_secret: bytes | None = None, shared: bool = False) -> None:
        """`deployment_secret`: a secret every router of the deployment knows (None: a
        random one); `shared`: the operator lets tenants share cached prefixes."""
        base = deployment_secret if deployment_secret else secrets.token_bytes(32)
        self._secret = hmac.digest(base, _LABEL, hashlib.sha256)
        self.shared = shared

    def _hash(self, *parts: str) -> bytes:
        data = b"\0".join(p.encode("utf-8", "surrogatepass") for p in parts)
        return hmac.digest(self._secret, data, hashlib.sha256)[:SALT_BYTES]

    def of(self, tenant: str, cache_salt: str = "") -> CacheScope:
        """The scope of a request of `tenant` with the `cache_salt` option (ValueError
        when that is too long)."""
        if len(cache_salt) > MAX_CACHE_SALT_CHARS:
            raise ValueError(
                f"cache_salt has {len(cache_salt)} characters, at most {MAX_CACHE_SALT_CHARS}"
            )
        owner = self._hash("owner", tenant)
        if self.shared:
            salt = self._hash("shared", cache_salt) if cache_salt else b""
        else:
            salt = self._hash("tenant", tenant, cache_salt)
        return CacheScope(salt, owner)
