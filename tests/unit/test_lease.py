"""Request leases without a service (common/runtime/lease.py): traffic renews them, they
expire when nobody renews them, and a restarted router frees its predecessor's requests
at once."""

from __future__ import annotations

import pytest
from specpipe.common.runtime.lease import LeaseTable, Superseded


def table(seconds: float = 10.0):
    now = [0.0]
    return LeaseTable(seconds, clock=lambda: now[0]), now


def test_a_lease_expires_unless_renewed() -> None:
    leases, now = table()
    assert leases.grant("a", "router:1", "e1") == [] and leases.grant("b", "router:1", "e1") == []
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
    leases.grant("a", "r:1", "e1")
    now[0] = 8.0
    unknown, stale = leases.renew_all("r:1", "e1", ["a", "lost"])
    assert unknown == ["lost"] and stale == []
    now[0] = 17.0
    assert leases.expired() == []


def test_a_restarted_router_frees_its_predecessors_requests() -> None:
    leases, _ = table()
    leases.grant("a", "host:50051", "0001")
    leases.grant("b", "host:50051", "0001")
    leases.grant("c", "other:50051", "0001")
    assert leases.grant("d", "host:50051", "0002") == ["a", "b"]
    for rid in ("a", "b"):
        leases.end(rid)
    # The old process (somehow still there) is refused; the new one goes on.
    with pytest.raises(Superseded):
        leases.renew_all("host:50051", "0001", [])
    with pytest.raises(Superseded):
        leases.grant("e", "host:50051", "0001")
    assert leases.renew_all("host:50051", "0002", ["d"]) == ([], [])
    # A restart noticed by the keep-alive (no new request yet) frees them too.
    assert leases.renew_all("other:50051", "0002", []) == ([], ["c"])


def test_requests_without_an_owner_only_expire() -> None:
    leases, now = table(1.0)
    assert leases.grant("a") == [] and leases.grant("b") == []
    now[0] = 1.0
    assert sorted(leases.expired()) == ["a", "b"]
    with pytest.raises(ValueError):
        LeaseTable(0)
