"""Request leases without a service (common/runtime/lease.py): traffic renews them, they
expire when nobody renews them, a restarted router frees its predecessor's requests at
once, and nobody but the owner's process renews, supersedes or frees its requests."""

from __future__ import annotations

import pytest
from specpipe.common.runtime.errors import InvalidInput, NotOwner
from specpipe.common.runtime.lease import LeaseClaim, LeaseTable, Superseded
from specpipe.services.lease import peer_host

TOKEN_A, TOKEN_B = b"a" * 16, b"b" * 16


def table(seconds: float = 10.0):
    now = [0.0]
    return LeaseTable(seconds, clock=lambda: now[0]), now


def claim(owner: str, epoch: int, token: bytes = TOKEN_A) -> LeaseClaim:
    return LeaseClaim(owner, epoch, token)


def test_a_lease_expires_unless_renewed() -> None:
    leases, now = table()
    r1 = claim("router:1", 1)
    assert leases.grant("a", r1) == [] and leases.grant("b", r1) == []
    now[0] = 9.0
    assert leases.renew("a") and not leases.renew("nope")
    assert leases.expired() == []
    now[0] = 10.0
    assert leases.expired() == ["b"]  # not renewed since 0
    leases.end("b")
    now[0] = 18.9
    assert leases.expired() == []
    now[0] = 19.0
    assert leases.expired() == ["a"]
    leases.end("a")
    assert len(leases) == 0 and "a" not in leases


def test_keep_alive_renews_and_names_what_is_gone() -> None:
    leases, now = table()
    leases.grant("a", claim("r:1", 1))
    leases.grant("other", claim("q:1", 1))
    now[0] = 8.0
    unknown, stale = leases.renew_all(claim("r:1", 1), ["a", "lost", "other"])
    assert unknown == ["lost", "other"] and stale == []  # another owner's is not its
    now[0] = 17.0
    assert leases.expired() == ["other"]


def test_a_restarted_router_frees_its_predecessors_requests() -> None:
    leases, _ = table()
    old, new = claim("host:50051", 1), claim("host:50051", 2, TOKEN_B)
    leases.grant("a", old)
    leases.grant("b", old)
    leases.grant("c", claim("other:50051", 1))
    assert leases.grant("d", new) == ["a", "b"]
    for rid in ("a", "b"):
        leases.end(rid)
    # The old process (somehow still there) is refused; the new one goes on.
    with pytest.raises(Superseded):
        leases.renew_all(old, [])
    with pytest.raises(Superseded):
        leases.grant("e", old)
    assert leases.renew_all(new, ["d"]) == ([], [])
    # A restart noticed by the keep-alive (no new request yet) frees them too.
    assert leases.renew_all(claim("other:50051", 2, TOKEN_B), []) == ([], ["c"])


def test_epochs_compare_as_numbers() -> None:
    """Issue 22, N1: epochs compared as text, so "~x" (or "9") outranked every real
    epoch and freed the router's requests. As numbers, 10 is newer than 9."""
    leases, _ = table()
    leases.grant("a", claim("r:1", 9))
    assert leases.grant("b", claim("r:1", 10, TOKEN_B)) == ["a"]
    with pytest.raises(Superseded):
        leases.renew_all(claim("r:1", 9), [])


def test_only_the_owners_process_renews_its_requests() -> None:
    """The owner's epoch with another token renews and frees nothing (NotOwner)."""
    leases, now = table()
    leases.grant("a", claim("r:1", 5))
    now[0] = 8.0
    with pytest.raises(NotOwner):
        leases.renew_all(claim("r:1", 5, TOKEN_B), ["a"])
    with pytest.raises(NotOwner):
        leases.grant("b", claim("r:1", 5, TOKEN_B))
    assert "b" not in leases
    now[0] = 10.0
    assert leases.expired() == ["a"]  # the refused renewal did not renew it


def test_another_owner_supersedes_nothing() -> None:
    """Issue 22, N1: a caller elsewhere naming the router is another owner (the services
    scope the name by the caller's host without mutual TLS): its newest possible epoch
    frees none of the router's requests."""
    leases, _ = table()
    router = claim("router:50051@10.0.0.5", 5)
    leases.grant("a", router)
    attacker = claim("router:50051@10.0.0.66", (1 << 64) - 1, TOKEN_B)
    assert leases.renew_all(attacker, ["a"]) == (["a"], [])
    assert leases.grant("x", attacker) == []
    assert "a" in leases
    assert leases.renew_all(router, ["a"]) == ([], [])


def test_claims_are_checked() -> None:
    for owner, epoch, token in (
        ("", 1, TOKEN_A),
        ("r", -1, TOKEN_A),
        ("r", 1 << 64, TOKEN_A),
        ("r", 1, b"short"),
        ("r" * 10_000, 1, TOKEN_A),
    ):
        with pytest.raises(InvalidInput):
            LeaseClaim(owner, epoch, token)


def test_requests_without_an_owner_only_expire() -> None:
    leases, now = table(1.0)
    assert leases.grant("a") == [] and leases.grant("b") == []
    now[0] = 1.0
    assert sorted(leases.expired()) == ["a", "b"]
    with pytest.raises(ValueError):
        LeaseTable(0)


def test_peer_host_is_the_callers_address() -> None:
    assert peer_host("ipv4:10.0.0.5:4711") == "10.0.0.5"
    assert peer_host("ipv6:[::1]:4711") == "::1"
    assert peer_host("ipv6:[fd00::2]:80") == "fd00::2"
    assert peer_host("unix:/tmp/s") == "unix:/tmp/s"
