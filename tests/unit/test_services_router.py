"""Router pieces that need no deployment: request ids, request defaults, and how much of
the client's deadline each backend call gets."""

from __future__ import annotations

import os
import re

from specpipe.services.router.service import RequestIds


def test_request_ids_are_unique_across_routers_with_the_same_pid(monkeypatch) -> None:
    # Every container's router is pid 1: the prefix must not come from the pid.
    monkeypatch.setattr(os, "getpid", lambda: 1)
    routers = [RequestIds() for _ in range(20)]
    assert len({r.prefix for r in routers}) == len(routers)
    ids = [r.next() for r in routers for _ in range(3)]
    assert len(set(ids)) == len(ids)
    for rid in ids:
        assert re.fullmatch(r"r[0-9a-f]{12}-\d+", rid), rid


def test_request_ids_of_one_router_count_up() -> None:
    r = RequestIds()
    assert [r.next() for _ in range(3)] == [f"{r.prefix}-{i}" for i in range(3)]
