"""Prefix-cache scopes of requests (services/router/cache_scope.py, issue 35 F3): per
tenant and cache_salt, keyed with a deployment secret, never carrying a key."""

from __future__ import annotations

import pytest
from specpipe.services.auth import ApiKeys
from specpipe.services.router.cache_scope import MAX_CACHE_SALT_CHARS, CacheScopes


def test_scopes_separate_tenants_and_salts() -> None:
    scopes = CacheScopes(b"s" * 32)
    a, b = scopes.of("key:a"), scopes.of("key:b")
    assert a == scopes.of("key:a") and a.salt != b.salt and a.owner != b.owner
    assert scopes.of("key:a", "team").salt not in (a.salt, scopes.of("key:b", "team").salt)
    assert scopes.of("key:a", "team").owner == a.owner  # eviction counts the tenant
    assert len(a.salt) == 16


def test_the_operator_may_let_tenants_share() -> None:
    shared = CacheScopes(b"s" * 32, shared=True)
    assert shared.of("key:a").salt == b""  # unsalted: everyone's prefixes meet
    assert shared.of("key:a", "team") == shared.of("key:a", "team")
    assert shared.of("key:a", "team").salt == shared.of("key:b", "team").salt
    assert shared.of("key:a").owner != shared.of("key:b").owner


def test_a_salt_depends_on_the_secret_and_never_shows_the_key() -> None:
    keys = ApiKeys(["sk-very-secret"])
    caller = keys.caller("Bearer sk-very-secret", "10.0.0.1")
    assert "sk-very-secret" not in caller.tenant and caller.tenant.startswith("key:")
    assert keys.caller(None, "10.0.0.1").tenant == "addr:10.0.0.1"
    one, two = CacheScopes(b"1" * 32), CacheScopes(b"2" * 32)
    assert one.of(caller.tenant).salt != two.of(caller.tenant).salt
    assert CacheScopes().of("t").salt != CacheScopes().of("t").salt  # random per router
    assert b"sk-very-secret" not in one.of(caller.tenant).salt + one.of(caller.tenant).owner


def test_an_overlong_cache_salt_is_refused() -> None:
    CacheScopes().of("t", "x" * MAX_CACHE_SALT_CHARS)
    with pytest.raises(ValueError, match="cache_salt"):
        CacheScopes().of("t", "x" * (MAX_CACHE_SALT_CHARS + 1))


def test_a_replica_refuses_an_oversized_scope() -> None:
    """What a stage or the draft reads from Open: hashes of at most 64 bytes."""
    from specpipe.common.runtime.errors import InvalidInput
    from specpipe.common.runtime.prefix_hash import CacheScope
    from specpipe.services.control import cache_scope_from_proto, cache_scope_to_proto

    scope = CacheScope(b"s" * 16, b"o" * 16)
    assert cache_scope_from_proto(cache_scope_to_proto(scope)) == scope
    big = cache_scope_to_proto(CacheScope(b"s" * 16))
    big.salt = b"x" * 65
    with pytest.raises(InvalidInput, match="64 bytes"):
        cache_scope_from_proto(big)
